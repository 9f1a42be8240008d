"""What a cross-entropy costs as the runtime computes it: a block of tokens at a time.

``passes/chunked_loss.py`` replaces every cross-entropy over class indices with
:func:`autopar.ops.loss_ops.chunked_cross_entropy`, whose passes over the logits and kernel
launches per block :func:`autopar.ops.loss_ops.block_passes` counts from its code. Priced from
the traced op instead, the loss wrote the whole fp32 log-softmax that the blocks never make
and was charged one kernel: on an H200 at 16,384 tokens and 128,256 classes that was 13 ms
modelled against ~54 ms of the loss's kernels, plus their launches
(``benchmarks/results/h200_2026-11-29.md``).

Its time is a kind of :mod:`autopar.solver.pricing.kinds` (tried first); its memory, the
logits it keeps and the blocks its backward makes, :class:`LossTables` adds to
:class:`~autopar.solver.pricing.costs.CostTables`.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import TYPE_CHECKING

import torch.fx as fx

from autopar.analysis.chunkable_loss import VIEWS, fp32_cast
from autopar.cost_models.compute import forward_time
from autopar.ops.loss_ops import block_passes, chunk_rows, chunked_working_bytes
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.kinds import Times, register_kind
from autopar.solver.pricing.plugin_costs import plugin_priced
from autopar.solver.pricing.precision_costs import inserted_cast_time
from autopar.solver.pricing.traced_ops import AUTOCAST_FP32_TARGETS, chunked_loss_shape
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables

LABEL_SMOOTHING_ARG = 5
"""``aten.cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)``."""


def _chunked_unless_plugin(tables: CostTables, d: Decision) -> bool:
    """A chunked cross-entropy, unless a plugin prices the op (then the plugin's kind)."""
    return tables._chunked_loss(d) is not None and not plugin_priced(tables, d)


@register_kind("chunked loss", order=10, applies=_chunked_unless_plugin)
def chunked_loss_kind(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """The chunked cross-entropy ``d``, as the runtime runs it, block by block."""
    return chunked_loss_times(tables, d, s, tables._chunked_loss(d))


def chunked_loss_times(tables: CostTables, d: Decision, s: Strategy,
                       chunked: tuple[int, int, int]) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one instance of the chunked cross-entropy
    ``d`` (``chunked``: tokens and classes as traced, bytes of a logit) under ``s``: its
    passes over this device's logits at the device's bandwidth, and one kernel floor per
    launch. A vocabulary-parallel loss (tp splitting the classes) has the same elements per
    rank as one splitting the tokens."""
    tokens, classes, logit_bytes = chunked
    div = tables.setting.tp if s.splits_work else 1
    elements = max(1.0, tokens * tables._scale(d) / div) * classes
    blocks = max(1, math.ceil(elements / (chunk_rows(classes) * classes)))
    passes = block_passes(logit_bytes, label_smoothing(d.nodes[0]) > 0)
    device, dtype = tables.cluster.device, tables.dtype(d)
    casts = inserted_cast_time(tables, d, s)
    fwd = forward_time(0.0, elements * passes.forward_bytes, device, dtype,
                       kernels=blocks * passes.forward_kernels) + casts
    if not d.facts.requires_grad:
        return fwd, 0.0, 0.0
    bwd = forward_time(0.0, elements * passes.backward_bytes, device, dtype,
                       kernels=blocks * passes.backward_kernels) + casts
    return fwd, bwd, fwd if tables.recomputed(d) else 0.0


def label_smoothing(node: fx.Node) -> float:
    """The label smoothing a traced ``aten.cross_entropy_loss`` call asks for."""
    if len(node.args) > LABEL_SMOOTHING_ARG:
        return float(node.args[LABEL_SMOOTHING_ARG])
    return float(node.kwargs.get("label_smoothing", 0.0))


class LossTables:
    """The chunked cross-entropies of a problem and the memory of a loss (a part of
    :class:`~autopar.solver.pricing.costs.CostTables`, a mixin)."""

    def _chunked_loss(self, d: Decision) -> tuple[int, int, int] | None:
        """(tokens, classes as traced, bytes of a logit) of a cross-entropy the runtime
        computes chunked (``passes/chunked_loss.py``), else None. The loss reads the logits
        in the compute precision (a fp32 cast before it is folded in)."""
        return self._chunked_losses.get(d.index)

    @cached_property
    def _chunked_losses(self) -> dict[int, tuple[int, int, int]]:
        """The chunked cross-entropies by decision index (found once: asked on the hot path)."""
        if not self.options.chunked_loss:
            return {}
        return {d.index: (*shape, self.element_bytes) for d in self.problem.decisions
                if (shape := chunked_loss_shape(d)) is not None}

    @cached_property
    def _chunked_loss_inputs(self) -> frozenset[str]:
        names: set[str] = set()
        for index in self._chunked_losses:
            node = self.problem.decisions[index].nodes[0].args[0]
            while isinstance(node, fx.Node) and node.op == "call_function":
                names.add(node.name)
                if node.target in VIEWS:
                    node = node.args[0]
                else:
                    node = fp32_cast(node)  # folded into the loss; else the producer
        return frozenset(names)

    def loss_working_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of the fp32 buffer a loss keeps (its log-softmax), local to this device:
        at backward's start its gradient is as large, the largest temporary of many steps.
        A chunked cross-entropy keeps the logits (an activation); its backward makes their
        gradient and one block (fp32): half of that, as the peak counts the largest
        temporary twice."""
        if d.kind != "op" or d.facts.target not in AUTOCAST_FP32_TARGETS:
            return 0.0
        div = self.setting.tp if s.splits_work else 1
        chunked = self._chunked_loss(d)
        if chunked is not None:
            tokens, classes, logit_bytes = chunked
            local = max(1, int(tokens * self._scale(d) / div))
            return (local * classes * logit_bytes + chunked_working_bytes(local, classes)) / 2
        return d.facts.extra_saved_float_numel * 4 * self._scale(d) / div
