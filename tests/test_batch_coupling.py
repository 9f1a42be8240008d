"""Batch-coupled models under data parallelism: exact, or refused naming the op.

A balancing loss multiplies two means over the batch; a batch norm normalises by the batch's
statistics. Split over data-parallel ranks (or microbatches), each part would compute its
own. The planner finds such ops (``autopar.analysis.batch_coupling``): a batch statistic used
whole is all-reduced over dp (``passes/sync_batch_statistics``), an op that reads other
samples keeps the batch whole, and the plan names them (``plan.batch_coupled``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopar
from autopar.analysis.batch_axis import batch_strategies
from autopar.analysis.batch_coupling import batch_couplings, splitting
from autopar.core.errors import NoFeasiblePlanError
from autopar.core.graph_facts import META_KEY
from autopar.core.plan import Plan
from autopar.models import GPT, GPTConfig
from autopar.models.moe import MoEConfig, MoEGPT
from tests.distributed import run_cases

IDX = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))


def _moe(routing: str) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                            experts=4, top_k=2, expert_ffn=32, routing=routing))


class _BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 8)
        self.bn = torch.nn.BatchNorm1d(16 * 8)
        self.head = torch.nn.Linear(16 * 8, 96)

    def forward(self, idx, label):
        x = self.bn(self.embed(idx).flatten(1))
        return torch.nn.functional.cross_entropy(self.head(x), label)


def _all_couplings(model, inputs):
    gm = autopar.trace(model, inputs)
    return batch_couplings(gm, batch_strategies(gm, gm.meta[META_KEY].batch_size))


def _couplings(model, inputs):
    """The couplings that may refuse a split (not the statistics of the inputs alone)."""
    return splitting(_all_couplings(model, inputs))


def _coupled(plan: Plan) -> list[dict]:
    return [c for c in plan.batch_coupled if c["kind"] != "input_statistic"]


@pytest.mark.parametrize("routing", ["loop", "dense", "sorted"])
def test_a_balancing_loss_is_a_statistic_and_routing_is_per_token(routing: str) -> None:
    """Each layer's balancing loss (fraction of tokens x mean probability per expert) is
    the one coupling: the routing itself (nonzero, argsort, histc, grouped matmuls, one-hot
    dispatch) runs on each rank's own tokens."""
    found = _couplings(_moe(routing), (IDX, IDX))
    assert [(c.kind, c.op) for c in found] == [("statistic", "aten.mul.Tensor")] * 2
    assert all("Router" in c.where and "moe.py" in c.where for c in found)


def test_a_bias_update_under_no_grad_is_a_statistic() -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing nudges a routing bias by the sign of each
    expert's load, inside ``torch.no_grad()`` (which torch.export hides in one opaque call):
    the load is a sum over the batch, so the sign needs every rank's tokens."""
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                             experts=4, top_k=2, expert_ffn=32, routing="sorted",
                             aux_loss_coef=0.0, bias_update_rate=0.05))
    found = _couplings(model, (IDX, IDX))
    assert [(c.kind, c.op) for c in found] == [("statistic", "aten.sign.default")] * 2
    plan = autopar.plan(model, "2xcpu", (IDX, IDX), dp=2)
    assert [c["exact"] for c in _coupled(plan)] == [True, True]


def test_models_without_coupling_have_none() -> None:
    """A language model's mean loss divides by the count of labelled tokens: a statistic of
    the labels alone, taken over the whole step, which never refuses a split."""
    gpt = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32))
    found = _all_couplings(gpt, (IDX, IDX))
    assert [(c.kind, c.op) for c in found] == [("input_statistic", "aten.div.Tensor")]
    assert splitting(found) == []


def test_batch_norm_is_a_batch_statistic() -> None:
    """In training, batch norm normalises by statistics of the batch: exact under data
    parallelism when they are taken over every rank (synchronised), not over microbatches."""
    found = _couplings(_BatchNormNet(), (IDX, IDX[:, 0]))
    assert [(c.node, c.kind) for c in found] == [("batch_norm", "statistic")]
    assert "BatchNorm1d" in found[0].where


def test_batch_norm_plans_dp_but_refuses_microbatches_naming_the_op() -> None:
    plan = autopar.plan(_BatchNormNet(), "2xcpu", (IDX, IDX[:, 0]), dp=2)
    assert [(c["node"], c["exact"]) for c in _coupled(plan)] == [("batch_norm", True)]
    with pytest.raises(NoFeasiblePlanError) as info:
        autopar.plan(_BatchNormNet(), "2xcpu", (IDX, IDX[:, 0]), dp=2, microbatches=2)
    text = str(info.value)
    assert "batch_norm" in text and "BatchNorm1d" in text and "microbatches" in text
    assert "batch_coupling='local'" in text


def test_local_batch_coupling_plans_and_says_inexact() -> None:
    plan = autopar.plan(_BatchNormNet(), "2xcpu", (IDX, IDX[:, 0]), dp=2,
                        batch_coupling="local")
    assert plan.training["batch_coupling"] == "local"
    assert [(c["node"], c["exact"]) for c in _coupled(plan)] == [("batch_norm", False)]


def test_unsplit_batch_norm_plans_exact() -> None:
    plan = autopar.plan(_BatchNormNet(), "2xcpu", (IDX, IDX[:, 0]))
    assert plan.mesh["dp"] == 1 and plan.batch["microbatches"] == 1
    assert [c["exact"] for c in _coupled(plan)] == [True]


def test_statistics_refuse_microbatches_but_not_dp() -> None:
    model = _moe("sorted")
    with pytest.raises(NoFeasiblePlanError, match="microbatches per data-parallel rank"):
        autopar.plan(model, "2xcpu", (IDX, IDX), dp=2, microbatches=2)
    plan = autopar.plan(model, "2xcpu", (IDX, IDX), dp=2)
    assert {(c["kind"], c["exact"]) for c in plan.batch_coupled} == {
        ("statistic", True), ("input_statistic", True)}
    again = Plan.from_json(plan.to_json())
    assert again.batch_coupled == plan.batch_coupled


def test_unknown_batch_coupling_names_the_field() -> None:
    with pytest.raises(autopar.AutoparError, match="batch_coupling"):
        autopar.plan(_moe("loop"), "2xcpu", (IDX, IDX), batch_coupling="global")


@pytest.mark.slow
def test_moe_trains_exactly_under_dp(tmp_path: Path) -> None:
    """Every routing style, its balancing loss over the global batch, equals one device
    (fp32, every loss and gradient on every rank). Without the statistic's all-reduce the
    losses differ at the first step (checked by hand: 7e-5 relative, gradients far off).

    DeepSeek-V3's auxiliary-loss-free balancing ("-bias") updates a routing bias from the
    step's tokens per expert inside ``torch.no_grad()``: with each rank counting only its
    own tokens, the second step's losses differed (checked by hand: 3e-4 relative)."""
    cases = [{"model": f"moe-{r}", "dp": 2} for r in ("loop", "dense", "sorted")]
    cases += [{"model": "moe-sorted-bias", "dp": 2},
              {"model": "moe-loop-bias", "dp": 2, "ep": 2}]
    for rank in run_cases(2, tmp_path, cases):
        for r in rank:
            assert r["ok"], r
            assert r["mesh"]["dp"] == 2 and r["microbatches"] == 1
