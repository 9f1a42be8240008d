"""Sharding rules for convolutions (``conv1d/2d/3d``): vision and audio front ends.

A convolution treats each sample alone, so the batch dim shards freely (data parallelism
over images); output channels shard with the weight's first dim (each device computes some
filters), as a column-parallel linear. Linear in the input (a bias makes it affine).
"""

from __future__ import annotations

import torch

from autopar.core.placements import Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, replicate_all
from autopar.strategies.pointwise import R, partial_strategies, tensor_slot
from autopar.strategies.registry import register_rule

aten = torch.ops.aten


@register_rule(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
def conv(call: OpCall, axis_size: int) -> list[Strategy]:
    """``conv(x, w, b, stride, padding, dilation, groups)`` with ``x`` batched."""
    x, w = call.tensor_args[:2]
    out = call.out[0]
    bias = tensor_slot(call, 2, "bias")
    n_in = len(call.tensor_args)
    strategies = [replicate_all(call)]
    if x.ndim == w.ndim and can_shard(x.shape[0], axis_size):
        strategies.append(Strategy((Shard(0),) + (R,) * (n_in - 1), (Shard(0),)))
    groups = call.arg(6, "groups", 1)
    if groups == 1 and out.ndim == w.ndim and can_shard(w.shape[0], axis_size):
        ins = [R, Shard(0)] + [R] * (n_in - 2)
        if bias is not None:
            ins[bias] = Shard(0)
        strategies.append(Strategy(tuple(ins), (Shard(1),)))
    linear = [[0] + ([bias] if bias is not None else [])]
    affine = [[0]] if bias is not None else []
    return strategies + partial_strategies(call, linear, affine)
