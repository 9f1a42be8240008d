"""Sharding rules for ops that move, slice, join or re-shape data without arithmetic.

These ops are linear (a view of a sum is the sum of the views), so ``Partial`` inputs pass
through them unchanged. A shard survives a re-shape when the sharded dim maps to a dim of
the output whose local slices hold the same elements; the tensor-parallel pass localizes the
explicit sizes of ``view``/``reshape``/``_unsafe_view``/``expand``/``unflatten`` (from the
output's global shape and placement) and the piece sizes of ``split``/``split_with_sizes``
(from the outputs' global shapes and placements). No other argument is localized, so a rule
here never shards a dim that a start/end/index/pad argument refers to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from autopar.core.placements import Placement, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, TensorMeta, norm_dim, replicate_all
from autopar.strategies.pointwise import (
    R,
    aligned_dim,
    group_options,
    normalized_dims,
    partial_strategies,
    shard_each_dim,
    shard_other_dims,
    tensor_slot,
)
from autopar.strategies.registry import register_rule

aten = torch.ops.aten


def _view_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims that hold the same elements.

    Size-1 dims are left out (they are never sharded). ``(B, T, C) -> (B*T, C)`` gives
    ``[([0, 1], [0]), ([2], [1])]``. Empty tensors give no groups.
    """
    ins = [i for i, s in enumerate(in_shape) if s != 1]
    outs = [o for o, s in enumerate(out_shape) if s != 1]
    if any(s == 0 for s in (*in_shape, *out_shape)):
        return []
    groups = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, go = [ins[i]], [outs[j]]
        pi, po = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                go.append(outs[j])
                po *= out_shape[outs[j]]
                j += 1
        groups.append((gi, go))
    return groups


def reshape_strategies(
    call: OpCall, axis_size: int, squeezable: Sequence[int] = ()
) -> list[Strategy]:
    """Every sharding a re-shape of the first input into ``call.out[0]`` preserves.

    Within a group of dims the flat order of elements is unchanged, so sharding the leading
    dim of the input run equals sharding the leading dim of the output run (each device holds
    one contiguous range), with ``groups`` carried along. Two more cases re-interpret a
    leading dim of size ``k`` as ``k`` blocks:

    - input ``(k, a, ...)`` sharded on ``a`` merges into a dim ``Shard(groups=k)``;
    - input ``Shard(d, groups=k)`` split into ``(k, a, ...)`` becomes ``Shard`` on ``a``
      (this is how a fused QKV output ``S(2)g3`` viewed as ``(B, T, 3, H, D)`` becomes
      sharded by heads).

    ``squeezable`` lists input dims a local ``squeeze`` would drop if their local size were 1;
    sharding those down to size 1 is refused.
    """
    x = call.tensor_args[0]
    out_shape = call.out[0].shape
    ins, outs = x.shape, out_shape
    strategies = [replicate_all(call)]

    def add(src: Placement, dst: Placement) -> None:
        if isinstance(src, Shard) and src.dim in squeezable and ins[src.dim] == axis_size:
            return
        strategies.append(Strategy((src,), (dst,)))

    for gi, go in _view_groups(ins, outs):
        li, lo = gi[0], go[0]
        for g in group_options(call, lo, len(outs)):
            if can_shard(ins[li], axis_size, g) and can_shard(outs[lo], axis_size, g):
                add(Shard(li, g), Shard(lo, g))
        k = ins[li]
        if len(gi) > 1 and can_shard(ins[gi[1]], axis_size) and can_shard(outs[lo], axis_size, k):
            add(Shard(gi[1]), Shard(lo, k))
        k = outs[lo]
        if len(go) > 1 and can_shard(outs[go[1]], axis_size) and can_shard(ins[li], axis_size, k):
            add(Shard(li, k), Shard(go[1]))
    strategies += partial_strategies(call, [[0]])
    return strategies


def _keep_other_dims(
    call: OpCall,
    axis_size: int,
    skip: Iterable[int],
    linear: Sequence[Sequence[int]] = ((0,),),
    affine: Sequence[Sequence[int]] = (),
) -> list[Strategy]:
    """Same-rank ops that keep every dim but ``skip`` in place: those keep their shards."""
    out_shape = call.out[0].shape
    return [
        replicate_all(call),
        *shard_each_dim(call, axis_size, out_shape, skip=skip),
        *partial_strategies(call, linear, affine),
    ]


@register_rule(
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.unsqueeze.default,
)
def reshape(call: OpCall, axis_size: int) -> list[Strategy]:
    """Re-shapes: see :func:`reshape_strategies`."""
    return reshape_strategies(call, axis_size)


