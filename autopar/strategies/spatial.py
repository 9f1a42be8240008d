"""Sharding rules for ops over ``(batch, channels, *spatial)`` tensors: pooling, resizing,
patches (``im2col``), group norm.

Each sample is pooled, resized or normalised alone, and pooling and resizing treat each
channel alone too: those dims shard freely, with the output sharded alike (max pooling's
indices are positions inside the sample's own map, so they stay right). The spatial dims
are windowed over and stay whole. Average pooling is linear in its input. Group norm mixes
the channels of a group, so only the batch dim shards there.
"""

from __future__ import annotations

import torch

from autopar.core.placements import Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, replicate_all
from autopar.strategies.pointwise import R, partial_strategies
from autopar.strategies.registry import register_rule

aten = torch.ops.aten

# op -> its spatial dims
_POOLS = {
    aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
    aten.adaptive_avg_pool3d.default: 3, aten._adaptive_avg_pool2d.default: 2,
    aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
}
_MAX_POOLS = {
    aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
    aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
    aten.adaptive_max_pool1d.default: 1, aten.adaptive_max_pool2d.default: 2,
}
_RESIZES = {
    aten.upsample_nearest1d.vec: 1, aten.upsample_nearest2d.vec: 2,
    aten.upsample_nearest3d.vec: 3, aten.upsample_linear1d.vec: 1,
    aten.upsample_bilinear2d.vec: 2, aten.upsample_bicubic2d.vec: 2,
    aten.upsample_trilinear3d.vec: 3,
}
_SPATIAL = {**_POOLS, **_MAX_POOLS, **_RESIZES}


def _sample_dims(call: OpCall, spatial: int, channels: bool) -> list[int]:
    """The input's dims that hold samples (and channels): all but the trailing spatial ones."""
    x = call.tensor_args[0]
    lead = x.ndim - spatial  # 2 when batched (N, C), 1 when not (C)
    return list(range(lead)) if channels else list(range(max(lead - 1, 0)))


@register_rule(*_SPATIAL)
def pooling(call: OpCall, axis_size: int) -> list[Strategy]:
    x = call.tensor_args[0]
    strategies = [replicate_all(call)]
    for d in _sample_dims(call, _SPATIAL[call.target], channels=True):
        if can_shard(x.shape[d], axis_size):
            strategies.append(Strategy((Shard(d),) + (R,) * (len(call.tensor_args) - 1),
                                       (Shard(d),) * len(call.out)))
    if call.target in _POOLS:
        strategies += partial_strategies(call, [[0]])
    return strategies


@register_rule(aten.im2col.default, aten.col2im.default)
def im2col(call: OpCall, axis_size: int) -> list[Strategy]:
    """``unfold``/``fold`` of batched maps: each sample's patches are its own."""
    x = call.tensor_args[0]
    strategies = [replicate_all(call)]
    batched = x.ndim == (4 if call.target is aten.im2col.default else 3)
    if batched and can_shard(x.shape[0], axis_size):
        strategies.append(Strategy((Shard(0),), (Shard(0),)))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.group_norm.default, aten.native_group_norm.default)
def group_norm(call: OpCall, axis_size: int) -> list[Strategy]:
    """``group_norm(x, groups, weight, bias, eps)``: each sample alone."""
    x = call.tensor_args[0]
    strategies = [replicate_all(call)]
    if x.ndim >= 2 and can_shard(x.shape[0], axis_size):
        outs = (Shard(0),) * len(call.out)  # native: (out, mean [N, G], rstd [N, G])
        strategies.append(Strategy((Shard(0),) + (R,) * (len(call.tensor_args) - 1), outs))
    return strategies
