"""Sharding rules for in-place ops: the destination's placement decides.

``x.op_(...)`` computes what ``x.op(...)`` computes and stores it into ``x``. Other nodes
read that storage under other names (the buffer ``x`` is a view of, views of ``x``), as
placed, so the result must keep ``x``'s placement: the strategies of ``op_`` are those of
``op`` whose output placement equals ``x``'s. That one filter is what makes a source that
the destination does not allow impossible: ``R.add_(P(avg))`` would leave a partial result
in a tensor other readers take as whole, so it is not listed, while ``P(avg).add_(R)`` is.
The graph side (a written tensor and its views are never redistributed) is in
:mod:`autopar.strategies.mutation`.

Ops that re-shape ``x`` in place (``unsqueeze_``, ``transpose_``, ...) change the shape
other readers see; they run replicated. In-place ops without an out-of-place rule, and all
others without a rule, run replicated too, which is correct because their destination is
then whole on every device.
"""

from __future__ import annotations

import torch

from autopar.core.strategy import OpCall, Rule, Strategy, replicate_all
from autopar.strategies.pointwise import is_zero, partial_strategies, shard_each_dim
from autopar.strategies.registry import register_rule, registered, rule_for

aten = torch.ops.aten


def in_place(rule: Rule) -> Rule:
    """The rule of ``op_`` from the rule of ``op``: strategies whose output is placed as
    the written tensor (the first input) is."""

    def inplace_rule(call: OpCall, axis_size: int) -> list[Strategy]:
        metas = call.tensor_args
        if not metas or not call.out or call.out[0].shape != metas[0].shape:
            return [replicate_all(call)]
        return [s for s in rule(call, axis_size) if s.outputs[:1] == s.inputs[:1]]

    inplace_rule.__doc__ = f"In-place form of {rule.__name__}: output placed as the input."
    inplace_rule.__name__ = f"{rule.__name__}_inplace"
    return inplace_rule


def _overwrite(call: OpCall, axis_size: int) -> list[Strategy]:
    """The written tensor (slot 0) and everything else placed alike; ``Partial`` when all
    are partial, or when only the destination is ``P(avg)`` (each device writes the same
    whole value, whose mean is itself)."""
    out = call.out[0].shape
    slots = list(range(len(call.tensor_args)))
    return [
        replicate_all(call),
        *shard_each_dim(call, axis_size, out),
        *partial_strategies(call, [slots], [[0]]),
    ]


@register_rule(aten.copy_.default, aten.fill_.Tensor)
def copy_(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.copy_(src)`` / ``x.fill_(value)``: the source (broadcast to ``x``) is placed as
    ``x`` is; a broadcast dim of it stays whole."""
    return _overwrite(call, axis_size)


@register_rule(aten.fill_.Scalar)
def fill_scalar(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.fill_(v)``: any placement of ``x``; ``P(sum)`` only for ``v == 0``."""
    value = call.arg(1, "value")
    linear = [[0]] if is_zero(value) else []
    return [
        replicate_all(call),
        *shard_each_dim(call, axis_size, call.out[0].shape),
        *partial_strategies(call, linear, [[0]]),
    ]


@register_rule(aten.zero_.default)
def zero_(call: OpCall, axis_size: int) -> list[Strategy]:
    """Zeros are zeros in every placement, partial sums included."""
    return [
        replicate_all(call),
        *shard_each_dim(call, axis_size, call.out[0].shape),
        *partial_strategies(call, [[0]]),
    ]


@register_rule(
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.uniform_.default,
    aten.normal_.default,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.random_,  # every overload
)
def random_fill(call: OpCall, axis_size: int) -> list[Strategy]:
    """Random fills shard like dropout (see :func:`autopar.strategies.pointwise.dropout`):
    each device draws its own part; never ``Partial`` (the terms would not sum to one
    draw)."""
    return [replicate_all(call), *shard_each_dim(call, axis_size, call.out[0].shape)]


# In-place ops that re-shape their input: other readers would see the new shape.
_RESHAPING = {"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
              "as_strided_", "resize_", "resize_as_", "set_"}


def register_in_place_forms() -> list[str]:
    """Give every ``op_`` whose ``op`` has a rule (same overload) the filtered rule, unless
    it already has one and takes the same arguments (``pow_.Scalar`` is not
    ``pow.Scalar``). Called once the other rule files are imported; a plugin that
    registers ``op`` later registers ``op_`` itself (with :func:`in_place`)."""
    added = []
    for target, rule in registered().items():
        packet = getattr(target, "overloadpacket", None)
        if packet is None or target.namespace != "aten":
            continue
        name = packet.__name__ + "_"
        inplace = getattr(getattr(aten, name, None), target._overloadname, None)
        if (inplace is None or name in _RESHAPING or rule_for(inplace) is not None
                or _signature(inplace) != _signature(target)):
            continue
        register_rule(inplace)(in_place(rule))
        added.append(str(inplace))
    return added


def _signature(op: object) -> list[str]:
    return [str(a.type) for a in op._schema.arguments]
