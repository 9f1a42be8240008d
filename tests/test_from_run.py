"""Closed-loop calibration: recording a run, reading it back, refitting the profile."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.calibrate import CalibrationError
from autopar.calibrate.from_run import fit_runs, read_run, refit_profile
from autopar.cli.main import main
from autopar.core.cluster import format_cluster, load_cluster
from autopar.core.cluster.profile import read_profile
from autopar.core.cluster.spec import LinkSpec
from autopar.cost_models.comm import collective_time
from autopar.runtime.record import RUN_FORMAT, RUN_VERSION
from tests.distributed import ROOT, free_port

BASE_DEVICE = {
    "name": "cpu", "memory_bytes": 8 * 2**30, "peak_flops": {"fp32": 2.0e11, "bf16": 1.0e11},
    "memory_bandwidth_bytes_per_s": 3.0e10, "matmul_efficiency": 1.0,
    "matmul_efficiency_curve": [[1e5, 0.5], [1e9, 1.0]], "kernel_floor_s": 2e-6,
    "memory_efficiency": 0.5, "allocation_s_per_byte": 3e-10,
}
PLAN = {
    "mesh": {"dp": 2, "tp": 1},
    "training": {"zero": 0},
    "predicted": {"step_time_s": 0.02, "compute_s": 0.012, "optimizer_s": 0.002,
                  "tp_comm_s": 0.0, "dp_exposed_s": 0.006},
    "cluster": {"name": "2xcpu", "nodes": 1, "devices_per_node": 2, "backend": "gloo",
                "device": BASE_DEVICE,
                "intra_node_link": {"bandwidth_bytes_per_s": 1.5e9, "latency_s": 1.4e-4}},
}
SCALE, LATENCY, BANDWIDTH = 2.5, 1.0e-4, 1.0e9  # what the synthetic run is made of


def ring(kind: str, nbytes: int, n: int = 2) -> float:
    """The communication cost model's time (on gloo: all-gathers priced as all-reduces)."""
    return collective_time(kind, nbytes, n, LinkSpec(BANDWIDTH, LATENCY), backend="gloo")


def synthetic_run(directory: Path, steps: int = 8, world: int = 2, plan: dict = PLAN,
                  busy_s: float = 0.0) -> Path:
    """A run whose device time is SCALE x the plan's and whose collectives follow the ring
    model with LATENCY and BANDWIDTH; the faster rank waits longer in each collective.
    ``busy_s``: each (asynchronous, DDP) collective also holds the step up that long."""
    directory.mkdir(parents=True, exist_ok=True)
    device = SCALE * (PLAN["predicted"]["compute_s"] + PLAN["predicted"]["optimizer_s"])
    sizes = [("all_reduce", 4), ("all_reduce", 4 * 2**20), ("all_gather", 2**20)]
    for rank in range(world):
        records = []
        for i in range(steps):
            skew = 0.001 * (world - 1 - rank) * (1 + i % 3)  # rank 0 computes faster
            noise = 1 + 0.01 * ((i * 7 + rank) % 5 - 2)
            collectives = []
            for j, (kind, nbytes) in enumerate(sizes):
                wait = skew if j == len(sizes) - 1 else 0.0
                collectives.append({"kind": kind, "bytes": nbytes, "group_size": world,
                                    "seconds": ring(kind, nbytes) * noise + wait,
                                    "source": "ddp"})
            comm = sum(c["seconds"] for c in collectives)
            compute = device * noise - (skew if rank == 0 else 0.0)
            step = compute + comm + busy_s * len(collectives) + (0.5 if i == 0 else 0.0)
            records.append({"step": i, "step_s": step, "train_step_s": step - 0.002,
                            "p2p_wait_s": 0.0, "collectives": collectives})
        doc = {"format": RUN_FORMAT, "version": RUN_VERSION, "rank": rank, "world_size": world,
               "backend": "gloo", "host": {"hostname": "test", "cpu_count": 2},
               "warmup_steps": 1, "plan": plan, "steps": records}
        (directory / f"rank{rank}.json").write_text(json.dumps(doc))
    return directory