@register_rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(call: OpCall, axis_size: int) -> list[Strategy]:
    """``squeeze`` re-shapes, but run locally it would also drop a dim whose *local* size is
    1 (a dim of global size ``axis_size`` sharded), so such shards are refused."""
    x = call.tensor_args[0]
    dims = call.arg(1, "dim")
    squeezable = normalized_dims(dims, x.ndim) if x.ndim else []
    return reshape_strategies(call, axis_size, squeezable)


def _permute(call: OpCall, axis_size: int, perm: Sequence[int]) -> list[Strategy]:
    """Output dim ``o`` is input dim ``perm[o]``."""
    x = call.tensor_args[0]
    strategies = [replicate_all(call)]
    for o, d in enumerate(perm):
        for g in group_options(call, o, len(perm)):
            if can_shard(x.shape[d], axis_size, g):
                strategies.append(Strategy((Shard(d, g),), (Shard(o, g),)))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view(call: OpCall, axis_size: int) -> list[Strategy]:
    """Pairs of reals as complex numbers (rotary embeddings by complex products, as
    DeepSeek-V2 and Llama's reference code write them), or back: the last dim of 2 goes or
    comes, every other dim keeps its shard. No partial placements: the ops around it (the
    complex product) offer those where they compute one."""
    x = call.tensor_args[0]
    kept = x.ndim - 1 if call.target is aten.view_as_complex.default else x.ndim
    strategies = [replicate_all(call)]
    for d in range(kept):
        for g in group_options(call, d, call.out[0].ndim):
            if can_shard(x.shape[d], axis_size, g):
                strategies.append(Strategy((Shard(d, g),), (Shard(d, g),)))
    return strategies


@register_rule(aten.permute.default)
def permute(call: OpCall, axis_size: int) -> list[Strategy]:
    x = call.tensor_args[0]
    perm = [norm_dim(d, x.ndim) for d in call.arg(1, "dims")]
    return _permute(call, axis_size, perm)


@register_rule(aten.transpose.int)
def transpose(call: OpCall, axis_size: int) -> list[Strategy]:
    x = call.tensor_args[0]
    perm = list(range(x.ndim))
    if x.ndim:
        a, b = norm_dim(call.arg(1, "dim0"), x.ndim), norm_dim(call.arg(2, "dim1"), x.ndim)
        perm[a], perm[b] = perm[b], perm[a]
    return _permute(call, axis_size, perm)


@register_rule(aten.t.default)
def t(call: OpCall, axis_size: int) -> list[Strategy]:
    x = call.tensor_args[0]
    return _permute(call, axis_size, [1, 0] if x.ndim == 2 else list(range(x.ndim)))


@register_rule(aten.expand.default)
def expand(call: OpCall, axis_size: int) -> list[Strategy]:
    """``expand``: a real dim keeps its shard; a broadcast dim (new, or of size 1) may be
    sharded in the output from a replicated input, because the pass expands to the local
    size and every slice of a broadcast is the same."""
    out_shape = call.out[0].shape
    strategies = [replicate_all(call)]
    for o, size in enumerate(out_shape):
        for g in group_options(call, o, len(out_shape)):
            if can_shard(size, axis_size, g):
                d = aligned_dim(call.tensor_args[0], out_shape, o)
                src: Placement = R if d is None else Shard(d, g)
                strategies.append(Strategy((src,), (Shard(o, g),)))
    return strategies + partial_strategies(call, [[0]])


def _is_full_slice(size: int, start: object, end: object, step: object) -> bool:
    return (
        start in (None, 0)
        and (end is None or (isinstance(end, int) and end >= size))
        and step in (None, 1)
    )


