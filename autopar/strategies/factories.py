"""Sharding rules for tensor factories: arange, zeros, ones, full, empty, scalar_tensor, the
``new_*`` methods and the ``*_like`` functions.

A factory with a global size argument makes the same whole tensor on every device:
``Replicate``. The ``new_*`` methods read their input only for dtype and device, so that
input may have any placement. The ``*_like`` functions take their shape from the input, so
a sharded input gives the output sharded the same way; a ``Partial`` input still has the
global shape locally, so the output is then whole (``Replicate``). Uninitialized outputs
(``empty``) are "replicated" in the sense that no device's values matter.
"""

from __future__ import annotations

import torch

from autopar.placements import Partial, Placement, Shard
from autopar.strategies.pointwise import R, any_placements, group_options
from autopar.strategies.registry import register_rule
from autopar.strategies.rule import OpCall, Strategy, replicate_all

aten = torch.ops.aten


@register_rule(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.scalar_tensor.default,
)
def factory(call: OpCall, axis_size: int) -> list[Strategy]:
    """No tensor input: the output is made whole on every device."""
    return [replicate_all(call)]


@register_rule(
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.new_*(size)``: a whole tensor of the global size, whatever ``x``'s placement."""
    (x,) = call.tensor_args
    return [Strategy((p,), (R,)) for p in any_placements(x, axis_size)]


@register_rule(
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
)
def like_factory(call: OpCall, axis_size: int) -> list[Strategy]:
    """``*_like(x)``: shaped like the local ``x``, so sharded as ``x`` is."""
    (x,) = call.tensor_args
    strategies = [replicate_all(call)]
    for p in any_placements(x, axis_size):
        if isinstance(p, Partial):
            strategies.append(Strategy((p,), (R,)))
        elif isinstance(p, Shard):
            for g in group_options(call, p.dim, x.ndim):
                if x.shape[p.dim] % (axis_size * g) == 0:
                    q: Placement = Shard(p.dim, g)
                    strategies.append(Strategy((q,), (q,)))
    return strategies
