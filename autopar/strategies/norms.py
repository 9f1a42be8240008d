"""Sharding rules for normalizations: layer_norm, native_layer_norm, rms_norm, softmax and
log_softmax.

A normalization computes statistics over some dims and rescales along them. Run locally on
a shard of a normalized dim, it would normalize with the wrong statistics, so only the other
(leading, or for softmax: all but ``dim``) dims can be sharded; the affine weight and bias
cover the normalized dims and stay replicated. The output is not linear in the input, but
it is in the affine parameters: ``norm(x) * w + b`` with ``w`` and ``b`` partial is partial
(``w`` alone, or ``b`` alone, only for ``P(avg)``).
"""

from __future__ import annotations

import torch

from autopar.core.placements import Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, norm_dim, replicate_all
from autopar.ops.local_ops import SYNC_BATCH_NORM
from autopar.strategies.pointwise import (
    R,
    group_options,
    nonempty_subsets,
    partial_strategies,
    shard_other_dims,
    tensor_slot,
)
from autopar.strategies.registry import register_rule

aten = torch.ops.aten


def _leading_dims(call: OpCall, axis_size: int, n_leading: int) -> list[Strategy]:
    """Shard one of the first ``n_leading`` dims of the input and of every output; any
    other tensor input (weight, bias) is replicated."""
    x = call.tensor_args[0]
    n_in = len(call.tensor_args)
    strategies = [replicate_all(call)]
    for d in range(n_leading):
        for g in group_options(call, d, x.ndim):
            if can_shard(x.shape[d], axis_size, g):
                ins: tuple[Placement, ...] = (Shard(d, g),) + (R,) * (n_in - 1)
                outs = tuple(Shard(d, g) for _ in call.out)
                strategies.append(Strategy(ins, outs))
    return strategies


@register_rule(
    aten.layer_norm.default,
    aten.native_layer_norm.default,
    aten.rms_norm.default,
    aten._fused_rms_norm.default,
)
def layer_norm(call: OpCall, axis_size: int) -> list[Strategy]:
    """Normalize over the last ``len(normalized_shape)`` dims: shard the dims before them.

    ``native_layer_norm`` also returns the mean and rstd, of shape ``(leading..., 1, ...)``,
    sharded like the output; ``_fused_rms_norm`` likewise returns rstd.
    """
    x = call.tensor_args[0]
    k = len(call.arg(1, "normalized_shape"))
    strategies = _leading_dims(call, axis_size, x.ndim - k)
    weight, bias = tensor_slot(call, 2, "weight"), tensor_slot(call, 3, "bias")
    params = [s for s in (weight, bias) if s is not None]
    # Without a weight, norm(x) + b counts norm(x) once per device: not linear in b.
    linear = [params] if weight is not None else []
    # mean/rstd (the extra outputs) do not depend on the parameters: they stay whole.
    pinned = (None,) + (R,) * (len(call.out) - 1)
    return strategies + partial_strategies(call, linear, nonempty_subsets(params), pinned)


@register_rule(
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
)
def softmax(call: OpCall, axis_size: int) -> list[Strategy]:
    """Softmax over ``dim``: every other dim can be sharded."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return [replicate_all(call), *shard_other_dims(call, x.shape, dim, axis_size, 1)]


@register_rule(aten.batch_norm.default)
def batch_norm(call: OpCall, axis_size: int) -> list[Strategy]:
    """``batch_norm(x, weight, bias, running_mean, running_var, training, ...)`` over
    ``(batch, channels, *spatial)``: each channel alone, so channels shard with the
    per-channel tensors. In training the statistics are over the batch: splitting it is
    exact only with the statistics synchronised over the axis (``local_impl``
    ``sync_batch_norm``, :mod:`autopar.ops.local_ops`), which the batch axis runs. In eval the
    running statistics are used and samples are independent."""
    x = call.tensor_args[0]
    n_in = len(call.tensor_args)
    strategies = [replicate_all(call)]
    if x.ndim < 2:
        return strategies
    training = bool(call.arg(5, "training", True))
    if can_shard(x.shape[1], axis_size):
        strategies.append(Strategy((Shard(1),) + (Shard(0),) * (n_in - 1), (Shard(1),)))
    if can_shard(x.shape[0], axis_size):
        strategies.append(Strategy((Shard(0),) + (R,) * (n_in - 1), (Shard(0),),
                                   local_impl=SYNC_BATCH_NORM if training else None))
    return strategies
