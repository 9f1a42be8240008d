"""Pipeline plans: balanced stages with the embedding and head at their real cost, the
schedule and microbatches chosen, and stages that fit their devices (all modelled)."""

from __future__ import annotations

import statistics

import pytest

import autopar
from autopar.cli.load import trace_model


@pytest.fixture(scope="module")
def llama8b():
    pytest.importorskip("transformers")
    return trace_model("llama3-8b", 32, 4096)


def test_32_layers_over_4_stages_are_balanced(llama8b) -> None:
    plan = autopar.plan(llama8b.gm, "4x8xH100-80GB", global_batch=32, pp=4, tp=8)
    pipe = plan.pipeline
    assert plan.mesh["pp"] == 4 and len(pipe["stages"]) == 4
    times = [s["time_per_microbatch_s"] for s in pipe["stages"]]
    assert max(times) <= 1.10 * statistics.mean(times), times
    # The output head (128k vocabulary) costs about two layers: the last stage, which
    # holds it, gets fewer layers than the others; the cut covers all 32 layers once.
    spans = [c["layers"] for c in pipe["chunks"]]
    counts = [last - first + 1 for first, last in spans]
    assert sum(counts) == 32 and spans[0][0] == 0 and spans[-1][1] == 31
    last_rank = pipe["chunks"][-1]["rank"]
    assert sum(c for c, chunk in zip(counts, pipe["chunks"]) if chunk["rank"] == last_rank) < 8
    # Every stage fits its device, and the peak is the largest stage's.
    capacity = plan.predicted["memory_capacity_bytes"]
    assert all(s["memory_bytes"] <= capacity for s in pipe["stages"])
    assert plan.predicted["peak_memory_bytes"] == pytest.approx(
        max(s["memory_bytes"] for s in pipe["stages"]), rel=1e-6)


def test_pinned_schedule_and_microbatches_are_kept(llama8b) -> None:
    plan = autopar.plan(llama8b.gm, "4x8xH100-80GB", global_batch=32, pp=4, tp=8,
                        schedule="interleaved", microbatches=8)
    pipe = plan.pipeline
    assert pipe["schedule"] == "interleaved" and pipe["virtual_stages"] >= 2
    assert plan.batch["microbatches"] == 8 and pipe["microbatches"] == 8
    # Interleaving: each rank holds v chunks, and chunk c sits on rank c mod pp.
    assert len(pipe["chunks"]) == 4 * pipe["virtual_stages"]
    assert all(c["rank"] == c["chunk"] % 4 for c in pipe["chunks"])
    one_f_one_b = autopar.plan(llama8b.gm, "4x8xH100-80GB", global_batch=32, pp=4, tp=8,
                               schedule="1f1b", microbatches=8)
    # Same work, a smaller bubble (modelled).
    assert pipe["bubble_fraction"] < one_f_one_b.pipeline["bubble_fraction"]