def test_refit_recovers_known_parameters(tmp_path):
    run = read_run(synthetic_run(tmp_path / "run"))
    fit = fit_runs([run])
    assert fit.device_scale == pytest.approx(SCALE, rel=0.02)
    assert fit.link is not None
    assert fit.link.latency_s == pytest.approx(LATENCY, rel=0.05)
    assert fit.link.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=0.05)
    # the warm-up step is left out, and each collective costs what its last rank waited
    assert len(fit.device_points) == 7
    assert {p.nbytes for p in fit.link_points} == {4, 2**20, 4 * 2**20}

    profile = refit_profile([run], fit)
    device = profile.device
    assert device["peak_flops"]["fp32"] == pytest.approx(2.0e11 / fit.device_scale)
    assert device["memory_bandwidth_bytes_per_s"] == pytest.approx(3.0e10 / fit.device_scale)
    assert device["kernel_floor_s"] == pytest.approx(2e-6 * fit.device_scale)
    assert device["allocation_s_per_byte"] == pytest.approx(3e-10 * fit.device_scale)
    assert device["memory_efficiency"] == 0.5  # efficiencies are shapes, not speeds
    assert profile.intra_node_link["latency_s"] == pytest.approx(fit.link.latency_s)
    assert profile.measurements["from_run"]["device_scale"] == fit.device_scale


def test_calibrate_from_run_writes_a_profile_clusters_read(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run")
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-run", str(run), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "modelled" in text and "measured" in text and "device speed" in text
    profile = read_profile(out)
    cluster_file = tmp_path / "c.yaml"
    cluster_file.write_text(f"nodes: 1\ndevices_per_node: 2\nprofile: {out}\n"
                            "device: {preset: cpu}\n")
    cluster = load_cluster(cluster_file)
    assert cluster.device.peak("fp32") == pytest.approx(profile.device["peak_flops"]["fp32"])
    assert cluster.intra_node.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=0.05)


def test_a_step_stretched_by_another_process_is_left_out(tmp_path):
    run_dir = synthetic_run(tmp_path / "run")
    for rank in (0, 1):
        _edit(run_dir, rank, lambda d: d["steps"][4].update(step_s=d["steps"][4]["step_s"] * 8))
    run = read_run(run_dir)
    assert 4 not in run.kept_steps and len(run.kept_steps) == 6
    assert fit_runs([run]).device_scale == pytest.approx(SCALE, rel=0.02)


def test_one_message_size_keeps_the_link(tmp_path):
    run_dir = synthetic_run(tmp_path / "run")
    for f in run_dir.glob("rank*.json"):
        doc = json.loads(f.read_text())
        for step in doc["steps"]:
            step["collectives"] = step["collectives"][:1]
        f.write_text(json.dumps(doc))
    fit = fit_runs([read_run(run_dir)])
    assert fit.link is None
    # the plan's link (which has no busy latency)
    assert fit.link_dict() == {**PLAN["cluster"]["intra_node_link"], "busy_latency_s": 0.0}


def test_the_plans_busy_latency_is_kept_and_not_counted_as_device_time(tmp_path):
    """CPU processes holding every core: each DDP bucket waits the busy latency. The fit
    takes that wait out of the device time (as the model adds it back) and keeps it."""
    busy = 1e-3
    cluster = {**PLAN["cluster"], "cores_per_node": 2,
               "intra_node_link": {**PLAN["cluster"]["intra_node_link"], "busy_latency_s": busy}}
    run = read_run(synthetic_run(tmp_path / "run", plan={**PLAN, "cluster": cluster},
                                 busy_s=busy))
    fit = fit_runs([run])
    assert fit.device_scale == pytest.approx(SCALE, rel=0.02)  # not slowed by the waits
    assert fit.link_dict()["busy_latency_s"] == busy
    # with a spare core there is no wait to take out: the same steps read as slower device
    spare = read_run(synthetic_run(tmp_path / "spare", plan={**PLAN, "cluster": {
        **cluster, "cores_per_node": 4}}, busy_s=busy))
    assert fit_runs([spare]).device_scale > SCALE * 1.05


def _edit(run_dir: Path, rank: int, change) -> None:
    f = run_dir / f"rank{rank}.json"
    doc = json.loads(f.read_text())
    change(doc)
    f.write_text(json.dumps(doc))