@register_rule(aten.slice.Tensor)
def slice_(call: OpCall, axis_size: int) -> list[Strategy]:
    """``slice`` keeps the shards of the other dims; it may shard the sliced dim only if
    it is a full slice (a no-op there, e.g. ``slice(x, d, 0, INT64_MAX)``): start/end are
    global indices and are not localized."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    full = _is_full_slice(
        x.shape[dim], call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    )
    skip = () if full else (dim,)
    return _keep_other_dims(call, axis_size, skip)


def _dropping_dim(call: OpCall, axis_size: int, dim: int) -> list[Strategy]:
    """Ops whose outputs are the input without dim ``dim`` (select, unbind)."""
    x = call.tensor_args[0]
    n_out = len(call.out)
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        if d == dim:
            continue
        o = d if d < dim else d - 1
        for g in group_options(call, o, x.ndim - 1):
            if can_shard(size, axis_size, g):
                strategies.append(Strategy((Shard(d, g),), (Shard(o, g),) * n_out))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.select.int)
def select(call: OpCall, axis_size: int) -> list[Strategy]:
    """``select(x, d, i)``: ``i`` is a global index, so ``d`` is never sharded."""
    x = call.tensor_args[0]
    return _dropping_dim(call, axis_size, norm_dim(call.arg(1, "dim"), x.ndim))


@register_rule(aten.unbind.int)
def unbind(call: OpCall, axis_size: int) -> list[Strategy]:
    x = call.tensor_args[0]
    return _dropping_dim(call, axis_size, norm_dim(call.arg(1, "dim", 0), x.ndim))


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split(call: OpCall, axis_size: int) -> list[Strategy]:
    """``split``/``split_with_sizes``/``chunk``: other dims keep their shards, and so do
    all pieces. Split along a dim into exactly ``k`` equal pieces, an input
    ``Shard(d, groups=k)`` gives each piece ``Shard(d)``: device ``r`` holds the ``r``-th
    slice of every block, which locally splits into the ``r``-th slice of each piece (the
    fused-QKV case). The pass localizes the piece sizes."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    pieces = [m.shape[dim] for m in call.out]
    k = len(pieces)
    strategies = [replicate_all(call), *shard_other_dims(call, x.shape, dim, axis_size, k)]
    if k > 1 and len(set(pieces)) == 1 and can_shard(pieces[0], axis_size):
        strategies.append(Strategy((Shard(dim, k),), (Shard(dim),) * k))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.cat.default)
def cat(call: OpCall, axis_size: int) -> list[Strategy]:
    """``cat`` keeps a shard of any other dim when every input has it. Joining ``k`` equal
    inputs each ``Shard(d)`` along ``d`` gives ``Shard(d, groups=k)`` (the inverse of
    ``split``). Linear in all inputs together."""
    metas = call.tensor_args
    out_shape = call.out[0].shape
    if any(m.ndim != len(out_shape) for m in metas):  # legacy 1-D empty inputs
        return [replicate_all(call)]
    dim = norm_dim(call.arg(1, "dim", 0), len(out_shape))
    k = len(metas)
    strategies = [replicate_all(call)]
    for d, size in enumerate(out_shape):
        if d == dim:
            continue
        for g in group_options(call, d, len(out_shape)):
            if can_shard(size, axis_size, g):
                strategies.append(Strategy((Shard(d, g),) * k, (Shard(d, g),)))
    sizes = {m.shape[dim] for m in metas}
    if k > 1 and len(sizes) == 1 and can_shard(sizes.pop(), axis_size):
        strategies.append(Strategy((Shard(dim),) * k, (Shard(dim, k),)))
    return strategies + partial_strategies(call, [range(k)])


@register_rule(aten.stack.default)
def stack(call: OpCall, axis_size: int) -> list[Strategy]:
    """``stack`` inserts a new dim; every other dim keeps its shard."""
    metas = call.tensor_args
    out_ndim = call.out[0].ndim
    dim = norm_dim(call.arg(1, "dim", 0), out_ndim)
    k = len(metas)
    strategies = [replicate_all(call)]
    for d, size in enumerate(metas[0].shape):
        o = d if d < dim else d + 1
        for g in group_options(call, o, out_ndim):
            if can_shard(size, axis_size, g):
                strategies.append(Strategy((Shard(d, g),) * k, (Shard(o, g),)))
    return strategies + partial_strategies(call, [range(k)])


def _padded_dims(ndim: int, pad: Sequence[int]) -> set[int]:
    return {ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}


@register_rule(aten.pad.default, aten.constant_pad_nd.default)
def pad(call: OpCall, axis_size: int) -> list[Strategy]:
    """``pad`` forbids sharding a padded dim (the padding belongs at the global edges).

    Padding with zeros (or reflecting/replicating values) is linear; a non-zero constant
    is only affine (allowed for ``P(avg)``)."""
    x = call.tensor_args[0]
    widths = call.arg(1, "pad")
    skip = _padded_dims(x.ndim, widths)
    if call.target is aten.constant_pad_nd.default:
        mode, value = "constant", call.arg(2, "value", 0)
    else:
        mode, value = call.arg(2, "mode", "constant"), call.arg(3, "value")
    linear = mode != "constant" or value in (None, 0)
    return _keep_other_dims(call, axis_size, skip, [[0]] if linear else [], [[0]])


