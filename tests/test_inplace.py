"""In-place writes under tensor parallelism: the edges they tie, the solver keeping them,
and the refusals (hand-edited plans, recomputation of a layer that writes outside itself).

The per-op rules are checked numerically and against DTensor in test_rules.py; T5 trained
with tp=2 against one device is in test_inplace_equivalence.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import autopar
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Shard
from autopar.core.values import tensor_inputs, value_of
from autopar.passes import PassContext, PassManager, sharding_passes
from autopar.solver.model.problem import restrict_to
from autopar.solver.search import mesh_search as search
from autopar.strategies.mutation import layer_writes_outside, ties
from tests.distributed import FAST


class ShiftRight(nn.Module):
    """Decoder inputs made as T5 and BART make them: the labels shifted right into a new
    buffer, written in place through views, then read by an embedding and an MLP."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        dec = labels.new_zeros(labels.shape)
        dec[:, 1:] = labels[:, :-1].clone()
        dec[:, 0] = 0
        dec.masked_fill_(dec == -100, 0)
        h = self.emb(dec)
        h = h + self.down(F.relu(self.up(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _cluster(devices: int = 2) -> dict:
    with open(FAST) as f:
        cluster = yaml.safe_load(f)
    cluster.update(devices_per_node=devices)
    return cluster


@pytest.fixture(scope="module")
def shifted():
    torch.manual_seed(0)
    model = ShiftRight()
    labels = torch.randint(0, 32, (4, 8))
    return model, labels, autopar.trace(model, (labels,))


def test_ties_of_a_shifted_buffer(shifted) -> None:
    """The written buffer's views, the writes, and the read before the last write are tied;
    the embedding reads after the last write and may get a redistributed copy."""
    _, _, gm = shifted
    found = {(c.target.__name__, t.kind, t.write.target.__name__) for (c, _), t in
             ties(gm.graph).items()}
    assert found == {
        ("slice.Tensor", "view", "masked_fill_.Scalar"),
        ("copy_.default", "written", "masked_fill_.Scalar"),
        ("select.int", "view", "masked_fill_.Scalar"),
        ("fill_.Tensor", "written", "masked_fill_.Scalar"),
        ("eq.Scalar", "read before write", "masked_fill_.Scalar"),
        ("masked_fill_.Scalar", "written", "masked_fill_.Scalar"),
    }
    embedding = next(n for n in gm.graph.nodes if "embedding" in str(n.target))
    assert not any(c is embedding for c, _ in ties(gm.graph))


def test_pieces_of_a_split_share_its_input() -> None:
    """A write into one piece of ``split`` writes the buffer: the split is a view of it."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = x.new_zeros(4, 8)
            a, b = buf.split(4, dim=1)
            a.copy_(x[:, :4] * 2)
            return buf.sum() + b.sum()

    gm = torch.export.export(M(), (torch.randn(4, 8),), strict=False).module()
    kinds = {(c.target.__name__, t.kind) for (c, _), t in ties(gm.graph).items()}
    assert kinds == {("split.Tensor", "view"), ("copy_.default", "written")}


class HeadBuffer(nn.Module):
    """Queries assembled in a buffer, as DeepSeek-V3 assembles its no-RoPE and RoPE parts:
    two projections written into slices of one new tensor, per head."""

    def __init__(self, dim: int = 16, heads: int = 4, a: int = 4, b: int = 2) -> None:
        super().__init__()
        self.heads, self.a, self.b = heads, a, b
        self.qa, self.qb = nn.Linear(dim, heads * a), nn.Linear(dim, heads * b)
        self.out = nn.Linear(heads * (a + b), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q = x.new_empty(n, t, self.heads, self.a + self.b)
        q[..., : self.a] = self.qa(x).view(n, t, self.heads, self.a)
        q[..., self.a :] = self.qb(x).view(n, t, self.heads, self.b)
        return self.out(q.flatten(2)).square().mean()


@pytest.fixture(scope="module")
def head_buffer():
    torch.manual_seed(0)
    model, x = HeadBuffer(), torch.randn(2, 4, 16)
    return model, x, autopar.trace(model, (x,))


def _first_slice(gm) -> str:
    return next(n.name for n in gm.graph.nodes if str(n.target) == "aten.slice.Tensor"
                and "new_empty" in n.args[0].name)


@pytest.fixture
def heads_forced(head_buffer, monkeypatch):
    """The solver made to read the first slice of the buffer split by heads (dim 2): what
    attention wants, and what a replicated buffer would serve through a copy."""
    _, _, gm = head_buffer
    name, real = _first_slice(gm), search.build_problem

    def build(gm, tp, batch, *skeleton):
        problem = real(gm, tp, batch, *skeleton)
        restrict_to(problem, frozenset({name}), lambda s: s.inputs[0] == Shard(2))
        return problem

    monkeypatch.setattr(search, "build_problem", build)
    return name, autopar.plan(gm, _cluster(), tp=2)


def test_solver_keeps_a_written_buffer_in_place(head_buffer, heads_forced) -> None:
    """With one view of the buffer split by heads, the buffer itself, the other view, and
    both writes and their sources take matching placements: no tied edge is redistributed."""
    _, _, gm = head_buffer
    name, plan = heads_forced
    assert plan.strategies[name]["tp"]["in"] == ["S(2)"]
    checked = 0
    for (consumer, slot), _ in ties(gm.graph).items():
        producer, index = value_of(tensor_inputs(consumer)[slot])
        have = plan.strategies[producer.name]["tp"]["out"][index]
        assert plan.strategies[consumer.name]["tp"]["in"][slot] == have, consumer.name
        checked += 1
    assert checked == 4  # two slices (views), two copies (writes)
    buffer = next(n for n in gm.graph.nodes if n.name.startswith("new_empty"))
    assert plan.strategies[buffer.name]["tp"]["out"] == ["S(2)"]


def test_hand_edited_plan_that_copies_a_written_buffer_is_refused(head_buffer,
                                                                  heads_forced) -> None:
    """A plan whose view of the buffer reads another placement than the buffer has would
    write into a redistributed copy: the collective pass refuses it, naming the write."""
    model, x, _ = head_buffer
    name, plan = heads_forced
    plan = copy.deepcopy(plan)
    plan.strategies[name]["tp"] = {"in": ["R"], "out": ["R"]}
    program = autopar.trace(model, (x,))
    with pytest.raises(AutoparError) as e:
        PassManager(sharding_passes()).run(program, PassContext(plan, {"dp": 0, "tp": 0}))
    text = str(e.value)
    assert "in-place write copy_" in text and "reads new_empty (view) as R" in text
    assert "test_inplace.py" in text  # the source line of the write


class _AddInto(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.lin(x))
        total.add_(y)
        return y


class _Accumulating(nn.Module):
    """Layers that add into a buffer made before them (a running sum of layer outputs)."""

    def __init__(self, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_AddInto(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(x)
        for layer in self.layers:
            x = layer(x, total)
        return total.square().mean()


def test_recomputing_a_layer_that_writes_outside_it_is_refused() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    gm = autopar.trace(_Accumulating(), (x,))
    crossing = layer_writes_outside(gm.graph)
    assert [str(w.target) for w, _ in crossing] == ["aten.add_.Tensor"] * 2
    with pytest.raises(AutoparError, match="recomputation would run the in-place write add_"):
        autopar.plan(gm, "2xcpu", dp=2, recompute="full")
    assert autopar.plan(gm, "2xcpu", dp=2, recompute="none").training["recompute"] == "none"


def test_a_buffer_written_with_gradients_requires_grad(head_buffer) -> None:
    """The buffer is made without autograd history, then written with projections that have
    one: it and its readers require grad (else the tensor-parallel pass would skip the
    all-reduce of their gradients, and training would be silently wrong)."""
    _, _, gm = head_buffer
    facts = {n.name: n.meta[META_KEY] for n in gm.graph.nodes}
    assert facts["new_empty"].requires_grad and facts["flatten"].requires_grad
