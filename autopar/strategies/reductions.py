"""Sharding rules for reductions: sum, mean, amax/amin, max/min.dim, var/std, argmax/argmin,
logsumexp, vector norms, topk, sort.

A dim that is not reduced keeps its shard. A reduced dim may be sharded only when the local
results combine with a placement we have: ``sum`` over a sharded dim leaves
``Partial("sum")``, ``mean`` (over equal shards) leaves ``Partial("avg")``. Max, variance,
arg-reductions, top-k and sorting have no such placement, so their reduced dim stays whole.
Sum and mean are linear, so a ``Partial`` input stays ``Partial``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.core.placements import Partial, Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, norm_dim, replicate_all
from autopar.strategies.pointwise import group_options, normalized_dims, partial_strategies
from autopar.strategies.registry import register_rule

aten = torch.ops.aten


def reduction_strategies(
    call: OpCall,
    axis_size: int,
    reduced: Sequence[int],
    keepdim: bool,
    over_shard: Placement | None = None,
) -> list[Strategy]:
    """Shard each kept dim; with ``over_shard`` also each reduced dim, giving that output."""
    x = call.tensor_args[0]
    n_out = len(call.out)
    out_ndim = call.out[0].ndim
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        if d in reduced:
            if over_shard is not None and can_shard(size, axis_size):
                strategies.append(Strategy((Shard(d),), (over_shard,) * n_out))
            continue
        o = d if keepdim else d - sum(r < d for r in reduced)
        for g in group_options(call, o, out_ndim):
            if can_shard(size, axis_size, g):
                strategies.append(Strategy((Shard(d, g),), (Shard(o, g),) * n_out))
    return strategies


def _dims_arg(call: OpCall) -> tuple[list[int], bool]:
    """(reduced dims, keepdim) of a ``(self, dim, keepdim)``-style reduction."""
    x = call.tensor_args[0]
    keepdim = bool(call.arg(2, "keepdim", False))
    dims = call.arg(1, "dim")
    return normalized_dims(dims, x.ndim), keepdim


@register_rule(aten.sum.dim_IntList, aten.sum.default)
def sum_(call: OpCall, axis_size: int) -> list[Strategy]:
    """Sum over a sharded dim: each device sums its part, the total is ``Partial("sum")``
    (integer sums included: a partial count is exact)."""
    if call.target is aten.sum.default:
        reduced, keepdim = list(range(call.tensor_args[0].ndim)), False
    else:
        reduced, keepdim = _dims_arg(call)
    strategies = reduction_strategies(call, axis_size, reduced, keepdim, Partial("sum"))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.mean.dim, aten.mean.default)
def mean(call: OpCall, axis_size: int) -> list[Strategy]:
    """Mean over a sharded dim: shards are equal in size, so the mean of the local means is
    the global mean: ``Partial("avg")``. A partial input stays partial of the same kind."""
    if call.target is aten.mean.default:
        reduced, keepdim = list(range(call.tensor_args[0].ndim)), False
    else:
        reduced, keepdim = _dims_arg(call)
    strategies = reduction_strategies(call, axis_size, reduced, keepdim, Partial("avg"))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.amax.default, aten.amin.default, aten.logsumexp.default)
def amax(call: OpCall, axis_size: int) -> list[Strategy]:
    """Non-linear reductions over a dim list: kept dims only."""
    reduced, keepdim = _dims_arg(call)
    return reduction_strategies(call, axis_size, reduced, keepdim)


@register_rule(aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim)
def vector_norm(call: OpCall, axis_size: int) -> list[Strategy]:
    """``‖x‖_p`` over a dim list (Swin-v2's cosine attention, ConvNeXt-v2's response
    normalisation): a root of a sum, so the reduced dims stay whole; kept dims only."""
    x = call.tensor_args[0]
    dims = call.arg(2, "dim")
    reduced = list(range(x.ndim)) if dims is None else normalized_dims(dims, x.ndim)
    return reduction_strategies(call, axis_size, reduced, bool(call.arg(3, "keepdim", False)))


@register_rule(
    aten.var.dim,
    aten.var.correction,
    aten.std.dim,
    aten.std.correction,
    aten.var_mean.dim,
    aten.var_mean.correction,
    aten.std_mean.dim,
    aten.std_mean.correction,
)
def var(call: OpCall, axis_size: int) -> list[Strategy]:
    """Variance/std (and their ``_mean`` pairs): kept dims only."""
    x = call.tensor_args[0]
    dims = normalized_dims(call.arg(1, "dim"), x.ndim)
    if call.target in (aten.var.dim, aten.std.dim, aten.var_mean.dim, aten.std_mean.dim):
        keepdim = bool(call.arg(3, "keepdim", False))
    else:
        keepdim = bool(call.kwargs.get("keepdim", False))
    return reduction_strategies(call, axis_size, dims, keepdim)


@register_rule(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims,
               aten.all.default)
def any_all(call: OpCall, axis_size: int) -> list[Strategy]:
    """Logical reductions: kept dims only (a partial truth value has no placement)."""
    x = call.tensor_args[0]
    dims = call.arg(1, "dim")
    if call.target in (aten.any.default, aten.all.default) or dims is None:
        reduced = list(range(x.ndim))
    else:
        reduced = normalized_dims(dims, x.ndim)
    return reduction_strategies(call, axis_size, reduced, bool(call.arg(2, "keepdim", False)))


@register_rule(aten.max.dim, aten.min.dim)
def max_dim(call: OpCall, axis_size: int) -> list[Strategy]:
    """``max(x, dim)`` -> (values, indices): kept dims only (indices are global)."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return reduction_strategies(call, axis_size, [dim], bool(call.arg(2, "keepdim", False)))


@register_rule(aten.argmax.default, aten.argmin.default)
def argmax(call: OpCall, axis_size: int) -> list[Strategy]:
    """``argmax(x, dim)``: kept dims only; with no dim it reduces everything (replicated)."""
    x = call.tensor_args[0]
    dim = call.arg(1, "dim")
    if dim is None:
        return [replicate_all(call)]
    keepdim = bool(call.arg(2, "keepdim", False))
    return reduction_strategies(call, axis_size, [norm_dim(dim, x.ndim)], keepdim)


@register_rule(aten.topk.default, aten.sort.default, aten.sort.stable)
def topk_sort(call: OpCall, axis_size: int) -> list[Strategy]:
    """``topk``/``sort`` along a dim: that dim stays whole, others keep their shards."""
    x = call.tensor_args[0]
    if call.target is aten.topk.default:
        dim = call.arg(2, "dim", -1)
    elif call.target is aten.sort.default:
        dim = call.arg(1, "dim", -1)
    else:
        dim = call.kwargs.get("dim", -1)
    return reduction_strategies(call, axis_size, [norm_dim(dim, x.ndim)], keepdim=True)