BAD_RUNS = [
    ("missing", None, "not found"),
    ("a file", "file", "is a file, not a run directory"),
    ("empty", "empty", "holds no rank*.json"),
    ("corrupt", lambda d: None, "not valid JSON"),
    ("format", lambda d: d.update(format="autopar-profile"), "not an autopar run record"),
    ("version", lambda d: d.update(version=99), "version 99"),
    ("step field", lambda d: d["steps"][2].update(step_s="fast"), "steps[2].step_s"),
    ("collective kind", lambda d: d["steps"][1]["collectives"][0].update(kind="gossip"),
     "steps[1].collectives[0].kind"),
    ("no plan", lambda d: d.pop("plan"), "plan must be the plan that ran"),
    ("too few steps", lambda d: d.update(steps=d["steps"][:1]), "nothing is left to fit"),
]


@pytest.mark.parametrize("case,change,message", BAD_RUNS, ids=[c[0] for c in BAD_RUNS])
def test_bad_run_directories_say_what_where_and_fix(tmp_path, case, change, message):
    run_dir = tmp_path / "run"
    if case == "a file":
        run_dir.write_text("{}")
    elif case == "empty":
        run_dir.mkdir()
    elif change is not None:
        synthetic_run(run_dir)
        if case == "corrupt":
            (run_dir / "rank1.json").write_text('{"format": "autopar-run", "steps": [')
        elif case == "too few steps":
            for rank in (0, 1):
                _edit(run_dir, rank, change)
        else:
            _edit(run_dir, 1, change)
    with pytest.raises(CalibrationError) as info:
        read_run(run_dir)
    err = info.value
    assert message in str(err)
    assert err.where and err.fix


def test_missing_rank_and_cli_exit_status(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "run", world=3)
    (run_dir / "rank1.json").unlink()
    with pytest.raises(CalibrationError, match="missing rank 1"):
        read_run(run_dir)
    assert main(["calibrate", "--from-run", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "p.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_other_plans_device_numbers_are_not_fitted_together(tmp_path):
    a = read_run(synthetic_run(tmp_path / "a"))
    b_dir = synthetic_run(tmp_path / "b")
    for rank in (0, 1):
        _edit(b_dir, rank, lambda d: d["plan"]["cluster"]["device"].update(kernel_floor_s=1e-6))
    with pytest.raises(CalibrationError, match="other device numbers"):
        fit_runs([a, read_run(b_dir)])


def _record_demo(tmp_path: Path, steps: int, **pins) -> Path:
    """Run the demo's model on 2 gloo processes with a plan pinned by ``pins``, recorded."""
    import autopar
    from autopar.cli.demo_data import demo_batches, demo_model

    plan = autopar.plan(demo_model(), "2xcpu", demo_batches(1)[0], **pins)
    plan.save(tmp_path / "plan.json")
    record = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", "-m", "autopar.cli.demo_worker", "--steps", str(steps),
           "--out", str(tmp_path / "result.json"), "--cluster", "2xcpu",
           "--plan", str(tmp_path / "plan.json"), "--record-run", str(record)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return record


@pytest.mark.slow
def test_recorder_writes_valid_files_on_a_2_process_run(tmp_path):
    from autopar.cli.demo_data import demo_model

    run = read_run(_record_demo(tmp_path, 4, dp=2, zero=0))
    assert run.world_size == 2 and len(run.ranks[0].steps) == 4
    assert set(run.ranks[0].timed) >= {"autopar", "ddp", "fsdp"}
    grads = 4 * sum(p.numel() for p in demo_model().parameters())
    for rank in run.ranks:
        for step in rank.steps:
            kinds = {(c["source"], c["kind"]) for c in step["collectives"]}
            assert ("ddp", "all_reduce") in kinds  # DDP's gradient buckets
            # the loss average runs beside the backward, priced as hidden: not recorded
            assert ("loss", "all_reduce") not in kinds
            ddp = [c for c in step["collectives"] if c["source"] == "ddp"]
            assert sum(c["bytes"] for c in ddp) == grads
            assert all(c["group_size"] == 2 for c in step["collectives"])
            assert step["step_s"] >= step["train_step_s"] > 0
    fit = fit_runs([run])
    # The link is refitted only when the run recorded collectives of several sizes that did
    # not overlap compute; whether DDP's buckets did depends on this machine's timing.
    assert fit.device_scale > 0
    assert fit.link is None or fit.link.bandwidth_bytes_per_s > 0


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(dp=2, zero=3), dict(pp=2, microbatches=4, schedule="1f1b")],
                         ids=["zero3", "pipeline"])