@register_rule(aten.index.Tensor)
def index(call: OpCall, axis_size: int) -> list[Strategy]:
    """Advanced indexing ``x[i0, i1, ...]`` with integer index tensors.

    Either a dim of ``x`` that is not indexed is sharded (indices replicated), or a dim of
    the broadcast index shape is sharded on every index tensor that has it (``x``
    replicated: each device gathers its own rows). Boolean masks give a data-dependent
    shape and stay replicated. Linear in ``x``.
    """
    x = call.tensor_args[0]
    indices = list(call.arg(1, "indices"))
    idx = [(p, m) for p, m in enumerate(indices) if isinstance(m, TensorMeta)]
    if not idx or any(m.dtype in (torch.bool, torch.uint8) for _, m in idx):
        return [replicate_all(call)]
    out_shape = call.out[0].shape
    positions = [p for p, _ in idx]
    bshape = torch.broadcast_shapes(*(torch.Size(m.shape) for _, m in idx))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    first = positions[0] if adjacent else 0
    unindexed = [d for d in range(x.ndim) if d not in positions]
    strategies = [replicate_all(call)]
    n_in = len(call.tensor_args)

    def out_dim_of(d: int) -> int:
        if adjacent:
            return d if d < first else d - len(positions) + len(bshape)
        return len(bshape) + unindexed.index(d)

    for d in unindexed:
        o = out_dim_of(d)
        for g in group_options(call, o, len(out_shape)):
            if can_shard(x.shape[d], axis_size, g):
                strategies.append(Strategy((Shard(d, g),) + (R,) * (n_in - 1), (Shard(o, g),)))
    for j, size in enumerate(bshape):
        o = first + j
        for g in group_options(call, o, len(out_shape)):
            if not can_shard(size, axis_size, g):
                continue
            aligned = (aligned_dim(m, bshape, j) for _, m in idx)
            placed = tuple(R if a is None else Shard(a, g) for a in aligned)
            strategies.append(Strategy((R, *placed), (Shard(o, g),)))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.diff.default)
def diff(call: OpCall, axis_size: int) -> list[Strategy]:
    """``diff`` along ``dim`` needs neighbours, so ``dim`` is never sharded; ``prepend``
    and ``append`` are sharded like the input. Linear in all of them together."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(2, "dim", -1), x.ndim)
    extra = (tensor_slot(call, 3, "prepend"), tensor_slot(call, 4, "append"))
    slots = [0, *(s for s in extra if s is not None)]
    return _keep_other_dims(call, axis_size, (dim,), [slots])


@register_rule(aten.cumsum.default)
def cumsum(call: OpCall, axis_size: int) -> list[Strategy]:
    """A scan: the scanned dim is never sharded (a shard would restart the running sum)."""
    x = call.tensor_args[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return _keep_other_dims(call, axis_size, (dim,))


@register_rule(aten.tril.default, aten.triu.default)
def tril_triu(call: OpCall, axis_size: int) -> list[Strategy]:
    """The triangle is defined on global indices of the last two dims: shard only batch dims."""
    x = call.tensor_args[0]
    skip = range(max(x.ndim - 2, 0), x.ndim)
    return _keep_other_dims(call, axis_size, skip)


@register_rule(aten.repeat.default)
def repeat(call: OpCall, axis_size: int) -> list[Strategy]:
    """``repeat`` tiles; a dim repeated once keeps its shard, a tiled dim cannot."""
    x = call.tensor_args[0]
    repeats = list(call.arg(1, "repeats"))
    lead = len(repeats) - x.ndim
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        o = d + lead
        if repeats[o] != 1:
            continue
        for g in group_options(call, o, len(repeats)):
            if can_shard(size, axis_size, g):
                strategies.append(Strategy((Shard(d, g),), (Shard(o, g),)))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.roll.default)
def roll(call: OpCall, axis_size: int) -> list[Strategy]:
    """Rolled dims wrap around globally and are never sharded; with no ``dims`` the roll is
    over the flattened tensor and nothing can be sharded."""
    x = call.tensor_args[0]
    dims = list(call.arg(2, "dims", []) or [])
    skip = [norm_dim(d, x.ndim) for d in dims] if dims else range(x.ndim)
    return _keep_other_dims(call, axis_size, skip)


@register_rule(aten.flip.default)
def flip(call: OpCall, axis_size: int) -> list[Strategy]:
    """``flip(x, dims)`` reverses ``dims``: those stay whole, every other dim keeps its shard
    (a sample's own row reversed: wav2vec2's padding mask)."""
    x = call.tensor_args[0]
    flipped = normalized_dims(call.arg(1, "dims"), x.ndim)
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        if d not in flipped and can_shard(size, axis_size):
            strategies.append(Strategy((Shard(d),), (Shard(d),)))
    return strategies + partial_strategies(call, [[0]])
