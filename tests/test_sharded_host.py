"""FSDP2's host work: on a CPU, sharded data parallelism costs more than its messages.

On the project's 2-core VM ZeRO-1/2/3 ran 90-100 ms a step slower than DDP on the demo GPT
(``benchmarks/cpu_step_parts.py``), two thirds of it FSDP2's Python around each unit and
AdamW's dispatch over DTensor shards; the cost model priced ZeRO-2 5.6 ms above DDP and the
demo planned it. ``autopar calibrate`` measures the two per-tensor costs and the cost model
must charge them to every plan FSDP2 runs, and to no other.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.calibrate import (
    CalibrationError,
    CollectivePoint,
    make_profile,
    measure_sharded_host,
    sharded_host_from,
)
from autopar.cli.demo_data import demo_batches, demo_model
from autopar.core.cluster import load_cluster
from autopar.core.cluster.profile import read_profile, write_profile
from autopar.core.errors import ClusterError
from tests.test_calibrate import recorded_device

HOST, OPTIMIZER = 4e-4, 6e-4


def _cpu(host: float, optimizer: float, devices: int = 2) -> dict:
    return {"name": "sharded", "nodes": 1, "devices_per_node": devices, "cores_per_node": 2,
            "device": {"preset": "cpu", "sharded_host_s_per_tensor": host,
                       "sharded_optimizer_s_per_tensor": optimizer}}


def _predicted(cluster: dict, zero: int, dp: int = 2, microbatches: int = 1) -> dict:
    return autopar.plan(demo_model(), cluster, demo_batches(1)[0], dp=dp, tp=1, pp=1,
                        zero=zero, microbatches=microbatches, recompute="none").predicted


TENSORS = sum(1 for p in demo_model().parameters() if p.requires_grad)


@pytest.mark.parametrize("zero, microbatches, cycles", [
    (1, 1, 1.0),    # one gather, one reduce-scatter per unit
    (2, 2, 1.5),    # one gather a step, a reduce-scatter per microbatch
    (1, 2, 1.0),    # ZeRO-1 reduces once, at the last microbatch
    (3, 1, (3 * 48 + 2 * 4) / 2 / 52),  # a layer's 12 gathered twice, the root's 4 once
])
def test_sharded_plans_pay_the_host_work_per_tensor(zero, microbatches, cycles) -> None:
    base = _predicted(_cpu(0.0, 0.0), zero, microbatches=microbatches)
    paid = _predicted(_cpu(HOST, OPTIMIZER), zero, microbatches=microbatches)
    assert paid["optimizer_s"] - base["optimizer_s"] == pytest.approx(TENSORS * OPTIMIZER)
    host = paid["dp_exposed_s"] - base["dp_exposed_s"]
    assert host == pytest.approx(TENSORS * HOST * cycles)
    assert paid["step_time_s"] > base["step_time_s"]


def test_ddp_pays_nothing() -> None:
    base = _predicted(_cpu(0.0, 0.0), zero=0)  # DDP
    paid = _predicted(_cpu(HOST, OPTIMIZER), zero=0)
    assert paid["step_time_s"] == pytest.approx(base["step_time_s"], rel=1e-12)


def test_the_demo_keeps_ddp_when_fsdp2_host_work_is_priced() -> None:
    plan = autopar.plan(demo_model(), "2xcpu", demo_batches(1)[0])
    assert plan.training["zero"] == 0


def test_gpu_presets_leave_it_zero() -> None:
    for preset in ("A100-80GB", "H100-80GB"):
        device = load_cluster({"nodes": 1, "devices_per_node": 8, "device": preset}).device
        assert device.sharded_host_s_per_tensor == device.sharded_optimizer_s_per_tensor == 0


def test_the_per_tensor_costs_from_the_medians() -> None:
    got = sharded_host_from({"tensors": 10, "plain_s": 0.04, "sharded_s": 0.05,
                             "bare_s": 0.02, "sharded_optimizer_s": 0.01,
                             "bare_optimizer_s": 0.004})
    assert got == {"sharded_host_s_per_tensor": 0.0,  # noise below the parts: never negative
                   "sharded_optimizer_s_per_tensor": pytest.approx(6e-4)}
    with pytest.raises(CalibrationError, match="no parameter tensors"):
        sharded_host_from({"tensors": 0, "plain_s": 0, "sharded_s": 0, "bare_s": 0,
                           "sharded_optimizer_s": 0, "bare_optimizer_s": 0})


def test_cluster_files_take_microseconds_and_refuse_bad_values(tmp_path) -> None:
    c = load_cluster({"nodes": 1, "devices_per_node": 2,
                      "device": {"preset": "cpu", "sharded_host_us_per_tensor": 250}})
    assert c.device.sharded_host_s_per_tensor == pytest.approx(2.5e-4)
    assert load_cluster(c.to_dict()) == c
    with pytest.raises(ClusterError) as err:
        load_cluster(_cpu(-1e-4, 0.0))
    assert "sharded_host_s_per_tensor" in str(err.value)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "autopar-profile", "version": 1,
                               "device": {"sharded_optimizer_s_per_tensor": "slow"}}))
    with pytest.raises(ClusterError) as err:
        read_profile(bad)
    assert "device.sharded_optimizer_s_per_tensor" in str(err.value)


def test_a_profile_carries_them_into_the_cluster(tmp_path) -> None:
    points = [CollectivePoint("all_reduce", b, 2, 2e-4 + b / 1e9) for b in (2**10, 2**20)]
    sharded = {"sharded_host_s_per_tensor": 3e-4, "sharded_optimizer_s_per_tensor": 5e-4,
               "measured": {"tensors": 50}}
    path = write_profile(make_profile(recorded_device(), points, {"nproc": 2},
                                      sharded=sharded), tmp_path / "p.json")
    c = load_cluster({"nodes": 1, "devices_per_node": 2, "device": "cpu",
                      "profile": str(path)})
    assert c.device.sharded_host_s_per_tensor == 3e-4
    assert c.device.sharded_optimizer_s_per_tensor == 5e-4
    assert "profile" in c.sources["device.sharded_host_s_per_tensor"]


@pytest.mark.slow
def test_measure_sharded_host_on_two_processes() -> None:
    """A real measurement: its structure, not this machine's figures."""
    result = measure_sharded_host(2, quick=True)
    m = result["measured"]
    assert m["world_size"] == 2 and m["tensors"] == 4 * 12 + 2 and m["units"] == 5
    assert all(m[k] > 0 for k in ("plain_s", "sharded_s", "bare_s", "sharded_optimizer_s",
                                  "bare_optimizer_s"))
    assert result["sharded_host_s_per_tensor"] >= 0
    assert result["sharded_optimizer_s_per_tensor"] >= 0
