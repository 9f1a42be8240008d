"""Sharding rules for elementwise ops, and the placement helpers the other rule files share.

An elementwise op computes each output element from the input elements at the same
(broadcast) position, so sharding any output dim and slicing every input the same way is
valid. An input that broadcasts along that dim (absent, or of size 1) stays ``Replicate``:
every device needs all of it. ``Shard(d, groups=k)`` passes through unchanged, because the
local elements still line up position by position.

``Partial`` flows through an op only where the op is linear in the partial inputs:

- ``Partial("sum")`` needs the op to be *linear* in them (``f(a) + f(b) == f(a + b)``):
  ``P + P``, ``P * R``, ``P / R``, ``-P``, float casts, ...
- ``Partial("avg")`` needs only *affine* (the mean of ``f(x_i, r)`` is ``f(mean x_i, r)``),
  so it also survives ``P(avg) + R`` and ``P(avg) + scalar``, where ``P(sum)`` would count
  the replicated term once per device.

The two kinds never meet in one op: a rule offers all-sum or all-avg partial inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from autopar.core.placements import Partial, Placement, Replicate, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, TensorMeta, norm_dim, replicate_all
from autopar.strategies.registry import register_kind_rule, register_rule

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")
PAVG = Partial("avg")


# ----------------------------------------------------------------------------- helpers


def is_float(meta: TensorMeta) -> bool:
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def group_options(call: OpCall, dim: int, ndim: int) -> tuple[int, ...]:
    """The ``groups`` to offer when sharding output dim ``dim``.

    Always 1; on the output's last dim also each ``split_groups`` hint (the number of equal
    chunks a consumer splits that dim into, e.g. 3 for a fused QKV projection).
    """
    if ndim == 0 or dim != ndim - 1:
        return (1,)
    extra = tuple(sorted({int(k) for k in call.hints.get("split_groups", ()) if int(k) > 1}))
    return (1, *extra)


def shard_other_dims(
    call: OpCall, x_shape: tuple[int, ...], dim: int, axis_size: int, n_out: int
) -> list[Strategy]:
    """One input, ``n_out`` outputs, all sharded the same way on any dim but ``dim`` (the
    dim the op works along: softmax's, a split's)."""
    out = []
    for d, size in enumerate(x_shape):
        if d == dim:
            continue
        for g in group_options(call, d, len(x_shape)):
            if can_shard(size, axis_size, g):
                out.append(Strategy((Shard(d, g),), (Shard(d, g),) * n_out))
    return out


def tensor_slot(call: OpCall, index: int, name: str) -> int | None:
    """Position in ``call.tensor_args`` of the argument at ``index`` (or keyword ``name``).

    For a list argument (``cat``'s tensors) this is the position of its first tensor. None
    if the argument is absent or not a tensor. Rules address inputs by slot rather than by
    identity, so an fx node passed twice (``mul(x, x)``) still has two independent inputs.
    """
    count = 0
    for i, a in enumerate(call.args):
        if i == index:
            return count if _n_tensors(a) else None
        count += _n_tensors(a)
    for key, v in call.kwargs.items():
        if key == name:
            return count if _n_tensors(v) else None
        count += _n_tensors(v)
    return None


def _n_tensors(value: object) -> int:
    leaves, _ = tree_flatten(value)
    return sum(isinstance(x, TensorMeta) for x in leaves)


def tensor_arg(call: OpCall, index: int, name: str) -> TensorMeta | None:
    value = call.arg(index, name)
    return value if isinstance(value, TensorMeta) else None


def aligned_dim(meta: TensorMeta, out_shape: Sequence[int], out_dim: int) -> int | None:
    """The dim of ``meta`` that broadcasting lines up with ``out_dim``, or None.

    None means the input does not vary along that dim (absent, or size 1 broadcast), so it
    must stay ``Replicate`` when the output is sharded there.
    """
    d = out_dim - (len(out_shape) - meta.ndim)
    if d < 0 or meta.shape[d] != out_shape[out_dim]:
        return None
    return d


def broadcast_inputs(
    call: OpCall,
    out_shape: Sequence[int],
    out_dim: int,
    groups: int,
    slots: Iterable[int] | None = None,
) -> tuple[Placement, ...]:
    """Inputs for an output sharded on ``out_dim``: aligned inputs sharded, the rest R.

    ``slots`` restricts which tensor inputs take part (default: all of them).
    """
    metas = call.tensor_args
    chosen = set(range(len(metas))) if slots is None else set(slots)
    out: list[Placement] = []
    for i, meta in enumerate(metas):
        d = aligned_dim(meta, out_shape, out_dim) if i in chosen else None
        out.append(R if d is None else Shard(d, groups))
    return tuple(out)


def shard_each_dim(
    call: OpCall,
    axis_size: int,
    out_shape: Sequence[int],
    slots: Iterable[int] | None = None,
    skip: Iterable[int] = (),
) -> list[Strategy]:
    """Elementwise sharding: one strategy per shardable output dim (and groups option).

    Every output gets the same placement, as for multi-output elementwise ops.
    """
    skip = set(skip)
    strategies = []
    n_out = len(call.out)
    for o, size in enumerate(out_shape):
        if o in skip:
            continue
        for g in group_options(call, o, len(out_shape)):
            if not can_shard(size, axis_size, g):
                continue
            ins = broadcast_inputs(call, out_shape, o, g, slots)
            strategies.append(Strategy(ins, (Shard(o, g),) * n_out))
    return strategies


def partial_strategies(
    call: OpCall,
    linear_sets: Iterable[Iterable[int]] = (),
    affine_sets: Iterable[Iterable[int]] = (),
    out_placements: Sequence[Placement | None] | None = None,
) -> list[Strategy]:
    """Strategies with ``Partial`` inputs at the given tensor slots, the rest ``Replicate``.

    Each linear set yields a ``P(sum)`` and a ``P(avg)`` strategy (linear implies affine);
    each affine set only a ``P(avg)`` one. Partial inputs must be floating point, and so
    must every output (a partial bool or index is meaningless). ``out_placements`` may pin
    outputs that do not depend on the partial inputs (``None`` entries take the partial).
    """
    metas = call.tensor_args
    if not call.out or not all(is_float(m) for m in call.out):
        return []
    strategies = []
    wanted = [(frozenset(s), kind) for s in linear_sets for kind in (PSUM, PAVG)]
    wanted += [(frozenset(s), PAVG) for s in affine_sets]
    for slots, kind in dict.fromkeys(wanted):
        if not slots or not all(is_float(metas[i]) for i in slots):
            continue
        ins = tuple(kind if i in slots else R for i in range(len(metas)))
        if out_placements is None:
            outs = (kind,) * len(call.out)
        else:
            outs = tuple(kind if p is None else p for p in out_placements)
        strategies.append(Strategy(ins, outs))
    return strategies


def nonempty_subsets(slots: Sequence[int]) -> list[tuple[int, ...]]:
    return [c for r in range(1, len(slots) + 1) for c in itertools.combinations(slots, r)]


def any_placements(meta: TensorMeta, axis_size: int) -> list[Placement]:
    """Every placement a tensor can have, for inputs an op reads only for dtype/device."""
    out: list[Placement] = [R]
    out += [Shard(d) for d, s in enumerate(meta.shape) if can_shard(s, axis_size)]
    if is_float(meta):
        out += [PSUM, PAVG]
    return out


def present_slots(call: OpCall, positions: Sequence[tuple[int, str]]) -> list[int]:
    slots = (tensor_slot(call, i, name) for i, name in positions)
    return [s for s in slots if s is not None]


# ----------------------------------------------------------------------------- rules


def _elementwise(call: OpCall, axis_size: int) -> list[Strategy]:
    return [replicate_all(call), *shard_each_dim(call, axis_size, call.out[0].shape)]


def is_zero(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


_NONLINEAR = (
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.pow.Scalar,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.exp.default,
    aten.square.default,
    aten.log.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.silu.default,
    aten.gelu.default,
    aten.relu.default,
    aten.hardswish.default,
    aten.sin.default,
    aten.cos.default,
    aten.abs.default,
    aten.erf.default,
    aten.reciprocal.default,
    aten.clamp.default,
    aten.clamp.Tensor,
    aten.minimum.default,
    aten.maximum.default,
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten.floor_divide.default,
    aten.floor_divide.Scalar,
    aten.div.Tensor_mode,
    aten.div.Scalar_mode,
)


@register_rule(*_NONLINEAR)
def nonlinear_pointwise(call: OpCall, axis_size: int) -> list[Strategy]:
    """Elementwise ops that are not linear: shard any dim, never pass a ``Partial``."""
    return _elementwise(call, axis_size)


def _torch_pointwise(op) -> bool:
    """An op torch tags elementwise (with broadcasting), that writes no input and draws no
    random numbers."""
    return (torch.Tag.pointwise in op.tags and not op._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in op.tags)


@register_kind_rule(_torch_pointwise)
def tagged_pointwise(call: OpCall, axis_size: int) -> list[Strategy]:
    """Any other op torch tags pointwise (``hardswish``, ``rsub``, ``erfinv``...): shard any
    dim, as a nonlinear elementwise op (a ``Partial`` never passes)."""
    return _elementwise(call, axis_size)


@register_rule(aten.dropout.default, aten.native_dropout.default)
def dropout(call: OpCall, axis_size: int) -> list[Strategy]:
    """Dropout shards like any elementwise op, but it is random.

    A sharded dropout draws a different mask on each device than a single device would;
    that is fine, the mask is random anyway. A *replicated* dropout must draw the same mask
    on every device, or the replicas silently diverge: the pass must run it under an RNG
    state that is identical across the axis. A ``Partial`` input is not allowed: summing
    ``x_i * mask_i`` with a different mask per device is not ``(sum x_i) * mask``.
    """
    return _elementwise(call, axis_size)


@register_rule(
    aten.add.Tensor,
    aten.add.Scalar,
    aten.sub.Tensor,
    aten.sub.Scalar,
)
def add_sub(call: OpCall, axis_size: int) -> list[Strategy]:
    """``a ± b``: linear in both operands together, affine in each one alone.

    ``P + P -> P`` (sum or avg); ``P(avg) + R -> P(avg)``; ``P(sum) + R`` is wrong (the
    replicated term would be counted once per device), and so is ``P(sum) + scalar``
    unless the scalar is 0.
    """
    slots = present_slots(call, ((0, "self"), (1, "other")))
    other = call.arg(1, "other")
    scalar_ok = isinstance(other, TensorMeta) or is_zero(other)
    linear = [slots] if scalar_ok else []
    return [
        *_elementwise(call, axis_size),
        *partial_strategies(call, linear, nonempty_subsets(slots)),
    ]


@register_rule(aten.mul.Tensor, aten.mul.Scalar)
def mul(call: OpCall, axis_size: int) -> list[Strategy]:
    """``a * b`` is linear in each factor alone: ``P * R -> P`` (never ``P * P``)."""
    slots = present_slots(call, ((0, "self"), (1, "other")))
    return [*_elementwise(call, axis_size), *partial_strategies(call, [[s] for s in slots])]


@register_rule(aten.div.Tensor, aten.div.Scalar)
def div(call: OpCall, axis_size: int) -> list[Strategy]:
    """``a / b`` (true division) is linear in the numerator only: ``P / R -> P``."""
    slots = present_slots(call, ((0, "self"),))
    return [*_elementwise(call, axis_size), *partial_strategies(call, [slots])]


_IDENTITY_LIKE = (
    aten.neg.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
)


@register_rule(*_IDENTITY_LIKE)
def linear_unary(call: OpCall, axis_size: int) -> list[Strategy]:
    """Copies, aliases and negation: linear, so every placement passes through."""
    return [*_elementwise(call, axis_size), *partial_strategies(call, [[0]])]


@register_rule(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)
def cast(call: OpCall, axis_size: int) -> list[Strategy]:
    """Dtype/device casts: placement-preserving; ``Partial`` only float -> float.

    A float cast of a partial sum equals the sum of the casts up to rounding, which is what
    any mixed-precision reduction does; a cast to an integer type truncates each partial
    term separately and is not allowed.
    """
    return [*_elementwise(call, axis_size), *partial_strategies(call, [[0]])]


@register_rule(aten.type_as.default)
def type_as(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.type_as(other)`` reads only ``other``'s dtype, so ``other`` may be placed anyhow."""
    x, other = call.tensor_args
    base = [replicate_all(call), *shard_each_dim(call, axis_size, x.shape, slots=[0])]
    base += partial_strategies(call, [[0]])
    return [
        Strategy((s.inputs[0], p), s.outputs)
        for s in base
        for p in any_placements(other, axis_size)
    ]


@register_rule(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
def where(call: OpCall, axis_size: int) -> list[Strategy]:
    """``where(c, x, y)`` picks ``x`` or ``y`` per element: linear in (x, y) together.

    The condition must be replicated (or sharded like the output) for a partial result.
    A scalar branch is a constant: allowed for ``P(sum)`` only if it is 0.
    """
    branches = present_slots(call, ((1, "self"), (2, "other")))
    values = (call.arg(1, "self"), call.arg(2, "other"))
    scalars = [v for v in values if not isinstance(v, TensorMeta)]
    linear = [branches] if all(is_zero(v) for v in scalars) else []
    return [
        *_elementwise(call, axis_size),
        *partial_strategies(call, linear, nonempty_subsets(branches)),
    ]


@register_rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(call: OpCall, axis_size: int) -> list[Strategy]:
    """``masked_fill(x, mask, v)``: linear in x if v is 0 (or a partial tensor), else affine."""
    value = call.arg(2, "value")
    if isinstance(value, TensorMeta):
        slots = [0, 2]
        linear: list[list[int]] = [slots]
        affine = nonempty_subsets(slots)
    else:
        linear = [[0]] if is_zero(value) else []
        affine = [(0,)]
    return [*_elementwise(call, axis_size), *partial_strategies(call, linear, affine)]


@register_rule(aten._assert_tensor_metadata.default)
def assert_tensor_metadata(call: OpCall, axis_size: int) -> list[Strategy]:
    """A dtype/device/layout check with no output: any placement passes it.

    With an explicit ``size`` or ``stride`` the check compares global numbers, so the
    input must then be whole.
    """
    if call.arg(1, "size") is not None or call.arg(2, "stride") is not None:
        return [replicate_all(call)]
    (meta,) = call.tensor_args
    return [Strategy((p,), ()) for p in any_placements(meta, axis_size)]


def normalized_dims(dims: object, ndim: int) -> list[int]:
    """``dims`` (an int, a list, or None/[] for "all") as sorted non-negative dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({norm_dim(d, ndim) for d in dims})


@register_rule(aten.broadcast_tensors.default)
def broadcast_tensors(call: OpCall, axis_size: int) -> list[Strategy]:
    """Tensors of one shape broadcast to themselves: each dim shards on all of them."""
    shapes = {m.shape for m in call.tensor_args}
    if len(shapes) != 1:
        return [replicate_all(call)]
    (shape,) = shapes
    n_in, n_out = len(call.tensor_args), len(call.out)
    return [replicate_all(call)] + [
        Strategy((Shard(d),) * n_in, (Shard(d),) * n_out)
        for d, size in enumerate(shape) if can_shard(size, axis_size)
    ]
