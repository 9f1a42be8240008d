"""What keeps a split batch training like the whole one, piece by piece (no processes; the
multi-process equivalence of every model and layout is tests/test_hf_matrix.py).

- A mean over labelled tokens is traced as a sum over a count of the labels, which is a
  statistic of the inputs: exact under any split, microbatches and pipelines included.
- Composite ops without a sharding rule are written as the ops torch composes them of.
- A number the batch size entered arithmetic with keeps its planned (global) value in the
  program traced on one microbatch.
- Every rank's graph is rank 0's, whatever order a ``set`` gave its independent ops.
- A synchronised batch norm computes what torch's does.
- Refusals say why (pipelines of models without layers, or with one module applied
  repeatedly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.core.errors import NoFeasiblePlanError
from autopar.ops.local_ops import _SyncBatchNorm
from autopar.strategies import has_rule
from autopar.trace.align import align_to, describe, restore_batch_constants
from tests import hand_models
from tests.distributed import ROOT, free_port

aten = torch.ops.aten


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


class _Losses(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 5)
        self.register_buffer("weights", torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]))

    def forward(self, x, t):
        y = self.proj(x)
        return (F.cross_entropy(y, t) + F.cross_entropy(y, t, weight=self.weights,
                                                        label_smoothing=0.1)
                + F.nll_loss(torch.log_softmax(y, -1), t.clamp(min=0), ignore_index=2))


def test_mean_losses_are_sums_over_counts_of_the_labels() -> None:
    """cross_entropy and nll_loss with class indices, class weights, label smoothing and
    ignored targets: traced as sum / count, and the traced graph computes the same loss
    and gradients as the model."""
    torch.manual_seed(0)
    model = _Losses()
    x, t = torch.randn(6, 8), torch.tensor([1, 2, -100, 4, 0, -100])
    gm = autopar.trace(model, (x, t))
    reductions = [n.args[3] for n in gm.graph.nodes if n.target in (
        aten.cross_entropy_loss.default, aten.nll_loss_nd.default)]
    assert reductions == [2, 2, 2]  # every mean a sum ...
    assert _targets(gm).count("aten.div.Tensor") == 3  # ... over its count
    mine, theirs = gm(x, t), model(x, t)
    torch.testing.assert_close(mine, theirs)
    mine.backward()
    got = model.proj.weight.grad.clone()
    model.zero_grad()
    theirs.backward()
    torch.testing.assert_close(gm.get_parameter("proj.weight").grad, got)


def test_the_count_of_labels_never_refuses_a_split() -> None:
    """A padded language model pipelines over microbatches: the count of its labelled tokens
    is taken over the whole step, not per microbatch (the plan names it)."""
    model, (args, kwargs) = hand_models.MODELS["masked_mean"]()
    plan = autopar.plan(model, "2xcpu", (args, kwargs), dp=2, microbatches=2)
    assert plan.batch["microbatches"] == 2
    assert [(c["kind"], c["exact"]) for c in plan.batch_coupled] == [("input_statistic", True)]


def test_a_statistic_of_activations_still_refuses_microbatches() -> None:
    model, (args, kwargs) = hand_models.MODELS["moe_loop"]()
    with pytest.raises(NoFeasiblePlanError, match="statistic of the whole batch"):
        autopar.plan(model, "2xcpu", (args, kwargs), dp=2, microbatches=2)


class _Composites(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)

    def forward(self, x, y):
        h = self.proj(x)
        pooled = F.adaptive_avg_pool1d(h.transpose(1, 2), 1).squeeze(-1)  # [B, 6]
        return (torch.min(h, y.expand_as(h)).sum() + pooled.sum()
                + F.kl_div(torch.log_softmax(h, -1), torch.softmax(h.detach(), -1),
                           reduction="batchmean"))


def test_composites_without_rules_become_ops_with_rules() -> None:
    torch.manual_seed(0)
    model = _Composites()
    x, y = torch.randn(4, 3, 6), torch.randn(4, 3, 1)
    gm = autopar.trace(model, (x, y))
    unruled = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
               and isinstance(n.target, torch._ops.OpOverload) and not has_rule(n.target)]
    assert unruled == [], unruled
    assert "aten.expand_as.default" not in _targets(gm)
    torch.testing.assert_close(gm(x, y), model(x, y))


def test_a_batch_size_in_arithmetic_keeps_its_planned_value() -> None:
    """``reduction="batchmean"`` divides by ``input.size(0)``: traced on a microbatch the
    division would be by the microbatch's size; the program divides as planned."""
    model, (args, kwargs) = hand_models.MODELS["kl_batchmean"]()
    whole = autopar.trace(model, (args, kwargs))
    half = autopar.trace(model, (tuple(a[:2] for a in args), kwargs))
    divisors = [n.args[1] for n in half.graph.nodes if n.target is aten.div.Tensor
                and not isinstance(n.args[1], torch.fx.Node)]
    assert divisors == [2]
    assert restore_batch_constants(half, whole)
    assert [n.args[1] for n in half.graph.nodes if n.target is aten.div.Tensor
            and not isinstance(n.args[1], torch.fx.Node)] == [4]
    assert [n.args[1] for n in half.graph.nodes if n.target is aten.expand.default] == [
        [2, 16, 96]]  # shapes stay local


