"""Fused attention's share of the matmul rate, by size.

PyTorch's CPU flash kernel reached 0.55-0.62 of the matmul rate at seq 1024 on the
project's VM, and the demo GPT's seq-64 attention ran at about half the modelled speed:
one figure for every size priced short sequences short. ``autopar calibrate`` times a short
and a long sequence and writes ``attention_efficiency_curve``; the cost model reads it at
each attention node's score-matmul size.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.calibrate import CollectivePoint, DeviceCalibration, make_profile
from autopar.calibrate.from_run import RunFit
from autopar.cli.demo_data import demo_batches, demo_model
from autopar.core.cluster import load_cluster
from autopar.core.cluster.profile import write_profile
from autopar.core.errors import ClusterError
from autopar.cost_models.compute import attention_efficiency, causal_fraction, op_time
from tests.test_calibrate import recorded_device, sdpa_point

PEAK, FLOOR = 1e11, 2e-6  # recorded_device's


def _two_sizes(short: float, long: float) -> DeviceCalibration:
    base = recorded_device(floor=FLOOR)
    points = (sdpa_point(256, PEAK * short, FLOOR), sdpa_point(1024, PEAK * long, FLOOR))
    return DeviceCalibration("cpu", 1, "fp32", base.matmuls, base.bandwidth, FLOOR,
                             attention=points)


def _predicted(dev, p) -> float:
    """Forward plus backward of a causal SDPA node of ``p``'s shape, as the solver prices it."""
    work = causal_fraction(p.seq)
    shape = (p.batch * p.heads * p.seq, p.seq, p.head_dim)
    moved = 4 * p.batch * p.heads * p.seq * p.head_dim * 4
    scale = attention_efficiency(dev, shape)
    return (op_time(p.forward_flops * work, moved, dev, "fp32", shape=shape,
                    efficiency_scale=scale)
            + op_time(p.backward_flops * work, 2 * moved, dev, "fp32", shape=shape,
                      efficiency_scale=scale))


def test_calibration_writes_one_point_per_size_and_the_model_gives_each_back(tmp_path):
    device = _two_sizes(short=0.2, long=0.6)
    assert [round(e, 9) for _, e in device.attention_efficiency_curve] == [0.2, 0.6]
    points = [CollectivePoint("all_reduce", b, 2, 1e-4 + b / 1e9) for b in (2**10, 2**20)]
    prof = write_profile(make_profile(device, points, {"hostname": "t"}), tmp_path / "p.json")
    cluster = load_cluster({"nodes": 1, "devices_per_node": 1, "device": "cpu",
                            "profile": str(prof)})
    assert cluster.device.attention_efficiency_curve == device.attention_efficiency_curve
    for p in device.attention:
        assert _predicted(cluster.device, p) == pytest.approx(p.forward_backward_s, rel=1e-9)


def _compute(device: dict) -> float:
    cluster = {"name": "c", "nodes": 1, "devices_per_node": 1, "device": {"preset": "cpu",
                                                                          **device}}
    return autopar.plan(demo_model(), cluster, demo_batches(1)[0], dp=1, tp=1, pp=1, zero=0,
                        microbatches=1, recompute="none").predicted["compute_s"]


def test_a_flat_curve_is_the_one_figure_and_a_lower_one_costs_more() -> None:
    scalar = _compute({"attention_efficiency": 0.5})
    flat = _compute({"attention_efficiency": 0.9,  # the curve wins over the figure
                     "attention_efficiency_curve": [[1e3, 0.5], [1e12, 0.5]]})
    assert flat == pytest.approx(scalar, rel=1e-12)
    short_slow = _compute({"attention_efficiency": 0.5,
                           "attention_efficiency_curve": [[1e6, 0.25], [1e12, 0.5]]})
    assert short_slow > scalar


def test_a_bad_curve_is_refused_naming_it() -> None:
    with pytest.raises(ClusterError) as err:
        load_cluster({"nodes": 1, "devices_per_node": 1, "device": {
            "preset": "cpu", "attention_efficiency_curve": [[1e9, 0.5], [1e6, 0.4]]}})
    assert "attention_efficiency_curve" in err.value.where


def test_a_refit_keeps_the_efficiencies_and_the_overlap() -> None:
    base = load_cluster({"nodes": 1, "devices_per_node": 1, "device": {
        "preset": "cpu", "attention_efficiency": 0.55, "memory_overlap": 0.25,
        "attention_efficiency_curve": [[1e6, 0.3], [1e9, 0.6]]}}).to_dict()
    fit = RunFit(2.0, 0.0, (), None, (), base["device"], {})
    device = fit.device()
    assert device["attention_efficiency"] == 0.55
    assert device["memory_overlap"] == 0.25
    assert device["attention_efficiency_curve"] == [[1e6, 0.3], [1e9, 0.6]]


# SDPA's flash backend on an H100, causal, head dim 128, bf16, 16 heads, 16,384 tokens a call:
# (seq, forward TFLOP/s, backward TFLOP/s) by FlashAttention's count (the square halved),
# measured (benchmarks/results/h100_2026-11-26.md)
H100_FLASH_ATTENTION_2 = ((1024, 214.0, 152.6), (4096, 278.7, 242.1), (16384, 311.9, 303.5))


def test_the_hopper_flash_attention_2_curve_gives_back_the_measured_times() -> None:
    """The preset curve's measured points are what an H100 ran: a Hopper cluster carrying the
    curve prices each measured call at its measured time (forward plus backward)."""
    from autopar.core.cluster.presets import HOPPER_FLASH_ATTENTION_2_CURVE
    from autopar.cost_models.compute import attention_time

    cluster = load_cluster({"nodes": 1, "devices_per_node": 1, "device": {
        "preset": "H100-80GB",
        "attention_efficiency_curve": [list(p) for p in HOPPER_FLASH_ATTENTION_2_CURVE]}})
    for seq, forward_tflops, backward_tflops in H100_FLASH_ATTENTION_2:
        batch, heads, dim = 16384 // seq, 16, 128
        square = 4 * batch * heads * seq * seq * dim  # the forward's FLOPs, full square
        shape = (batch * heads * seq, seq, dim)
        moved = 4 * batch * heads * seq * dim * 2
        work = causal_fraction(seq)
        modelled = (attention_time(square * work, moved, cluster.device, "bf16", shape=shape)
                    + attention_time(2.5 * square * work, 2 * moved, cluster.device, "bf16",
                                     shape=shape))
        measured = square / 2 / (forward_tflops * 1e12) + 2.5 * square / 2 / (backward_tflops
                                                                              * 1e12)
        assert modelled == pytest.approx(measured, rel=2e-3), seq
    rising = [e for _, e in HOPPER_FLASH_ATTENTION_2_CURVE]
    assert rising == sorted(rising)  # the share grows with the keys a tile sweeps