def test_recorder_times_fsdp_and_pipelines(tmp_path, pins):
    run = read_run(_record_demo(tmp_path, 3, **pins))
    for rank in run.ranks:
        for step in rank.steps:
            sources = {(c["source"], c["kind"]) for c in step["collectives"]}
            if "pp" in pins:
                assert step["p2p_wait_s"] > 0 and ("loss", "broadcast") in sources
            else:
                assert {("fsdp", "all_gather"), ("fsdp", "reduce_scatter")} <= sources
    assert fit_runs([run]).device_scale > 0


@pytest.fixture(scope="module")
def quick_measurement() -> dict:
    """``autopar calibrate --quick --default-dtype-only``'s measurement of this machine, taken
    once for the tests below (the demo's first run takes the same one): what it returned
    and the texts it printed."""
    from autopar.calibrate import host_info
    from autopar.cli.calibrate_cmd import measure_profile

    said: list[tuple[str, str]] = []
    host = host_info("cpu", 2, 1, True)
    profile = measure_profile("cpu", 2, host, threads=1, quick=True, default_dtype_only=True,
                              say=lambda text: said.append(("say", text)),
                              progress=lambda text: said.append(("progress", text)))
    return {"host": host, "profile": profile, "said": said}


@pytest.fixture
def measured_once(quick_measurement, monkeypatch):
    """``measure_profile`` answers this module's calls from the one measurement: the same
    arguments (checked), the same texts printed, a copy of the same profile."""
    import autopar.cli.calibrate_cmd as calibrate_cmd

    def replay(device_type, nproc, host, *, threads=1, quick=False, default_dtype_only=False,
               say=lambda text: print(text, flush=True), progress=None):
        assert (device_type, nproc, threads, quick, default_dtype_only) == ("cpu", 2, 1, True,
                                                                           True)
        assert host == quick_measurement["host"]
        for kind, text in quick_measurement["said"]:
            (say if kind == "say" else progress or calibrate_cmd._progress)(text)
        return copy.deepcopy(quick_measurement["profile"])

    monkeypatch.setattr(calibrate_cmd, "measure_profile", replay)


@pytest.mark.slow
def test_demo_prints_predicted_and_measured_step_times(tmp_path, monkeypatch, capsys,
                                                       measured_once):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["demo", "--steps", "3", "--record-run", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")
             and line.split()[:1] and line.split()[0] in ("predicted", "measured", "refitted")}
    assert "modelled" in lines["predicted"] and "ms" in lines["predicted"]
    assert "measured" in lines["measured"] and "ms" in lines["measured"]
    assert "modelled" in lines["refitted"]
    # the plan may use 1 of the 2 processes (a loaded machine): the header names what ran
    world = read_run(tmp_path / "run").world_size
    ran = "2 gloo processes" if world == 2 else f"the plan's {world} of 2 gloo processes"
    assert "the plan (modelled)" in text and f"single device vs {ran}" in text
    if world == 2:  # the refit separates device speed and co-run slowdown with the one-process
        # step, so the refitted profile prices one process as it measured
        after = [line for line in text.splitlines() if "modelled after the refit" in line]
        assert len(after) == 1 and "co-run slowdown" in lines["refitted"], text
        assert abs(float(after[0].split("(")[1].split("%")[0])) < 2, after
    assert any(line.startswith("mesh ") for line in text.splitlines())
    # a first demo measures this machine and plans with what it measured
    assert "no profile of this machine yet: measuring it first" in text
    kept = list((tmp_path / "cache" / "autopar").glob("demo-profile-*.json"))
    assert len(kept) == 1 and f"planned with profile {kept[0]}" in lines["predicted"]
    assert read_profile(kept[0]).device["corun_slowdown"] >= 0
    # a run record (its directory or a rank file) reports as its plan beside the run
    for given in (tmp_path / "run", tmp_path / "run" / f"rank{world - 1}.json"):
        assert main(["report", str(given), "-o", str(tmp_path / "run.html")]) == 0
        assert "wrote" in capsys.readouterr().out
        assert "Predicted vs measured" in (tmp_path / "run.html").read_text()


