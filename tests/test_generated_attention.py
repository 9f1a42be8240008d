"""autopar's generated attention kernels are priced as what they are (measured on an H100:
slower than SDPA's flash backend, the backward most), where the program runs them -- fused
sites on a GPU -- and not for a run by another framework or on a CPU, where the call falls
back to SDPA."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_attention
from autopar.models import resolve_model
from autopar.solver.search.pinned import PinnedConfig, estimate_graph
from autopar.trace import trace


@pytest.fixture(scope="module")
def llama():
    spec = resolve_model("llama:layers=2,hidden=1024,heads=8,kv_heads=4,ffn=2816,vocab=512,seq=2048")
    with torch.device("meta"):
        model = spec.build()
    return trace(model, spec.example_inputs(2, 2048))


def _attention_times(gm, cluster, **config) -> tuple[float, float]:
    """(forward, backward) seconds of every attention node of the one-device estimate."""
    est = estimate_graph(gm, cluster, PinnedConfig(precision="bf16", **config))
    tables = est.tables
    nodes = [d for d in est.problem.decisions if d.name in est.problem.kernel_attention
             and d.facts.fwd_flops]
    assert nodes, "the model has a fused attention site"
    times = [tables.times(d, s) for d in nodes for s in d.candidates[:1]]
    return sum(t[0] for t in times), sum(t[1] for t in times)


def _cluster(preset: str, **device):
    return load_cluster({"nodes": 1, "devices_per_node": 1,
                         "device": {"preset": preset, **device}})


def test_on_hopper_the_generated_kernel_is_priced_at_its_measured_speed(llama):
    hopper = _cluster("H100-80GB")
    assert (hopper.device.generated_attention_forward,
            hopper.device.generated_attention_backward) == (0.86, 0.58)
    own = _attention_times(llama, hopper)
    theirs = _attention_times(llama, hopper, attention_kernel="device")
    # compute-bound at 2,048 tokens: the time scales as the inverse of the kernel's speed
    assert own[0] == pytest.approx(theirs[0] / 0.86, rel=0.05)
    assert own[1] == pytest.approx(theirs[1] / 0.58, rel=0.05)


def test_cluster_files_set_the_generated_kernels_speed(llama):
    measured = _cluster("H100-80GB", generated_attention_forward=1.0,
                        generated_attention_backward=1.0)
    assert _attention_times(llama, measured) == pytest.approx(
        _attention_times(llama, measured, attention_kernel="device"))


@pytest.mark.parametrize("preset", ["A100-80GB", "cpu"])
def test_unmeasured_devices_and_cpus_price_the_kernel_that_runs_as_the_device_says(
        llama, preset):
    """A100: the generated kernel is unmeasured there (1); a CPU falls back to SDPA."""
    cluster = _cluster(preset, **({"generated_attention_backward": 0.5}
                                  if preset == "cpu" else {}))
    assert _attention_times(llama, cluster) == pytest.approx(
        _attention_times(llama, cluster, attention_kernel="device"))


def test_a_bad_speed_or_kernel_is_refused_naming_it():
    with pytest.raises(AutoparError, match="generated_attention_backward"):
        _cluster("H100-80GB", generated_attention_backward=0)
    with pytest.raises(AutoparError, match="attention_kernel"):
        PinnedConfig(attention_kernel="flash")


@pytest.mark.parametrize(("cluster", "says"), [("1xH100-80GB", "0.58x (backward)"),
                                               ("1xcpu", "CPU fallback")])
def test_a_plan_says_what_its_fused_attention_is_priced_as(cluster, says):
    spec = resolve_model("llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=128,seq=64")
    model = spec.build()
    args, kwargs = spec.example_inputs(2, 64, "cpu")
    plan = autopar.plan(model, cluster, (args, kwargs))
    fused = [site for site in plan.attention if site["fused"]]
    assert fused and all(says in site["kernel"] for site in fused)
    assert Plan.from_json(plan.to_json()).attention == plan.attention
    assert any(says in line for line in format_attention(plan.attention))
