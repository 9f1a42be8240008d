"""Sharding rules for losses: cross_entropy_loss, nll_loss(_nd), nll_loss(2d)_forward, and
the elementwise ones (regression, KL divergence, binary cross-entropy).

The class dim (dim 1, or 0 for a single sample) is normalized over and indexed by the
target, so it stays ``Replicate`` for the op as traced; class weights too. Cross-entropy over
``(tokens, classes)`` logits and index targets (no class weights) may also split the classes,
running Megatron's vocabulary-parallel cross-entropy instead (``Strategy.local_impl``). Any other (batch or spatial) dim can
be sharded on the input and the target together. What the local loss then is depends on the
reduction (0 none, 1 mean, 2 sum):

- none: the per-element loss, sharded like the target;
- sum: each device sums its elements: ``Partial("sum")``;
- mean: each device averages its elements: ``Partial("avg")``. This is exact only when every
  shard has the same number of non-ignored targets (and, with class weights, the same total
  weight), since the global mean divides by the global count. Shards of an LM batch padded
  with ``ignore_index`` are generally *not* equal: tracing writes every class-index mean as
  its sum over the count (:mod:`autopar.trace.mean_losses`), so only class-probability
  targets (a fixed count) reach this rule with a mean.

``nll_loss`` is linear in its (log-probability) input, whose normalizer does not depend on
it, so a ``Partial`` input gives a ``Partial`` loss. Cross-entropy is not linear in its
logits, but with class-probability targets it is linear in the targets (affine with label
smoothing, which mixes in a constant).
"""

from __future__ import annotations

import math

import torch

from autopar.core.placements import Partial, Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, replicate_all
from autopar.strategies.pointwise import R, partial_strategies
from autopar.strategies.registry import register_rule

aten = torch.ops.aten

_REDUCED = {1: Partial("avg"), 2: Partial("sum")}


def _loss_strategies(call: OpCall, axis_size: int, reduction: int) -> list[Strategy]:
    """Shard the input and target on each non-class dim."""
    x, target = call.tensor_args[:2]
    n_in = len(call.tensor_args)
    class_dim = 1 if x.ndim >= 2 else 0
    probs = target.ndim == x.ndim  # class-probability targets have the input's shape
    two_outputs = len(call.out) == 2  # nll_loss*_forward: (output, total_weight)
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        if d == class_dim or not can_shard(size, axis_size):
            continue
        od = d if d < class_dim else d - 1  # the per-element loss has no class dim
        td = d if probs else od
        for groups in _token_groups(size, axis_size) if d == 0 and not probs else (1,):
            out: Placement = _REDUCED.get(reduction, Shard(od, groups))
            ins: tuple[Placement, ...] = (Shard(d, groups), Shard(td, groups)) + (R,) * (
                n_in - 2)
            outs: tuple[Placement, ...] = (out,)
            if two_outputs:
                outs += (R if reduction == 0 else Partial("sum"),)
            strategies.append(Strategy(ins, outs))
    return strategies


MAX_TOKEN_GROUPS = 4096
"""The most sequences a flattened token dim is split sequence by sequence in (a batch)."""


def _token_groups(size: int, axis_size: int) -> tuple[int, ...]:
    """Block counts a flattened ``(batch * seq)`` dim may be split in: a split of each
    sequence (``groups`` = the sequences, context parallelism) pairs input and target
    token by token as well as a split of the whole."""
    if size % axis_size:
        return (1,)
    per = size // axis_size
    small = [g for g in range(1, math.isqrt(per) + 1) if per % g == 0]
    both = sorted({*small, *(per // g for g in small)})
    return tuple(g for g in both if g <= MAX_TOKEN_GROUPS)


VOCAB_PARALLEL_LOSS = "vocab_parallel_cross_entropy"


@register_rule(aten.cross_entropy_loss.default)
def cross_entropy_loss(call: OpCall, axis_size: int) -> list[Strategy]:
    strategies = _loss_strategies(call, axis_size, int(call.arg(3, "reduction", 1)))
    x, target = call.tensor_args[:2]
    plain = len(call.tensor_args) == 2  # no class weights
    if plain and x.ndim == 2 and target.ndim == 1 and not target.dtype.is_floating_point \
            and can_shard(x.shape[1], axis_size):
        # Megatron's vocabulary-parallel cross-entropy: classes split, the loss whole on
        # every device (autopar.ops.loss_ops; two token-sized all-reduces inside)
        strategies.append(Strategy((Shard(1), R), (R,) * len(call.out),
                                   local_impl=VOCAB_PARALLEL_LOSS))
    if target.ndim == x.ndim:  # class probabilities
        smoothed = call.arg(5, "label_smoothing", 0.0) != 0.0
        strategies += partial_strategies(call, [] if smoothed else [[1]], [[1]])
    return strategies


@register_rule(aten.nll_loss.default, aten.nll_loss_nd.default)
def nll_loss(call: OpCall, axis_size: int) -> list[Strategy]:
    reduction = int(call.arg(3, "reduction", 1))
    return _loss_strategies(call, axis_size, reduction) + partial_strategies(call, [[0]])


@register_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(call: OpCall, axis_size: int) -> list[Strategy]:
    """Also returns ``total_weight`` (the weight of the non-ignored targets; 0 for reduction
    none): summed over shards it is the global one, and it does not depend on the input."""
    reduction = int(call.arg(3, "reduction"))
    strategies = _loss_strategies(call, axis_size, reduction)
    return strategies + partial_strategies(call, [[0]], out_placements=(None, R))


# op -> position of its reduction argument (the tensors before it are input, target and
# weights that broadcast against the input)
_ELEMENTWISE = {
    aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
    aten.huber_loss.default: 2, aten.soft_margin_loss.default: 2,
    aten.kl_div.default: 2, aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4,
}


@register_rule(*_ELEMENTWISE)
def elementwise_loss(call: OpCall, axis_size: int) -> list[Strategy]:
    """Losses whose every element is its own (regression, KL divergence, binary
    cross-entropy over equal-shaped input and target, class weights broadcast against
    them): any dim may be sharded on the input and target, and on a weight that spans it; a
    mean over the elements is then a ``Partial("avg")`` (``"sum"``) of the shards' -- even
    shards have equal counts."""
    x, target = call.tensor_args[:2]
    if x.shape != target.shape:
        return [replicate_all(call)]
    reduction = int(call.arg(_ELEMENTWISE[call.target], "reduction", 1))
    weights = call.tensor_args[2:]
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        if not can_shard(size, axis_size):
            continue
        spans = []  # each weight: sharded along d with the input, or read whole
        for w in weights:
            wd = d - (x.ndim - w.ndim)  # weights broadcast from the right
            spans.append(Shard(wd) if wd >= 0 and w.shape[wd] == size else
                         R if wd < 0 or w.shape[wd] == 1 else None)
        if None in spans:
            continue
        out = _REDUCED.get(reduction, Shard(d))
        strategies.append(Strategy((Shard(d), Shard(d), *spans), (out,)))
    return strategies
