"""What a CPU core spends besides the roofline: GELU, softmax, norms, a Linear's bias, views.

On the project's 2-core VM the demo GPT's GELU took 3.0-3.3 ns an element inside a
training step against ~1 ns the roofline gave it, and a Linear's addmm spent ~240 µs
writing its bias into a fresh output before the GEMM, which the roofline did not price at
all; the demo's first prediction was 30% short. ``autopar calibrate`` measures per-element
rates inside a training step (``device.op_s_per_element``) and the cost model must charge
them, exactly where they apply and nowhere on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar.calibrate.from_run import relative_time
from autopar.calibrate.op_rates import OPS, measure_op_rates
from autopar.cli.demo_data import demo_batches, demo_model
from autopar.core.cluster import load_cluster
from autopar.core.cluster.profile import Profile
from autopar.core.errors import ClusterError

GELU_ELEMENTS = 4 * (8 * 64) * 512  # 4 layers' GELU on the demo batch (8 x 64 tokens, MLP 512)
LINEAR_BIAS_ELEMENTS = 4 * (8 * 64) * (384 + 128 + 512 + 128)  # qkv, proj, fc, fc-proj outputs


def _cpu(rates: dict) -> dict:
    return {"name": "rates", "nodes": 1, "devices_per_node": 1,
            "device": {"preset": "cpu", "op_s_per_element": rates}}


def _compute(rates: dict) -> float:
    plan = autopar.plan(demo_model(), _cpu(rates), demo_batches(1)[0], dp=1, tp=1, pp=1,
                        zero=0, microbatches=1, recompute="none")
    return plan.predicted["compute_s"]


def test_an_op_with_a_rate_costs_its_elements_at_that_rate() -> None:
    # rates far above the roofline, so the arithmetic decides both passes of every GELU
    slow, slower = 1e-7, 2e-7
    delta = _compute({"gelu": [slower, slower]}) - _compute({"gelu": [slow, slow]})
    assert delta == pytest.approx(GELU_ELEMENTS * 2 * (slower - slow), rel=1e-6)


def test_a_rate_below_the_roofline_changes_nothing() -> None:
    assert _compute({"gelu": [1e-15, 1e-15]}) == pytest.approx(_compute({}), rel=1e-12)


def test_a_linear_with_a_bias_pays_the_broadcast_and_its_sum() -> None:
    add = (3e-12, 1e-12)  # below an add's roofline: the residual adds stay as they were
    delta = _compute({"add": list(add)}) - _compute({})
    assert delta == pytest.approx(LINEAR_BIAS_ELEMENTS * sum(add), rel=1e-6)


def test_gpu_presets_have_no_rates_so_gpu_plans_do_not_move() -> None:
    for preset in ("A100-80GB", "H100-80GB"):
        device = load_cluster({"nodes": 1, "devices_per_node": 8, "device": preset}).device
        assert dict(device.op_s_per_element) == {}


def test_cluster_files_give_rates_in_ns_and_round_trip() -> None:
    cluster = load_cluster({"nodes": 1, "devices_per_node": 2, "device": {
        "preset": "cpu", "op_ns_per_element": {"gelu": [3, 4.5]}}})
    assert cluster.device.op_s_per_element["gelu"] == pytest.approx((3e-9, 4.5e-9))
    assert load_cluster(cluster.to_dict()) == cluster


@pytest.mark.parametrize("rates, field", [
    ({"gelu": [1e-9]}, "gelu"),
    ({"gelu": [-1e-9, 1e-9]}, "gelu"),
    ({"Gelu!": [1e-9, 1e-9]}, "Gelu!"),
    ([1e-9, 1e-9], "op_s_per_element"),
])
def test_bad_rates_are_refused_naming_the_field(rates, field) -> None:
    with pytest.raises(ClusterError) as err:
        load_cluster(_cpu(rates))
    assert "op_s_per_element" in err.value.where and field in err.value.where


def test_one_unit_only() -> None:
    description = _cpu({"gelu": [1e-9, 1e-9]})
    description["device"]["op_ns_per_element"] = {"gelu": [1, 1]}
    with pytest.raises(ClusterError, match="op_"):
        load_cluster(description)


def test_a_profile_carries_them_and_a_refit_scales_them_like_device_time() -> None:
    base = {"peak_flops": {"fp32": 1e11}, "memory_bandwidth_bytes_per_s": 1e10,
            "kernel_floor_s": 1e-5, "op_s_per_element": {"gelu": [2e-9, 3e-9]}}
    profile = Profile(device=base)
    assert profile.device["op_s_per_element"]["gelu"] == (2e-9, 3e-9)
    slower = {"peak_flops": {"fp32": 5e10}, "memory_bandwidth_bytes_per_s": 5e9,
              "kernel_floor_s": 2e-5, "op_s_per_element": {"gelu": [4e-9, 6e-9]}}
    assert relative_time(slower, base) == pytest.approx(2.0)
    slower["op_s_per_element"] = {"gelu": [4e-9, 3e-9]}  # not one factor: not a refit
    assert relative_time(slower, base) is None


def test_measured_inside_a_training_step() -> None:
    torch.set_num_threads(1)
    rates = measure_op_rates(torch.device("cpu"), floor=0.0, steps=2, rows=32)
    assert set(rates) == set(OPS)
    for forward, backward in rates.values():
        assert math.isfinite(forward) and math.isfinite(backward)
        assert forward > 0 and backward >= 0


class _Views(torch.nn.Module):
    """A Linear whose output is viewed twice (a reshape and a transpose) before the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(2, -1, 8).transpose(0, 1).sum()


def _views_compute(view_s: float) -> float:
    cluster = {"name": "c", "nodes": 1, "devices_per_node": 1,
               "device": {"preset": "cpu", "view_s": view_s}}
    return autopar.plan(_Views(), cluster, (torch.randn(4, 8),), dp=1, tp=1, pp=1, zero=0,
                        microbatches=1, recompute="none").predicted["compute_s"]


def test_a_view_costs_its_dispatch_each_pass() -> None:
    # two views that need gradients: each a forward and a backward node
    assert _views_compute(1e-3) - _views_compute(0.0) == pytest.approx(4 * 1e-3, rel=1e-9)


def test_views_cost_nothing_on_gpus_and_cluster_files_take_microseconds() -> None:
    assert load_cluster("H100-80GB").device.view_s == 0.0
    cluster = load_cluster({"nodes": 1, "devices_per_node": 1,
                            "device": {"preset": "cpu", "view_us": 5}})
    assert cluster.device.view_s == pytest.approx(5e-6)
    assert load_cluster(cluster.to_dict()) == cluster
    with pytest.raises(ClusterError) as err:
        load_cluster({"nodes": 1, "devices_per_node": 1, "device": {"preset": "cpu",
                                                                     "view_us": -1}})
    assert "view_us" in err.value.where


def test_the_view_cost_is_measured_per_pass() -> None:
    from autopar.calibrate.op_rates import measure_view_seconds

    seconds = measure_view_seconds(torch.device("cpu"), repeats=3)
    assert math.isfinite(seconds) and seconds > 0
