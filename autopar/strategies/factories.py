"""Sharding rules for tensor factories: arange, zeros, ones, full, empty, scalar_tensor, the
``new_*`` methods and the ``*_like`` functions.

A factory of a constant (``zeros``, ``ones``, ``full``, ``empty`` and their ``new_*``
forms) may come out in any placement: every slice of a constant is that constant, so the
tensor-parallel pass only makes the size argument local (passes/localize_shapes.py). It
matters for buffers that are then written in place (``buf = x.new_zeros(...);
buf[:, 1:] = y``): the buffer must be placed as what is written into it. A partial
constant needs its terms to add up (or average) to it: zeros in any partial, ``ones`` and
``full`` as ``P(avg)`` (and ``full(0)`` as a sum). ``arange`` and ``scalar_tensor`` (whose
values depend on global positions, or which have no dim) and the ``*_strided`` forms
(global strides) stay whole.

The ``new_*`` methods read their input only for dtype and device, so that input may have
any placement. The ``*_like`` functions take their shape from the input, so a sharded
input gives the output sharded the same way; a ``Partial`` input still has the global shape
locally, so the output is then whole (``Replicate``).
"""

from __future__ import annotations

import torch

from autopar.core.placements import Partial, Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, replicate_all
from autopar.strategies.pointwise import PAVG, PSUM, R, any_placements, group_options, is_zero
from autopar.strategies.registry import register_rule

aten = torch.ops.aten

_ZEROS = (aten.zeros.default, aten.new_zeros.default, aten.empty.memory_format,
          aten.new_empty.default)
_FILLED = {aten.full.default: 1, aten.new_full.default: 2}  # op -> position of the value
_CONSTANT = (*_ZEROS, *_FILLED, aten.ones.default, aten.new_ones.default)


def makes_constant(target: object) -> bool:
    """Does ``target`` make a constant tensor (whose placement no data flow implies)?"""
    return target in _CONSTANT


def constant_placements(call: OpCall, axis_size: int) -> list[Placement]:
    """Every placement the constant ``call`` makes can have (see the module docstring)."""
    out_meta = call.out[0]
    if call.target not in _CONSTANT:
        return [R]
    out: list[Placement] = [R]
    out += [Shard(d) for d, size in enumerate(out_meta.shape) if can_shard(size, axis_size)]
    if out_meta.dtype.is_floating_point:
        value = call.arg(_FILLED[call.target], "fill_value") if call.target in _FILLED else 1
        zero = call.target in _ZEROS or is_zero(value)
        out += [PSUM, PAVG] if zero else [PAVG]
    return out


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
    """No tensor input: a constant in any placement, anything else whole."""
    return [Strategy((), (p,)) for p in constant_placements(call, axis_size)]


@register_rule(
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.new_*(size)``: made from the global size, whatever ``x``'s placement."""
    (x,) = call.tensor_args
    outs = constant_placements(call, axis_size)
    return [Strategy((p,), (q,)) for q in outs for p in any_placements(x, axis_size)]


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
