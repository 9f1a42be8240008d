"""Sharding rules for ops that write a source into positions of a tensor: ``index_put``,
``index_copy``, ``index_add``, ``scatter``, ``scatter_add``, ``slice_scatter`` and
``select_scatter`` (the functional forms of ``x[i] = v``, ``x[:, 2:] = v``, ...; their
in-place forms get these rules filtered by :mod:`autopar.strategies.inplace`).

Positions are global indices, so the dims they address are never sharded; every other dim
of the destination may be, with the source and index tensors sliced the same way where
they have that dim. The result takes each element from the destination or from the source
(or adds them), so it is linear in both together and affine in each alone:
``P + P -> P``, ``P(avg)`` with the other whole ``-> P(avg)``. A written constant is
linear only if it is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from autopar.core.placements import Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, TensorMeta, norm_dim, replicate_all
from autopar.strategies.pointwise import (
    R,
    aligned_dim,
    is_zero,
    partial_strategies,
    present_slots,
    tensor_slot,
)
from autopar.strategies.registry import register_rule

aten = torch.ops.aten

# For a destination dim, the dim each other tensor input is sliced along (None: whole).
DimMap = Callable[[int], Sequence[int | None]]


def _shard_kept_dims(call: OpCall, axis_size: int, fixed: set[int], others: DimMap
                     ) -> list[Strategy]:
    """Destination ``Shard(d)`` for every ``d`` not in ``fixed``, the other inputs sliced
    as ``others(d)`` says, the output as the destination."""
    x = call.tensor_args[0]
    strategies = []
    for d, size in enumerate(x.shape):
        if d in fixed or not can_shard(size, axis_size):
            continue
        rest: list[Placement] = [R if o is None else Shard(o) for o in others(d)]
        strategies.append(Strategy((Shard(d), *rest), (Shard(d),)))
    return strategies


def _write_partials(call: OpCall, source: int | None, value: object = None) -> list[Strategy]:
    """Partial strategies of "destination with ``source`` written in": linear in both,
    affine in each; with a constant instead of a source, linear only if it is 0."""
    if source is None:
        return partial_strategies(call, [[0]] if is_zero(value) else [], [[0]])
    return partial_strategies(call, [[0, source]], [[0], [source]])


def _same_size(metas: Sequence[TensorMeta | None], d: int) -> bool:
    sizes = {m.shape[d] for m in metas if m is not None}
    return len(sizes) == 1


@register_rule(aten.index_put.default)
def index_put(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x[i0, i1, ...] = v`` (``accumulate``: ``+=``). Integer indices: an un-indexed dim
    of ``x`` is sharded with the matching dim of ``v`` (broadcast to ``x[i0, ...]``'s
    shape), the indices whole. A single boolean mask with a one-element ``v``
    (``x[mask] = 0``) is elementwise: ``x`` and the mask shard alike."""
    x = call.tensor_args[0]
    indices = list(call.arg(1, "indices"))
    v_slot = tensor_slot(call, 2, "values")
    v = call.tensor_args[v_slot] if v_slot is not None else None
    idx = [(p, m) for p, m in enumerate(indices) if isinstance(m, TensorMeta)]
    strategies = [replicate_all(call), *_write_partials(call, v_slot)]
    if not idx or v is None:
        return strategies
    n_idx = len(idx)
    if any(m.dtype in (torch.bool, torch.uint8) for _, m in idx):
        if n_idx != 1 or v.numel() != 1:
            return strategies
        ((p, mask),) = idx
        strategies += _shard_kept_dims(
            call, axis_size, set(), lambda d: [d - p if p <= d < p + mask.ndim else None, None]
        )
        return strategies
    positions = [p for p, _ in idx]
    bshape = tuple(torch.broadcast_shapes(*(torch.Size(m.shape) for _, m in idx)))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    unindexed = [d for d in range(x.ndim) if d not in positions]
    if adjacent:
        first = positions[0]
        result = (*x.shape[:first], *bshape, *x.shape[positions[-1] + 1:])
    else:
        result = (*bshape, *(x.shape[d] for d in unindexed))

    def values_dim(d: int) -> list[int | None]:
        if adjacent:
            o = d if d < positions[0] else d - n_idx + len(bshape)
        else:
            o = len(bshape) + unindexed.index(d)
        return [None] * n_idx + [aligned_dim(v, result, o)]

    return strategies + _shard_kept_dims(call, axis_size, set(positions), values_dim)


@register_rule(aten.index_copy.default, aten.index_add.default)
def index_copy(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.index_copy(dim, index, src)`` / ``index_add``: rows ``index`` along ``dim`` of
    ``x`` take (or add) ``src``'s; every other dim shards on ``x`` and ``src`` alike."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    src = tensor_slot(call, 3, "source")
    if src is None or x.ndim == 0:
        return [replicate_all(call)]
    return [
        replicate_all(call),
        *_shard_kept_dims(call, axis_size, {dim}, lambda d: [None, d]),
        *_write_partials(call, src),
    ]


@register_rule(
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
)
def scatter(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.scatter(dim, index, src)``: a dim other than ``dim`` shards when ``x``,
    ``index`` and ``src`` all have its full size there (``index`` may be smaller, and then
    local slices would not line up). With a ``reduce`` (multiply) no partial."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    src = tensor_slot(call, 3, "src")
    metas = call.tensor_args
    strategies = [replicate_all(call)]
    if x.ndim == 0 or any(m.ndim != x.ndim for m in metas):
        return strategies
    fixed = {dim} | {d for d in range(x.ndim) if not _same_size(metas, d)}
    strategies += _shard_kept_dims(call, axis_size, fixed, lambda d: [d] * (len(metas) - 1))
    if call.target in (aten.scatter.reduce, aten.scatter.value_reduce):
        return strategies
    return strategies + _write_partials(call, src, call.arg(3, "value"))


@register_rule(aten.slice_scatter.default)
def slice_scatter(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x[..., start:end:step, ...] = src`` as a function: the sliced dim stays whole
    (its bounds are global), every other dim shards on ``x`` and ``src`` alike."""
    x = call.tensor_args[0]
    slots = present_slots(call, ((1, "src"),))
    if x.ndim == 0 or not slots:
        return [replicate_all(call)]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    return [
        replicate_all(call),
        *_shard_kept_dims(call, axis_size, {dim}, lambda d: [d]),
        *_write_partials(call, slots[0]),
    ]


@register_rule(aten.select_scatter.default)
def select_scatter(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x[..., i, ...] = src`` as a function: ``src`` lacks the selected dim."""
    x = call.tensor_args[0]
    if x.ndim == 0:
        return [replicate_all(call)]
    dim = norm_dim(call.arg(2, "dim"), x.ndim)
    return [
        replicate_all(call),
        *_shard_kept_dims(call, axis_size, {dim}, lambda d: [d if d < dim else d - 1]),
        *_write_partials(call, 1),
    ]
