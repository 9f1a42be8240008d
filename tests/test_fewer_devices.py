"""A plan may use fewer devices than the cluster has, when that is predicted faster, and
says so (``plan.explanation["devices"]``, the summary, the JSON); ranks it leaves idle train
nothing and return the same loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autopar
from autopar.api.planning import device_counts
from autopar.core.errors import AutoparError, PlanError
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_plan
from autopar.models import GPT, GPTConfig
from tests.distributed import FAST, ROOT, run_cases

SLOW = str(ROOT / "tests" / "clusters" / "cpu-slow-links.yaml")


def tiny_gpt() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx)


@pytest.fixture(scope="module")
def slow_plan() -> Plan:
    model, batch = tiny_gpt()
    return autopar.plan(model, SLOW, batch, time_limit_s=5)


def test_slow_links_plan_uses_one_device(slow_plan: Plan) -> None:
    assert slow_plan.world_size == 1
    assert slow_plan.cluster["devices"] == 2
    devices = slow_plan.explanation["devices"]
    assert devices["used"] == 1 and devices["cluster"] == 2 and not devices["pinned"]
    assert devices["why"].startswith("uses 1 of 2 devices: predicted step")
    steps = {a["devices"]: a["step_time_s"] for a in devices["alternatives"]}
    assert steps[1] <= steps[2]  # modelled: the reason it gives (a tie goes to fewer)
    assert "uses 1 of 2 devices" in format_plan(slow_plan, "tiny gpt")


def test_fewer_devices_round_trip_through_json(slow_plan: Plan, tmp_path: Path) -> None:
    slow_plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == slow_plan
    assert json.loads((tmp_path / "plan.json").read_text())["explanation"]["devices"]["used"] == 1


def test_hand_edited_device_counts_are_refused(slow_plan: Plan) -> None:
    data = slow_plan.to_dict()
    del data["explanation"]["devices"]  # fewer ranks than devices, with nothing saying so
    with pytest.raises(PlanError, match="has 1 ranks"):
        Plan.from_dict(data)
    data = slow_plan.to_dict()
    data["explanation"]["devices"]["used"] = 2  # says 2, the mesh has 1
    with pytest.raises(PlanError) as e:
        Plan.from_dict(data)
    assert e.value.where == "explanation.devices"


def test_fast_links_keep_every_device() -> None:
    model, batch = tiny_gpt()
    plan = autopar.plan(model, FAST, batch, time_limit_s=5)
    devices = plan.explanation["devices"]
    assert plan.world_size == 4 == devices["used"], devices
    assert devices["why"].startswith("uses all 4 devices")


def test_devices_pin() -> None:
    model, batch = tiny_gpt()
    plan = autopar.plan(model, FAST, batch, devices=2, time_limit_s=5)
    assert plan.world_size == 2 and plan.cluster["devices"] == 4
    assert plan.explanation["devices"]["pinned"]
    assert "pinned (devices=2)" in plan.explanation["devices"]["why"]


def test_devices_candidates_and_errors() -> None:
    four = autopar.load_cluster("4xcpu")
    assert device_counts(four, None) == [4, 2, 1]
    assert device_counts(four, None, pinned_mesh=True) == [4]  # dp=/tp=/pp= fill the cluster
    assert device_counts(four, 3) == [3]
    two_nodes = autopar.load_cluster("2x4xcpu")
    assert device_counts(two_nodes, None) == [8, 4, 2, 1]
    for bad, match in ((9, "more than"), (6, "neither whole nodes"), (0, "positive"),
                       (True, "positive"), ("2", "positive")):
        with pytest.raises(AutoparError, match=match):
            device_counts(two_nodes, bad)


def test_cli_devices_flag(tmp_path: Path) -> None:
    from autopar.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "gpt:layers=2,hidden=32,heads=4,vocab=96,seq=16", "--cluster", "4xcpu",
                 "--devices", "1", "--global-batch", "4", "--json", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.world_size == 1 and plan.explanation["devices"]["pinned"]


@pytest.mark.slow
def test_fewer_devices_train_like_one_device(tmp_path: Path) -> None:
    """2 processes on the slow-links cluster: rank 0 trains alone (equal to one device, every
    gradient), rank 1 idles and reads the same losses; a pinned devices=1 plan of Llama too,
    its gradients clipped (the idle rank takes part in the norm and reads it)."""
    cases = [{"model": "gpt", "cluster": SLOW},
             {"model": "llama", "devices": 1, "clip": 0.05}]
    results = run_cases(2, tmp_path, cases, worker="fewer_devices.py")
    for rank, records in enumerate(results):
        for r in records:
            assert r["ok"], r
            assert r["used"] == 1 and r["active"] == (rank == 0), r
    assert results[0][0]["explanation"]["used"] == 1
    for r in results[0]:  # the recorded run is the plan's one rank (the idle one wrote none)
        assert r["run_ranks"] == [0] and r["run_world"] == 1, r


@pytest.mark.slow
def test_fewer_devices_on_a_sub_mesh(tmp_path: Path) -> None:
    """4 processes, plans on 2 of them: data parallelism (DDP on a sub-group) and a pipeline
    with tied embeddings (its tied-weight groups made on the active ranks only); then a plan
    on all 4, whose mesh groups mix ranks that were active and idle: their groups must still
    meet (a group made on the active ranks alone once named the next ones apart, and the
    launch hung); then tied pipelines on all 4 (pp 2 x dp 2: the pp group; pp 4: the first
    and last ranks' group, made with the mesh)."""
    cases = [{"model": "gpt", "devices": 2, "dp": 2},
             {"model": "gpt", "devices": 2, "pp": 2, "microbatches": 2, "tied": True},
             {"model": "gpt", "dp": 2, "tp": 2},
             {"model": "gpt", "pp": 2, "dp": 2, "microbatches": 2, "tied": True},
             {"model": "gpt", "layers": 4, "pp": 4, "microbatches": 4, "tied": True}]
    results = run_cases(4, tmp_path, cases, worker="fewer_devices.py", timeout=600)
    for rank, records in enumerate(results):
        for r in records:
            assert r["ok"], r
            used = r["case"].get("devices", 4)
            assert r["used"] == used and r["active"] == (rank < used), r
    for r in results[0]:
        assert r["run_ranks"] == list(range(r["used"])) and r["run_world"] == r["used"], r


def test_plan_on_fewer_devices_runs_on_just_those(slow_plan: Plan) -> None:
    """The plan says "or launch 1 process with this plan": one process (no torchrun) runs it,
    while a plan for all 2 devices refuses a launch of 1."""
    model, batch = tiny_gpt()
    _, expected = model(*batch)
    pm = autopar.parallelize(model, SLOW, batch, plan=slow_plan)
    args, kwargs = pm.shard_batch(*batch)
    assert torch.allclose(pm.train_step(*args, **kwargs), expected.detach())
    whole = autopar.plan(*tiny_gpt()[:1], SLOW, batch, devices=2, time_limit_s=5)
    with pytest.raises(AutoparError, match="needs 2 processes but 1 was launched"):
        autopar.parallelize(tiny_gpt()[0], SLOW, batch, plan=whole)


def test_processes_sharing_cores_plan_fewer_devices(tmp_path: Path) -> None:
    """Four processes on one core each get a quarter of it (``cores_per_node``): splitting
    the work four ways gains nothing, so even with free links the plan uses one device, and
    the one it uses gets the whole core (modelled)."""
    shared = tmp_path / "shared.yaml"
    shared.write_text(Path(FAST).read_text() + "cores_per_node: 1\n")
    model, batch = tiny_gpt()
    plan = autopar.plan(model, str(shared), batch, time_limit_s=5)
    assert plan.world_size == 1 and plan.cluster["devices"] == 4
    assert plan.cluster["cores_per_node"] == 1
    alone = autopar.plan(model, FAST, batch, devices=1, time_limit_s=5)
    assert plan.predicted["step_time_s"] == pytest.approx(alone.predicted["step_time_s"])
