"""Plans: the solver's choices on known cases, determinism, JSON round trip, the schema, the
cluster a plan was made for, and planning errors reaching every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.api.parallelize import error_from_json, error_to_json
from autopar.cli.load import trace_model
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError, NoFeasiblePlanError, PlanError, RuntimeSetupError
from autopar.core.plan import Plan
from autopar.models import GPT, GPTConfig
from tests.distributed import ROOT, free_port


@pytest.fixture(scope="module")
def tiny_gpt_plan() -> Plan:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    return autopar.plan(model, "2xcpu", (idx, idx))


def test_required_fields_present(tiny_gpt_plan: Plan) -> None:
    data = json.loads(tiny_gpt_plan.to_json())
    assert isinstance(data["schema_version"], int)
    # A model this small may be planned on fewer of the 2 devices (explanation.devices).
    assert data["mesh"]["dp"] * data["mesh"]["tp"] == data["explanation"]["devices"]["used"]
    assert data["cluster"]["devices"] == 2
    for key in ("step_time_s", "peak_memory_bytes", "tflops_per_device", "tokens_per_s"):
        assert data["predicted"][key] > 0, key
    assert data["solver"]["status"] == "OPTIMAL"
    assert data["solver"]["wall_s"] >= 0
    assert data["model"]["params"] == sum(
        p.numel() for p in GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2,
                                          n_embd=32)).parameters()
    )
    assert len(data["model"]["fingerprint"]) == 16
    assert data["cluster"]["devices"] == 2


def test_round_trips_exactly(tiny_gpt_plan: Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    tiny_gpt_plan.save(path)
    loaded = Plan.load(path)
    assert loaded == tiny_gpt_plan
    assert loaded.to_json() == tiny_gpt_plan.to_json()


def test_strategies_parse_back(tiny_gpt_plan: Plan) -> None:
    for name in tiny_gpt_plan.strategies:
        assert tiny_gpt_plan.strategy(name, "tp") is not None
        assert tiny_gpt_plan.strategy(name, "dp") is not None


def test_other_model_is_rejected(tiny_gpt_plan: Plan) -> None:
    with pytest.raises(PlanError) as e:
        tiny_gpt_plan.check_model("0123456789abcdef", "MyModel")
    text = str(e.value)
    assert tiny_gpt_plan.model["fingerprint"] in text and "0123456789abcdef" in text
    assert "re-plan" in text


def test_other_schema_version_is_rejected(tiny_gpt_plan: Plan) -> None:
    data = tiny_gpt_plan.to_dict()
    data["schema_version"] = 99
    with pytest.raises(PlanError, match="schema version 99"):
        Plan.from_dict(data)


def test_same_inputs_same_plan() -> None:
    def make() -> str:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=64))
        idx = torch.randint(0, 64, (8, 16))
        plan = autopar.plan(model, "tests/clusters/cpu-fast-links.yaml", (idx, idx))
        plan.solver["wall_s"] = 0.0
        for c in plan.solver["candidates"]:
            c["wall_s"] = 0.0
            for s in c.get("solve_stats", []):
                s["wall_s"] = 0.0
        for s in plan.solver.get("plan_solves", []):
            s["wall_s"] = 0.0
        return plan.to_json()

    assert make() == make()


def test_small_gpt_on_8_a100_is_pure_data_parallel() -> None:
    traced = trace_model("gpt-125m", None, None)
    plan = autopar.plan(traced.gm, "8xA100-80GB", global_batch=traced.batch)
    assert plan.mesh == {"dp": 8, "tp": 1}
    assert not any(row["strategies"] for row in plan.layers)  # nothing sharded on tp


def _param(plan: Plan, suffix: str) -> str:
    (placement,) = [ax["tp"] for fqn, ax in plan.params.items() if fqn.endswith(suffix)][:1]
    return placement


def test_megatron_pairing_comes_out_of_the_solver() -> None:
    """Llama-3-8B layers on one 8xH100 node with tp pinned to 8 and a batch too small to
    split 8 ways: gate/up are split by output features (column), down by input features
    (row) — found by the solver, not written for Llama. Attention is split by heads, its
    projections either Megatron's column-parallel ones or sequence-split with whole weights
    and an all-to-all into heads (Ulysses within tp: with 8 kv heads of 32 the keys and
    values it moves are a quarter of the queries', less than gathering the layer input)."""
    pytest.importorskip("transformers")
    traced = trace_model("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,"
                         "seq=4096,batch=2", None, None)
    plan = autopar.plan(traced.gm, "8xH100-80GB", global_batch=2, tp=8)
    for name in ("mlp.gate_proj", "mlp.up_proj"):
        assert _param(plan, f"layers.0.{name}.weight") == "S(0)", name
    assert _param(plan, "layers.0.mlp.down_proj.weight") == "S(1)"
    # The MLP computes as Megatron's pair: column-parallel matmuls feed a row-parallel one
    # whose partial sums are reduced once.
    layer = next(row for row in plan.layers if row["block"] == "model.layers")["strategies"]
    matmuls = [s for name, s in layer.items() if "aten.linear" in name]
    assert matmuls.count("(R,S(0))->(S(2))") >= 2  # gate, up
    assert "(S(2),S(1))->(P)" in matmuls  # down
    attention = [s for name, s in layer.items() if "scaled_dot_product" in name]
    assert attention == ["(S(1),S(1),S(1),R)->(S(1))"]  # heads split
    projections = matmuls[:3]  # q, k, v
    assert (projections == ["(R,S(0))->(S(2))"] * 3
            or projections == ["(S(1),R)->(S(1))"] * 3), projections


@pytest.mark.slow
def test_llama3_70b_needs_tensor_parallelism_inside_nodes() -> None:
    pytest.importorskip("transformers")
    traced = trace_model("llama3-70b", None, None)
    # Keeping every activation, it fits only with tp, inside a node. (With per-op
    # recomputation ZeRO-3 alone fits too, and the planner may prefer it.)
    plan = autopar.plan(traced.gm, "16x8xH100-80GB", global_batch=traced.batch,
                        recompute=("none",))
    assert plan.mesh["tp"] > 1 and 8 % plan.mesh["tp"] == 0
    assert plan.predicted["peak_memory_bytes"] <= 80 * 2**30
    # Without tensor or context parallelism (and without recomputing activations) no plan
    # fits. (Left free, cp would be tried once nothing fits without it.)
    with pytest.raises(autopar.core.errors.NoFeasiblePlanError, match="fits on no mesh"):
        autopar.plan(traced.gm, "16x8xH100-80GB", global_batch=traced.batch, tp=1, cp=1,
                     recompute=("none",))


# --- the schema: what the writer writes, the reader accepts ---------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb_v"])
def test_pipeline_plans_of_every_schedule_load_back(schedule: str) -> None:
    traced = trace_model("gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16,batch=8", None, None)
    plan = autopar.plan(traced.gm, "4xcpu", global_batch=8, pp=2, microbatches=4,
                        schedule=schedule, time_limit_s=5)
    assert plan.pipeline["schedule"] == schedule
    assert Plan.from_json(plan.to_json()) == plan


# --- the cluster a plan was made for --------------------------------------------------------

def test_same_cluster_described_another_way_is_accepted(tiny_gpt_plan: Plan) -> None:
    """Same device kind, counts and backend; other link speeds (a recalibrated profile)."""
    data = load_cluster("2xcpu").to_dict()
    data["name"] = "my two cpus"
    data["intra_node_link"]["bandwidth_bytes_per_s"] *= 3
    tiny_gpt_plan.check_cluster(load_cluster(data))


@pytest.mark.parametrize("other", ["4xcpu", "2x1xcpu", "2xH100-80GB", "2xA100-80GB"])
def test_plan_for_another_cluster_is_refused(tiny_gpt_plan: Plan, other: str) -> None:
    with pytest.raises(PlanError) as e:
        tiny_gpt_plan.check_cluster(load_cluster(other))
    assert "'2xcpu'" in e.value.what and f"'{other}'" in e.value.what
    assert e.value.where == "cluster" and "re-plan" in e.value.fix


def test_parallelize_refuses_a_plan_made_for_something_else(tmp_path) -> None:
    """Another cluster, a hand-edited file, planning keywords beside a plan, another example
    batch size."""
    if dist.is_initialized() or "RANK" in os.environ:
        pytest.skip("needs a single process without a process group")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    plan = autopar.plan(model, "cpu", (idx, idx))
    with pytest.raises(PlanError, match="made for cluster 'cpu'.*'H100-80GB'"):
        autopar.parallelize(model, "H100-80GB", (idx, idx), plan=plan)
    edited = plan.to_dict()
    edited["batch"]["microbatch"] = 3
    path = tmp_path / "p.json"
    path.write_text(json.dumps(edited))
    with pytest.raises(PlanError) as e:
        autopar.parallelize(model, "cpu", (idx, idx), plan=str(path))
    assert e.value.where == "batch.microbatch"
    with pytest.raises(AutoparError, match=r"planning keywords \(tp, zero\)") as e:
        autopar.parallelize(model, "cpu", (idx, idx), plan=plan, tp=1, zero=0)
    assert e.value.where == "autopar.parallelize(tp=...)"
    bigger = torch.randint(0, 64, (8, 16))
    with pytest.raises(PlanError, match="batches of 4 sequence.*have 8 of 16") as e:
        autopar.parallelize(model, "cpu", (bigger, bigger), plan=plan)
    assert e.value.where == "batch.traced"


def test_parallelize_refuses_a_cluster_of_another_size_at_start_up() -> None:
    if dist.is_initialized() or "RANK" in os.environ:
        pytest.skip("needs a single process without a process group")
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    with pytest.raises(RuntimeSetupError) as e:
        autopar.parallelize(model, "2xcpu", (idx, idx))
    assert "'2xcpu' needs 2 processes but 1 was launched" in e.value.what
    assert "torchrun --nproc-per-node 2" in e.value.fix


# --- planning errors reach every rank -------------------------------------------------------

def test_planning_errors_travel_as_data() -> None:
    sent = NoFeasiblePlanError("no mesh", where="pp/dp/tp", fix="pin less")
    back = error_from_json(json.loads(json.dumps(error_to_json(sent))))
    assert type(back) is NoFeasiblePlanError and str(back) == str(sent)
    bug = error_from_json(error_to_json(ZeroDivisionError("division by zero")))
    assert type(bug) is AutoparError and "ZeroDivisionError: division by zero" in bug.what
    forged = error_from_json({"class": "SystemExit", "what": "x", "where": "", "fix": ""})
    assert type(forged) is AutoparError  # only autopar's own error classes are raised


@pytest.mark.slow
def test_planning_error_on_rank_0_is_raised_on_every_rank(tmp_path) -> None:
    """Rank 0 fails to plan (tp=3 on 2 devices); rank 1 must raise the same error, not wait
    in the broadcast forever (the workers' process group times out after a minute)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", str(ROOT / "tests" / "workers" / "plan_error.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               AUTOPAR_TEST_OUT=str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)
               if (tmp_path / f"rank{r}.json").exists()]
    assert proc.returncode == 0 and len(records) == 2, proc.stderr[-3000:]
    assert records[0] == records[1], records
    assert records[0]["class"] == "NoFeasiblePlanError" and "tp=3" in records[0]["what"]


def test_a_graph_traced_on_one_sequence_is_planned_at_microbatch_one() -> None:
    """Traced on one sequence, no batch dimension can be found and every cost is that of one
    sequence: the planner must not pick larger microbatches as if they were free (it once
    predicted a 405B model at 106% MFU that way). Traced on several, the same plan results."""
    from autopar.models import resolve_model
    from autopar.trace import trace

    spec = resolve_model("llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=256,seq=512")
    plans = {}
    for batch in (1, 8):
        with torch.device("meta"):
            model = spec.build()
        gm = trace(model, spec.example_inputs(batch, 512))
        plans[batch] = autopar.plan(gm, "8xH100-80GB", global_batch=64, precision="bf16", dp=2,
                                    tp=4)
    one, eight = plans[1], plans[8]
    assert one.batch["microbatch"] == 1
    assert one.predicted["step_time_s"] >= 0.98 * eight.predicted["step_time_s"]
    assert one.predicted["mfu"] < 1
    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(1, 512))
    with pytest.raises(AutoparError) as err:
        autopar.plan(gm, "8xH100-80GB", global_batch=64, microbatch=4, dp=2, tp=4)
    assert err.value.where == "microbatch" and "one sequence" in str(err.value)


def test_a_spent_solve_budget_is_stated_in_the_plan() -> None:
    """Past ``max_solves`` CP-SAT solves, settings are priced only with layouts solved before,
    and the plan (and its summary) says the search stopped there: never a silent best."""
    from autopar.core.plan_summary import format_plan

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 96, (8, 16))
    full = autopar.plan(model, "4xcpu", (idx, idx), max_solves=None)
    assert full.solver["solves"] > 1 and not full.solver["budget_reached"]
    cut = autopar.plan(model, "4xcpu", (idx, idx), max_solves=1)
    assert cut.solver["solves"] == 1 and cut.solver["budget_reached"]
    assert any("solve budget of 1" in c["status"] for c in cut.solver["candidates"])
    assert "budget of 1 CP-SAT solves" in format_plan(cut, "gpt")
    assert Plan.from_json(cut.to_json()) == cut
    with pytest.raises(AutoparError, match="max_solves"):
        autopar.plan(model, "4xcpu", (idx, idx), max_solves=0)
