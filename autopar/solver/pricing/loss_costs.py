"""What a cross-entropy costs as the runtime computes it: a block of tokens at a time.

``passes/chunked_loss.py`` replaces every cross-entropy over class indices with
:func:`autopar.ops.loss_ops.chunked_cross_entropy`, whose passes over the logits and kernel
launches per block :func:`autopar.ops.loss_ops.block_passes` counts from its code. Priced from
the traced op instead, the loss wrote the whole fp32 log-softmax that the blocks never make
and was charged one kernel: on an H200 at 16,384 tokens and 128,256 classes that was 13 ms
modelled against ~54 ms of the loss's kernels, plus their launches
(``benchmarks/results/h200_2026-11-29.md``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch.fx as fx

from autopar.cost_models.compute import forward_time
from autopar.ops.loss_ops import block_passes, chunk_rows
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.precision_costs import inserted_cast_time
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables

LABEL_SMOOTHING_ARG = 5
"""``aten.cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)``."""


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
