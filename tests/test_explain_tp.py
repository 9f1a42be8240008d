"""How a plan uses tensor parallelism, and why (``plan.explanation["tp"]``): a pinned tp is
Megatron's (it does not split the batch unless asked), and when it shards no weight the
plan gives the modelled step time of the alternatives, in the JSON and in the summary."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.plan_summary import format_plan
from autopar.models import GPT, GPTConfig
from autopar.solver.options import PlanOptions
from tests.distributed import FAST


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 64, (6, 16))
    return autopar.trace(model, (idx, idx))


def test_a_pinned_tp_does_not_split_the_batch_unless_asked() -> None:
    assert PlanOptions(tp=2).tp_splits_batch is False
    assert PlanOptions(tp=2, tp_splits_batch=True).tp_splits_batch is True
    assert PlanOptions().tp_splits_batch is True  # tp chosen by the solver: free


def test_pinned_tp_that_shards_no_weight_says_why(gpt) -> None:
    """On CPUs with slow links, splitting a tiny model's weights costs more than it saves:
    the plan keeps them whole, and says so with the modelled alternatives."""
    plan = autopar.plan(gpt, "4xcpu", tp=2)
    tp = plan.explanation["tp"]
    assert tp["pinned"] and not tp["splits_batch_allowed"]
    assert tp["weights_sharded"] == 0 and tp["work_split"] == 0.0
    assert tp["unexpected"] == ["tp=2 shards no weight"]
    planned, megatron, *_, no_tp = tp["alternatives"]
    assert planned["step_time_s"] == plan.predicted["step_time_s"]
    assert megatron["what"].startswith("matmul weights sharded")
    assert megatron["step_time_s"] > planned["step_time_s"]  # why it was not chosen
    assert no_tp["mesh"]["tp"] == 1 and no_tp["step_time_s"] > 0
    assert "modelled" in tp["why"] and "Megatron" in tp["why"]
    text = format_plan(plan, "gpt")
    assert "tp        2 (pinned): shards 0 of" in text and "  why     tp=2 shards no weight" in text
    assert "every tp rank computes the whole model" in text


def test_the_megatron_alternative_shards_the_matmul_weights(gpt) -> None:
    """The forced alternative really shards: solved alone, its plan splits every matrix
    weight a matmul reads."""
    from autopar.core.cluster import load_cluster
    from autopar.solver.explain.explain_tp import _shard_matmul_weights, tp_usage
    from autopar.solver.search.mesh_search import search

    options = PlanOptions(tp=2, tp_splits_batch=False)
    result = search(gpt, load_cluster("4xcpu"), options, _shard_matmul_weights)
    usage = tp_usage(result.problem, result.best.choice, 6)
    matrices = [d for d in result.problem.decisions
                if d.kind == "param" and len(d.facts.param.shape) == 2]
    assert matrices
    for d in matrices:
        assert d.candidates[result.best.choice[d.index]].outputs[0] != autopar.core.placements.R, d.name
    assert usage["weights_sharded"] >= len(matrices) and usage["work_split"] > 0.5


def test_tp_used_as_expected_needs_no_reason(gpt) -> None:
    plan = autopar.plan(gpt, FAST, tp=2, dp=2)
    tp = plan.explanation["tp"]
    assert tp["weights_sharded"] > 0 and tp["unexpected"] == [] and tp["why"] == ""
    assert "alternatives" not in tp
    assert "why" not in format_plan(plan, "gpt").split("attention")[0]


def test_no_tp_no_entry(gpt) -> None:
    assert autopar.plan(gpt, "2xcpu", dp=2).explanation == {}
