"""Sharding rules for matrix products: linear, addmm, mm, bmm, baddbmm, matmul.

Each product is described by labels, as in an einsum: every operand dim is a batch dim,
``m`` (rows), ``n`` (columns) or ``k`` (contracted). Then, on one mesh axis:

- a label that reaches the output may be sharded on every operand that has it (an operand
  without it, or broadcasting it, stays replicated): the output is sharded on that label.
  Megatron's column-parallel linear is ``n`` sharded (weight ``Shard(0)``), sequence or data
  parallelism a batch dim;
- ``k`` sharded on both factors gives each device a partial product: output
  ``Partial("sum")`` (Megatron's row-parallel linear). A bias would then be added once per
  device, so the bias must itself be ``Partial("sum")``;
- a product is linear in each factor alone: ``P @ R -> P`` (bias partial too, for sum);
  it is affine in (factor, bias), so ``P(avg)`` also allows a replicated bias.

``Shard(n, groups=k)`` on the weight (one block per fused projection) gives the output
``Shard(last, groups=k)``, offered for each ``split_groups`` hint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from autopar.core.placements import Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, TensorMeta, replicate_all
from autopar.strategies.pointwise import (
    PSUM,
    R,
    group_options,
    partial_strategies,
    tensor_slot,
)
from autopar.strategies.registry import register_rule

aten = torch.ops.aten

Labels = Mapping[str, int]  # label -> dim of one operand (or of the output)


def _batch_labels(meta: TensorMeta, n_batch: int, out_batch: Sequence[int]) -> dict[str, int]:
    """Right-align ``meta``'s first ``n_batch`` dims with the output's batch dims; a dim
    that broadcasts (size 1 against a larger output) gets no label."""
    labels = {}
    offset = len(out_batch) - n_batch
    for d in range(n_batch):
        o = d + offset
        if meta.shape[d] == out_batch[o]:
            labels[f"b{o}"] = d
    return labels


def _bias_labels(bias: TensorMeta, out_shape: Sequence[int], out_labels: Labels) -> dict[str, int]:
    """Labels of a bias broadcast against the output (right-aligned)."""
    by_dim = {o: label for label, o in out_labels.items()}
    labels = {}
    offset = len(out_shape) - bias.ndim
    for d in range(bias.ndim):
        o = d + offset
        if bias.shape[d] == out_shape[o] and o in by_dim:
            labels[by_dim[o]] = d
    return labels


def product_strategies(
    call: OpCall,
    axis_size: int,
    factors: tuple[int, int],
    operands: Mapping[int, Labels],
    out_labels: Labels,
    bias: int | None = None,
) -> list[Strategy]:
    """Strategies of a (possibly biased, batched) product.

    ``factors`` are the tensor slots of the two multiplied operands, ``bias`` the slot of
    an added term; ``operands`` maps each slot to its labels, ``out_labels`` the output's.
    """
    n_in = len(call.tensor_args)
    out_shape = call.out[0].shape
    strategies = [replicate_all(call)]

    for label, o in out_labels.items():
        for g in group_options(call, o, len(out_shape)):
            if not can_shard(out_shape[o], axis_size, g):
                continue
            ins: list[Placement] = [R] * n_in
            for slot, labels in operands.items():
                if label in labels:
                    ins[slot] = Shard(labels[label], g)
            strategies.append(Strategy(tuple(ins), (Shard(o, g),)))

    a, b = factors
    if "k" in operands[a] and "k" in operands[b]:
        size = call.tensor_args[a].shape[operands[a]["k"]]
        if can_shard(size, axis_size):
            ins = [R] * n_in
            ins[a] = Shard(operands[a]["k"])
            ins[b] = Shard(operands[b]["k"])
            if bias is not None:
                ins[bias] = PSUM
            strategies.append(Strategy(tuple(ins), (PSUM,)))

    extra = [] if bias is None else [bias]
    linear = [[f, *extra] for f in factors]
    affine = [[f] for f in factors] + ([[bias]] if bias is not None else [])
    return strategies + partial_strategies(call, linear, affine)


@register_rule(aten.linear.default)
def linear(call: OpCall, axis_size: int) -> list[Strategy]:
    """``linear(x, w, b) = x @ w.T + b`` with ``w`` of shape ``(out, in)``."""
    x = call.tensor_args[0]
    out_shape = call.out[0].shape
    out_labels = {f"b{o}": o for o in range(len(out_shape) - 1)}
    out_labels["n"] = len(out_shape) - 1
    operands: dict[int, dict[str, int]] = {
        0: {**_batch_labels(x, x.ndim - 1, out_shape[:-1]), "k": x.ndim - 1},
        1: {"n": 0, "k": 1},
    }
    bias = tensor_slot(call, 2, "bias")
    if bias is not None:
        operands[bias] = _bias_labels(call.tensor_args[bias], out_shape, out_labels)
    return product_strategies(call, axis_size, (0, 1), operands, out_labels, bias)


def _mm_labels(call: OpCall, a: int, b: int) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
    """Labels of ``mm``/``bmm``/``matmul`` operands (torch.matmul's broadcasting rules:
    a 1-d operand has only ``k``; leading dims are batch dims, broadcast right-aligned)."""
    ma, mb = call.tensor_args[a], call.tensor_args[b]
    out_shape = call.out[0].shape
    n_batch = max(len(out_shape) - (ma.ndim > 1) - (mb.ndim > 1), 0)
    out_batch = out_shape[:n_batch]
    out_labels = {f"b{o}": o for o in range(n_batch)}
    la: dict[str, int] = {"k": ma.ndim - 1}
    lb: dict[str, int] = {"k": max(mb.ndim - 2, 0)}
    if ma.ndim > 1:
        la.update(_batch_labels(ma, ma.ndim - 2, out_batch), m=ma.ndim - 2)
        out_labels["m"] = n_batch
    if mb.ndim > 1:
        lb.update(_batch_labels(mb, mb.ndim - 2, out_batch), n=mb.ndim - 1)
        out_labels["n"] = len(out_shape) - 1
    return {a: la, b: lb}, out_labels


@register_rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def mm(call: OpCall, axis_size: int) -> list[Strategy]:
    """``a @ b``, batched and broadcast as ``torch.matmul`` does."""
    operands, out_labels = _mm_labels(call, 0, 1)
    return product_strategies(call, axis_size, (0, 1), operands, out_labels)


@register_rule(aten.addmm.default, aten.baddbmm.default)
def addmm(call: OpCall, axis_size: int) -> list[Strategy]:
    """``beta * bias + alpha * (a @ b)``, bias broadcast to the output.

    HF GPT-2's ``Conv1D`` is ``addmm(bias, x2d, w)`` with ``w`` of shape ``(in, out)``: its
    column-parallel form is ``w`` ``Shard(1)`` with bias ``Shard(0)``; its row-parallel form
    (``x2d`` ``Shard(1)``, ``w`` ``Shard(0)``) needs the bias ``Partial("sum")``.
    """
    operands, out_labels = _mm_labels(call, 1, 2)
    operands[0] = _bias_labels(call.tensor_args[0], call.out[0].shape, out_labels)
    return product_strategies(call, axis_size, (1, 2), operands, out_labels, bias=0)
