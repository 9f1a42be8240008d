"""A synchronous step waits for its slowest device: chips of one GPU model differ in speed
(``DeviceSpec.speed_spread``), so the same per-device work takes longer on more of them,
one device waits for none, and CPU processes on one machine (one chip) never do."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autopar.cli.load import trace_model
from autopar.core.cluster import load_cluster
from autopar.core.cluster.compute_share import slowest_of
from autopar.core.cluster.presets import GPU_SPEED_SPREAD, PRESETS
from autopar.core.cluster.show import format_cluster
from autopar.core.errors import ClusterError
from autopar.solver.search.pinned import PinnedConfig, estimate_graph


def _gpus(count: int, preset: str = "H100-80GB", **device):
    return load_cluster({"nodes": max(1, count // 8), "devices_per_node": min(8, count),
                         "device": {"preset": preset, **device}})


def test_the_slowest_of_n_is_the_expected_largest_normal_draw():
    # exact order statistics of the standard normal: E[max of 2] = 1/sqrt(pi),
    # E[max of 3] = 3 / (2 sqrt(pi))
    assert slowest_of(1) == 0.0
    assert slowest_of(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert slowest_of(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-4)
    counts = (2, 8, 64, 512, 4096, 2**20)
    assert all(slowest_of(a) < slowest_of(b) for a, b in zip(counts, counts[1:]))


def test_every_gpu_preset_carries_the_fleet_spread_and_the_cpu_none():
    assert GPU_SPEED_SPREAD == pytest.approx(0.0148, abs=1e-4)  # 8% whisker span / 5.4 sigma
    for name, preset in PRESETS.items():
        expected = 0.0 if name == "cpu" else GPU_SPEED_SPREAD
        assert preset["device"]["speed_spread"] == expected, name


def test_more_gpus_run_each_at_the_pace_of_the_slowest():
    for count in (1, 8, 128, 1024):
        share = _gpus(count).device.compute_share
        assert share == pytest.approx(1 / (1 + GPU_SPEED_SPREAD * slowest_of(count)))
    assert _gpus(1).device.compute_share == 1.0
    # a plan on fewer of the cluster's devices waits for fewer
    big = _gpus(128)
    assert (dataclasses.replace(big, nodes=1).device.compute_share
            == _gpus(8).device.compute_share)
    # processes on one CPU are one chip: no spread, whatever their number
    assert load_cluster({"nodes": 1, "devices_per_node": 4,
                         "device": {"preset": "cpu"}}).device.compute_share == 1.0


@pytest.fixture(scope="module")
def llama():
    return trace_model("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=512,seq=512",
                       2, 512).gm


def test_the_same_work_per_gpu_takes_longer_on_more_gpus(llama):
    """Data parallelism on 1 and 64 GPUs, two sequences each: the same kernels per device,
    priced slower on 64 by the slowest chip's shortfall; without a spread, alike."""
    def compute_s(cluster, dp):
        config = PinnedConfig(dp=dp, microbatch=2, global_batch=2 * dp, precision="bf16")
        return estimate_graph(llama, cluster, config).prediction.compute_s

    one, many = compute_s(_gpus(1), 1), compute_s(_gpus(64), 64)
    assert many == pytest.approx(one * (1 + GPU_SPEED_SPREAD * slowest_of(64)), rel=1e-6)
    assert compute_s(_gpus(64, speed_spread=0.0), 64) == pytest.approx(one, rel=1e-6)


def test_a_cluster_file_sets_the_spread_and_a_bad_one_is_refused_by_name(tmp_path):
    measured = _gpus(16, speed_spread=0.03)
    assert measured.device.speed_spread == 0.03
    assert measured.sources["device.speed_spread"] == "dict"  # the description's, not the preset's
    assert load_cluster(measured.to_dict()) == measured
    assert "chip speed spread" in format_cluster(measured)
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 1\ndevices_per_node: 8\ndevice: {preset: H100-80GB, "
                    "speed_spread: -0.1}\n")
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    assert "speed_spread" in str(err.value) and "device.speed_spread" in err.value.where


def test_the_plan_says_how_long_it_waits_for_the_slowest_chip(llama):
    import autopar
    from autopar.core.plan_summary import format_plan

    many = format_plan(autopar.plan(llama, "8xH100-80GB", global_batch=16, dp=8, tp=1, pp=1),
                       "llama")
    wait = GPU_SPEED_SPREAD * slowest_of(8)
    assert f"the slowest of 8 chips: +{wait:.1%}" in many
    one = format_plan(autopar.plan(llama, "1xH100-80GB", global_batch=2), "llama")
    assert "slowest of" not in one
    # a plan on 4 of the cluster's 8 GPUs waits for the slowest of the 4 it uses
    four = format_plan(autopar.plan(llama, "8xH100-80GB", global_batch=16, devices=4, tp=1,
                                    pp=1), "llama")
    assert f"the slowest of 4 chips: +{GPU_SPEED_SPREAD * slowest_of(4):.1%}" in four
