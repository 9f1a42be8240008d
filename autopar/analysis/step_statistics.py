"""Batch statistics of the inputs alone, taken over the whole step before it runs.

A statistic of the batch (a value reduced over its samples: ``Partial`` on ``dp``) that some
op needs whole couples the parts of a split batch. Where it depends on the model's
activations (tokens routed to each expert) only data parallelism can make it whole, by an
all-reduce inside the forward; the microbatches of one step run one after another, so none
of them can see the others'. But where it is computed from the batch's inputs alone -- the
count of labelled tokens a mean loss divides by, a count of padding -- every part's share
is known before anything runs: the program's *prologue* computes it for each microbatch of
each rank, the runtime adds them up (and all-reduces them over the data-parallel and
context-parallel ranks), and every microbatch reads the step's value
(:func:`step_statistic`). That keeps a mean over labelled tokens exact under dp, cp,
microbatches and pipelines, as Megatron-Core's per-token loss and Hugging Face's
``num_items_in_batch`` do by hand.

The analysis (:func:`from_inputs`) is shared by the planner (``solver/batch_coupling``:
such statistics never refuse a split) and the rewrite (``passes/sync_batch_statistics``:
which statistics go into the prologue).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Partial
from autopar.ops.comm_ops import _group
from autopar.strategies.mutation import writes

META = "autopar_step_statistics"  # gm.meta key of a program's StepStatistics


def from_inputs(node: fx.Node, memo: dict[fx.Node, bool] | None = None) -> bool:
    """Is ``node``'s value computed from the graph's inputs alone: no parameter, no random
    op, no buffer the graph writes? (Then it is known before the step runs.)"""
    memo = {} if memo is None else memo
    if node in memo:
        return memo[node]
    written = _written(node.graph)
    todo = [node]
    while todo:
        n = todo[-1]
        if n in memo:
            todo.pop()
            continue
        pending = [a for a in n.all_input_nodes if a not in memo]
        if pending:
            todo.extend(pending)
            continue
        todo.pop()
        memo[n] = _leaf_ok(n, written) and all(memo[a] for a in n.all_input_nodes)
    return memo[node]


def _leaf_ok(node: fx.Node, written: set[fx.Node]) -> bool:
    if node.op == "placeholder":
        return True
    if node.op == "get_attr":
        facts = node.meta.get(META_KEY)
        param = facts.param if facts is not None else None
        return param is not None and param.is_buffer and node not in written
    if node.op != "call_function":
        return False
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or not schema.is_mutable


def _written(graph: fx.Graph) -> set[fx.Node]:
    """The buffers in-place ops of ``graph`` write."""
    return {base for _, base in writes(graph)}


# --- what the program runs -----------------------------------------------------------------
@dataclass(frozen=True)
class Statistic:
    """One statistic of the prologue: its key, and how its parts combine on each axis the
    value is split over (``"sum"`` or ``"avg"``; ``"batch"`` covers the microbatches)."""

    key: str
    reduce: tuple[tuple[str, str], ...]  # (axis, "sum" | "avg"), e.g. (("batch", "sum"),)


@dataclass(frozen=True)
class StepStatistics:
    """A program's prologue: ``module(*inputs)`` (the program's inputs, one microbatch)
    returns every statistic's share, in ``statistics`` order."""

    module: fx.GraphModule
    statistics: tuple[Statistic, ...]

    def evaluate(self, microbatches: Sequence[Sequence]) -> dict[str, torch.Tensor]:
        """The step's value of each statistic: the shares of every microbatch (each given as
        the list of the program's inputs), combined over the ranks of each axis it is split
        over (all-reduced on the groups the mesh bound, :mod:`autopar.ops.comm_ops`)."""
        with torch.no_grad():
            shares = [self.module(*inputs) for inputs in microbatches]
            values = {}
            for i, stat in enumerate(self.statistics):
                value = torch.stack([share[i] for share in shares]).sum(0)
                for axis, reduce in stat.reduce:
                    group, n = None, len(shares)
                    if axis != "batch":
                        group, n, _ = _group(axis)
                    if group is not None:
                        dist.all_reduce(value, group=group)
                    if reduce == "avg" and n > 1:
                        value = value / n
                values[stat.key] = value
        return values


@dataclass(frozen=True)
class _Step:
    values: dict[str, torch.Tensor]
    microbatches: int


_STEP: ContextVar[_Step | None] = ContextVar("training_step", default=None)


@contextmanager
def training_step(values: dict[str, torch.Tensor] | None, microbatches: int) -> Iterator[None]:
    """Within it the program runs one of a step's ``microbatches``: :func:`step_statistic`
    returns the step's ``values`` (``StepStatistics.evaluate``), :func:`parts_scaled`
    counts the microbatches. Outside (a plain forward call), a call is its own step."""
    token = _STEP.set(_Step(values or {}, microbatches))
    try:
        yield
    finally:
        _STEP.reset(token)


def parts_scaled(x: torch.Tensor, dp: int, power: int, cp: int = 1) -> torch.Tensor:
    """What the graph calls to turn a share of a sum over the batch into a share of its mean
    (``power`` 1) or back (-1): ``x`` times ``(dp x microbatches) ** power``, the parts the
    batch is split into (the step's microbatches; one in a plain forward call), and times
    ``cp`` for a sum over the tokens of the context-parallel ranks."""
    step = _STEP.get()
    parts = dp * (step.microbatches if step is not None else 1)
    factor = float(parts) ** power * cp
    return x if factor == 1.0 else x * factor


def step_statistic(local: torch.Tensor, key: str, axes: Sequence[str] = ()) -> torch.Tensor:
    """What the graph calls where it needs a statistic whole: the step's value within a
    training step; in a plain forward call (no microbatches), ``local`` combined over the
    data axes ``axes`` ("axis:sum" or "axis:avg") by all-reduce."""
    step = _STEP.get()
    if step is not None and key in step.values:
        return step.values[key].to(local.dtype)
    out = local.detach().clone()
    for entry in axes:
        axis, _, reduce = entry.partition(":")
        group, n, _ = _group(axis)
        if group is None:
            continue
        dist.all_reduce(out, group=group)
        if reduce == "avg":
            out = out / n
    return out


def reduce_of(p: Partial) -> str:
    return "avg" if p.reduce == "avg" else "sum"