@pytest.mark.slow
def test_calibrate_cli_end_to_end(tmp_path, capsys, measured_once):
    out = tmp_path / "profiles" / "cpu.json"
    out.parent.mkdir()  # --out never creates directories (a typo would go unnoticed)
    assert main(["calibrate", "--quick", "--default-dtype-only", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "matmul fp32 (measured" in text and "intra-node link (fitted" in text
    assert f"wrote {out}" in text
    profile = read_profile(out)
    assert profile.host["backend"] == "gloo" and profile.host["threads_per_process"] == 1
    assert "attention efficiency" in text and 0 < profile.device["attention_efficiency"] <= 1
    # the co-run slowdown, measured on training steps with one process per core
    assert "co-run slowdown (measured" in text and profile.device["corun_slowdown"] >= 0
    assert profile.measurements["corun"]["processes"] == 2
    # FSDP2's host work per parameter tensor, measured on two gloo processes
    assert "FSDP2 host work (measured" in text
    assert profile.device["sharded_host_s_per_tensor"] >= 0
    assert profile.device["sharded_optimizer_s_per_tensor"] >= 0
    assert profile.measurements["sharded_host"]["measured"]["tensors"] > 0
    kinds = {p["kind"] for p in profile.measurements["collectives"]["points"]}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("nodes: 1\ndevices_per_node: 2\ndevice: cpu\nprofile: profiles/cpu.json\n")
    c = load_cluster(cluster)
    link = profile.intra_node_link
    assert c.intra_node.bandwidth_bytes_per_s == link["bandwidth_bytes_per_s"]
    assert c.device.peak("fp32") == profile.device["peak_flops"]["fp32"]
    assert c.sources["intra_node.latency_s"] == f"profile {tmp_path / 'profiles' / 'cpu.json'}"
    assert "profile " in format_cluster(c)


def test_runs_planned_with_a_refitted_profile_fit_together(tmp_path):
    """A second run planned with the first's refitted device (the same device, k x slower
    in every time term) brings its modelled time back to the first run's numbers."""
    a = read_run(synthetic_run(tmp_path / "a"))
    first = fit_runs([a])
    b_dir = synthetic_run(tmp_path / "b")
    k = 2.0
    slower = dict(BASE_DEVICE, peak_flops={d: v / k for d, v in BASE_DEVICE["peak_flops"].items()},
                  memory_bandwidth_bytes_per_s=BASE_DEVICE["memory_bandwidth_bytes_per_s"] / k,
                  kernel_floor_s=BASE_DEVICE["kernel_floor_s"] * k,
                  allocation_s_per_byte=BASE_DEVICE["allocation_s_per_byte"] * k)

    def replan(doc):
        doc["plan"]["cluster"]["device"] = slower
        for key in ("compute_s", "optimizer_s"):
            doc["plan"]["predicted"][key] *= k

    for rank in (0, 1):
        _edit(b_dir, rank, replan)
    both = fit_runs([a, read_run(b_dir)])
    assert both.device_scale == pytest.approx(first.device_scale, rel=1e-9)
    assert len(both.device_points) == 14


def test_plan_dict_is_not_mutated_by_fitting(tmp_path):
    before = copy.deepcopy(PLAN)
    fit_runs([read_run(synthetic_run(tmp_path / "run"))])
    assert before == PLAN


def test_huber_scale_is_least_squares_on_clean_data_and_resists_a_stretched_step():
    from autopar.calibrate.from_run import huber_scale

    d = [1.0, 2.0, 3.0, 1.5, 2.5, 1.0, 2.0, 3.0]
    y = [2.0 * x * (1 + 0.01 * (i % 3 - 1)) for i, x in enumerate(d)]
    least_squares = sum(a * b for a, b in zip(d, y)) / sum(a * a for a in d)
    assert huber_scale(d, y) == pytest.approx(least_squares, rel=1e-3)
    y[3] *= 10  # another process stretched one step tenfold
    assert huber_scale(d, y) == pytest.approx(2.0, rel=0.05)
