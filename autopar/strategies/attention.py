"""Sharding rule for ``scaled_dot_product_attention`` (q, k, v of shape (..., heads, seq, dim)).

Attention is independent across batch and across heads, so either can be sharded on q, k, v
and the output together, with the mask sharded along the same dim when it has it (a mask
dim of size 1 broadcasts and stays replicated). With ``enable_gqa`` a group of query heads
shares one key/value head; sharding both head counts by the axis size keeps each device's
query heads with their own key/value heads, so the key/value head count must divide too.

Sharding the *key/value* sequence is not valid locally: each query needs every key (that is
ring attention, a separate strategy). Sharding only the *query* sequence, with keys and
values whole, is valid when the mask is explicit (sharded along the query dim with q):
each device attends its queries to all keys. ``is_causal=True`` is excluded there, because
the implicit causal mask would be aligned to local, not global, query positions.

The output is linear in the values, so (without dropout) the value's feature dim may be
sharded (output sharded on its last dim) and a ``Partial`` value gives a ``Partial`` output.
With dropout each device would draw its own mask over the *same* attention weights, which no
single-device run does, so these two are offered only for ``dropout_p == 0``.

Dropout inside attention is random: see :func:`autopar.strategies.pointwise.dropout`.
"""

from __future__ import annotations

import torch

from autopar.core.placements import Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, replicate_all
from autopar.strategies.pointwise import R, aligned_dim, partial_strategies, tensor_slot
from autopar.strategies.registry import register_rule

aten = torch.ops.aten


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa(call: OpCall, axis_size: int) -> list[Strategy]:
    q, k, v = call.tensor_args[:3]
    mask_slot = tensor_slot(call, 3, "attn_mask")
    mask = call.tensor_args[mask_slot] if mask_slot is not None else None
    is_causal = bool(call.arg(5, "is_causal", False))
    gqa = bool(call.kwargs.get("enable_gqa", False))
    n_in = len(call.tensor_args)
    nd = q.ndim
    if nd < 3 or k.ndim != nd or v.ndim != nd:
        return [replicate_all(call)]
    scores = (*q.shape[:-1], k.shape[-2])  # the (..., L, S) shape the mask broadcasts to
    strategies = [replicate_all(call)]

    def with_mask(ins: list[Placement], dim: int) -> tuple[Placement, ...]:
        if mask is not None and mask_slot is not None:
            a = aligned_dim(mask, scores, dim)
            ins[mask_slot] = R if a is None else Shard(a)
        return tuple(ins)

    heads = nd - 3
    for d in range(nd - 2):  # batch-like dims, heads last among them
        sizes = (q.shape[d], k.shape[d], v.shape[d])
        same = sizes[0] == sizes[1] == sizes[2]
        grouped = gqa and d == heads and sizes[1] == sizes[2] and sizes[0] % sizes[1] == 0
        if not (same or grouped) or not all(can_shard(s, axis_size) for s in sizes):
            continue
        ins: list[Placement] = [Shard(d), Shard(d), Shard(d)] + [R] * (n_in - 3)
        strategies.append(Strategy(with_mask(ins, d), (Shard(d),)))

    seq = nd - 2
    if not is_causal and can_shard(q.shape[seq], axis_size):
        ins = [Shard(seq), R, R] + [R] * (n_in - 3)
        strategies.append(Strategy(with_mask(ins, seq), (Shard(seq),)))

    if call.arg(4, "dropout_p", 0.0) == 0.0:
        if can_shard(v.shape[-1], axis_size):
            ins = [R, R, Shard(nd - 1)] + [R] * (n_in - 3)
            strategies.append(Strategy(tuple(ins), (Shard(nd - 1),)))
        strategies += partial_strategies(call, [[2]])
    return strategies