_DESCRIBE = """
import json, sys
sys.path.insert(0, {root!r})
import autopar
from autopar.trace.align import describe
from tests.hand_models import MODELS
model, (args, kwargs) = MODELS["set_order"]()
print(json.dumps(describe(autopar.trace(model, (args, kwargs)))))
"""


def test_every_rank_gets_rank_0s_graph_whatever_its_hash_seed() -> None:
    """A model whose branches follow a ``set`` of strings traces its ops in another order in
    every process; matched by op and inputs, a rank's graph takes rank 0's order and names."""
    graphs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _DESCRIBE.format(root=str(ROOT))],
                             capture_output=True, text=True, env=env, check=True, timeout=300)
        graphs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert graphs[0] != graphs[1]  # the trap is real
    model, (args, kwargs) = hand_models.MODELS["set_order"]()
    from autopar.trace.capture import export_model

    mine, _ = export_model(model, args, kwargs)
    for reference in graphs:
        aligned = align_to(mine, reference)
        assert aligned is not None and describe(aligned) == reference
        torch.testing.assert_close(aligned(*args), model(*args))
    other = [row if row[0] != "linear_1" else [*row[:3], "0" * 24, row[4]] for row in graphs[0]]
    assert align_to(mine, other) is None  # a different graph is told apart


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(6, 4), (4, 3, 5), (2, 3, 4, 4)])
def test_synchronised_batch_norm_computes_torchs(shape, one_rank_group) -> None:
    """The statistics, running statistics, output and every gradient of torch's batch norm
    (on one rank the all-reduces are the identity; tests/test_hf_matrix.py runs it split)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight, bias = torch.randn(shape[1], requires_grad=True), torch.randn(shape[1],
                                                                       requires_grad=True)
    stats = [torch.zeros(shape[1]), torch.ones(shape[1])]
    theirs = [torch.zeros(shape[1]), torch.ones(shape[1])]
    out = _SyncBatchNorm.apply(x, weight, bias, *stats, 0.1, 1e-5, one_rank_group)
    ref = F.batch_norm(x, *theirs, weight, bias, training=True, momentum=0.1, eps=1e-5)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(stats, theirs)
    grad = torch.randn_like(out)
    mine = torch.autograd.grad(out, (x, weight, bias), grad)
    expected = torch.autograd.grad(ref, (x, weight, bias), grad)
    for a, b in zip(mine, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_pipeline_without_layers_says_why() -> None:
    model, (args, kwargs) = hand_models.MODELS["shared_layers"]()
    with pytest.raises(NoFeasiblePlanError, match="applies module 'block' more than once"):
        autopar.plan(model, "2xcpu", (args, kwargs), pp=2)
    with pytest.raises(NoFeasiblePlanError, match="repeated layers") as info:
        autopar.plan(_Composites(), "2xcpu", (torch.randn(4, 3, 6), torch.randn(4, 3, 1)),
                     pp=2)
    assert "0 layers" not in str(info.value)


def _read_as_placed(gm, plan, axis: str, values) -> list[str]:
    """Edges where a consumer reads one of ``values`` otherwise than its producer gives it."""
    strategies = json.loads(plan.to_json())["strategies"]
    bad = []
    for node in gm.graph.nodes:
        need = strategies.get(node.name, {}).get(axis)
        if need is None:
            continue
        args = [a for a in node.all_input_nodes if a.name in strategies]
        for a, q in zip(args, need["in"]):
            if a in values and strategies[a.name][axis]["out"][0] != q:
                bad.append(f"{node.name} reads {a.name} as {q}")
    return bad


def test_buffers_filled_by_slices_and_complex_rotations_are_read_as_placed() -> None:
    """DeepSeek-V2's keys, written slice by slice into a ``new_empty`` buffer, rotated as
    complex numbers. Under cp a write read its slice through a copy (an internal error at
    parallelize, before the fix): every write now reads its target as placed. Under tp the
    gradient analysis stopped at the first complex value, so a replicated rotary key read
    by sharded computation got no gradient all-reduce (DeepSeek-V2 trained with gradients
    10x off): every value made from a weight, complex ones included, needs a gradient."""
    from autopar.core.graph_facts import META_KEY

    model, (args, _) = hand_models._built(hand_models.SlicedKeys, hand_models._tokens(1),
                                          hand_models._labels(2))()
    gm = autopar.trace(model, (args, {}))
    targets = {n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default}
    plan = autopar.plan(gm, "2xcpu", cp=2)
    assert plan.mesh["cp"] == 2
    assert _read_as_placed(gm, plan, "cp", targets) == []
    rotated = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.view_as_complex.default,
                                                           torch.ops.aten.view_as_real.default)]
    assert len(rotated) == 4
    assert [n.name for n in rotated if not n.meta[META_KEY].requires_grad] == []
