"""The co-run slowdown: CPU processes training at once are each slower than one alone.

Measured on this project's 2-core VMs with ``benchmarks/cpu_step_parts.py``: 1.45x a step
on one (Intel Xeon), 1.07x on another (AMD EPYC), while microbenchmarks run together showed
nothing. ``autopar calibrate`` measures it on training steps, and the cost model must slow
every process of a plan by it, and a plan on fewer processes not.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.calibrate import CollectivePoint, make_profile, measure_corun
from autopar.calibrate.from_run import fit_runs, read_run, refit_profile
from autopar.cli.demo_data import demo_batches, demo_model
from autopar.core.cluster import load_cluster
from autopar.core.cluster.profile import read_profile, write_profile
from autopar.core.errors import ClusterError
from tests.test_calibrate import recorded_device
from tests.test_from_run import synthetic_run


def _cpu(devices: int, slowdown: float, cores: int = 2) -> dict:
    return {"name": "corun", "nodes": 1, "devices_per_node": devices, "cores_per_node": cores,
            "device": {"preset": "cpu", "corun_slowdown": slowdown}}


@pytest.mark.parametrize("devices, cores, share", [
    (1, 2, 1.0),              # alone: full speed
    (2, 2, 1 / 1.5),          # two at once: each 1.5x slower
    (4, 2, 0.5 / 1.5),        # two cores time-sliced between four, two computing at once
    (3, 4, 1 / 2.0),          # three at once on four cores: 1 + 2 x 0.5
])
def test_compute_share_slows_each_process_by_those_computing_beside_it(devices, cores, share):
    assert load_cluster(_cpu(devices, 0.5, cores)).device.compute_share == pytest.approx(share)


def test_a_plan_on_two_processes_is_slower_by_the_slowdown_and_one_alone_is_not() -> None:
    batch = demo_batches(1)[0]
    pins = dict(dp=2, tp=1, pp=1, zero=0, microbatches=1, recompute="none")
    base = autopar.plan(demo_model(), _cpu(2, 0.0), batch, **pins).predicted
    slow = autopar.plan(demo_model(), _cpu(2, 0.5), batch, **pins).predicted
    assert slow["compute_s"] == pytest.approx(1.5 * base["compute_s"], rel=1e-6)
    assert slow["dp_comm_s"] == pytest.approx(base["dp_comm_s"], rel=1e-6)  # the link's
    one = dict(pins, dp=1)
    alone = [autopar.plan(demo_model(), _cpu(1, s), batch, **one).predicted["compute_s"]
             for s in (0.0, 0.5)]
    assert alone[0] == pytest.approx(alone[1], rel=1e-9)


def test_a_bad_slowdown_is_refused_naming_the_field(tmp_path) -> None:
    with pytest.raises(ClusterError) as err:
        load_cluster(_cpu(2, -0.1))
    assert "corun_slowdown" in str(err.value)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "autopar-profile", "version": 1,
                               "device": {"corun_slowdown": "fast"}}))
    with pytest.raises(ClusterError) as err:
        read_profile(bad)
    assert "device.corun_slowdown" in str(err.value)


def test_calibration_writes_it_and_a_cluster_and_a_refit_keep_it(tmp_path) -> None:
    points = [CollectivePoint("all_reduce", b, 2, 2e-4 + b / 1e9) for b in (2**10, 2**20)]
    corun = {"corun_slowdown": 0.3, "processes": 2, "samples": []}
    path = write_profile(make_profile(recorded_device(), points, {"nproc": 2}, corun=corun),
                         tmp_path / "p.json")
    c = load_cluster({"nodes": 1, "devices_per_node": 2, "cores_per_node": 2, "device": "cpu",
                      "profile": str(path)})
    assert c.device.corun_slowdown == 0.3 and c.device.compute_share == pytest.approx(1 / 1.3)
    assert "profile" in c.sources["device.corun_slowdown"]
    assert load_cluster(c.to_dict()) == c
    # a refit from a run planned with it scales the device's speed and keeps the slowdown
    run_dir = synthetic_run(tmp_path / "run")
    for rank in (0, 1):
        f = run_dir / f"rank{rank}.json"
        doc = json.loads(f.read_text())
        doc["plan"]["cluster"]["device"]["corun_slowdown"] = 0.3
        f.write_text(json.dumps(doc))
    run = read_run(run_dir)
    assert refit_profile([run], fit_runs([run])).device["corun_slowdown"] == 0.3


@pytest.mark.slow
def test_measure_corun_times_each_process_alone_and_together() -> None:
    """A real measurement: its structure, not this machine's figure."""
    result = measure_corun(2, quick=True)
    samples = result["samples"]
    assert result["processes"] == 2 and len(samples) == 2 * 2 * 3  # processes x sizes x rounds
    assert all(s["alone_s"] > 0 and s["together_s"] > 0 for s in samples)
    assert result["corun_slowdown"] >= 0
