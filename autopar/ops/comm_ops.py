"""Autograd-aware collectives on named mesh axes: the ops the rewritten graph calls.

The tensor-parallel pass inserts calls such as ``redistribute(x, 'tp', 'P', 'R')`` between
nodes whose placements differ; the runtime binds each axis name to a process group once
(:func:`bind_axis_groups`). Written by hand because the rewritten graph computes on plain
local tensors with the Megatron gradient convention (DTensor keeps placements at runtime and
would need a from_local/to_local pair with explicit gradient placements at every edge):

- on ``tp`` the gradient of a replicated tensor is whole on every device, so ``S -> R`` is an
  all-gather whose backward is a local slice, ``P -> R`` an all-reduce whose backward is the
  identity, and a replicated tensor read by sharded computation passes through
  :func:`grad_all_reduce` (Megatron's "f": identity forward, all-reduce backward);
- on ``dp`` each device's backward computes the gradient of the sum of every device's loss
  term along its own tensors (DDP/FSDP average them afterwards), so ``S -> R`` backward is
  a reduce-scatter, ``R -> S`` backward a zero-pad and ``P -> R`` (a batch statistic made
  whole) an all-reduce;
  ``cp`` (context parallelism: each device holds some tokens of every sequence) is such an
  axis too.

An axis bound ``zigzag`` cuts each sharded block into ``2n`` chunks and gives device ``i``
chunks ``i`` and ``2n - 1 - i`` (context parallelism's causal balance), where other axes
give device ``i`` the ``i``-th of ``n`` pieces.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

from autopar.core.placements import Partial, Placement, Replicate, Shard, parse_placement

_GROUPS: dict[str, dist.ProcessGroup] = {}
_ZIGZAG: set[str] = set()  # axes whose shards are zigzag chunk pairs
DATA_AXES = ("dp", "cp")


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; the GPU
# machines may carry an older torch that only has the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def bind_axis_groups(groups: Mapping[str, dist.ProcessGroup], zigzag: tuple[str, ...] = ()
                     ) -> None:
    """Tell the collectives which process group each mesh axis name means, and which axes
    shard in zigzag chunk pairs."""
    _GROUPS.clear()
    _GROUPS.update(groups)
    _ZIGZAG.clear()
    _ZIGZAG.update(zigzag)


def _group(axis: str) -> tuple[dist.ProcessGroup | None, int, int]:
    group = _GROUPS.get(axis)
    if group is None:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


# --- building blocks on local tensors ------------------------------------------------------
def _blocks(x: torch.Tensor, dim: int, groups: int) -> list[torch.Tensor]:
    return list(x.chunk(groups, dim)) if groups > 1 else [x]


def _piece(block: torch.Tensor, dim: int, n: int, rank: int, zigzag: bool) -> torch.Tensor:
    if not zigzag:
        return block.chunk(n, dim)[rank]
    chunks = block.chunk(2 * n, dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim)


def local_slice(x: torch.Tensor, p: Shard, n: int, rank: int, zigzag: bool = False
                ) -> torch.Tensor:
    """This device's part of a whole tensor (split-then-shard for groups > 1; ``zigzag``:
    chunks ``rank`` and ``2n - 1 - rank`` of ``2n``).

    >>> local_slice(torch.arange(6), Shard(0, groups=3), 2, 1).tolist()
    [1, 3, 5]
    >>> local_slice(torch.arange(8), Shard(0), 2, 0, zigzag=True).tolist()
    [0, 1, 6, 7]
    """
    return torch.cat([_piece(b, p.dim, n, rank, zigzag) for b in _blocks(x, p.dim, p.groups)],
                     p.dim)


def _unzigzag(parts: list[torch.Tensor], dim: int, n: int) -> torch.Tensor:
    """The whole block from every device's zigzag pair (in rank order)."""
    halves = [t.chunk(2, dim) for t in parts]
    return torch.cat([halves[c][0] if c < n else halves[2 * n - 1 - c][1]
                      for c in range(2 * n)], dim)


def _gather(x: torch.Tensor, p: Shard, group: dist.ProcessGroup, n: int,
            zigzag: bool = False) -> torch.Tensor:
    x = x.contiguous()
    if zigzag:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        per_rank = [_blocks(t, p.dim, p.groups) for t in parts]
        return torch.cat([_unzigzag([r[j] for r in per_rank], p.dim, n)
                          for j in range(p.groups)], p.dim)
    if p.dim == 0 and p.groups == 1:
        # Straight into one buffer: no per-rank parts to concatenate (half the peak memory).
        out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
        _all_gather_single(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    if p.groups == 1:
        return torch.cat(parts, p.dim)
    per_rank = [_blocks(t, p.dim, p.groups) for t in parts]
    return torch.cat([torch.cat([r[j] for r in per_rank], p.dim) for j in range(p.groups)], p.dim)


def _all_to_all(x: torch.Tensor, src: Shard, dst: Shard, group, n: int) -> torch.Tensor:
    """``S(src.dim) -> S(dst.dim)``: each device sends the ``dst``-chunks of its part to the
    devices that own them and joins what it receives along ``src.dim``: 1/n of the tensor
    crosses the link, against a whole tensor for gather-then-slice."""
    chunks = [c.contiguous() for c in x.chunk(n, dst.dim)]
    send = torch.cat([c.reshape(-1) for c in chunks])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    shape = chunks[0].shape
    return torch.cat([piece.view(shape) for piece in recv.chunk(n)], src.dim)


def all_reduce_in_place(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum each tensor over ``group``, in place, with one collective for all of them."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, p: Shard, group, n: int, rank: int,
                    zigzag: bool = False) -> torch.Tensor:
    # Sum the whole tensor, keep this device's part. (gloo's reduce_scatter needs equal
    # contiguous chunks along dim 0; the all-reduce route works for any dim and groups.)
    return local_slice(_all_reduce(x, group), p, n, rank, zigzag)


def _zero_pad(x: torch.Tensor, p: Shard, n: int, rank: int, full: torch.Size,
              zigzag: bool = False) -> torch.Tensor:
    out = x.new_zeros(full)
    blocks_out = _blocks(out, p.dim, p.groups)
    blocks_in = _blocks(x, p.dim, p.groups)
    for bo, bi in zip(blocks_out, blocks_in):
        if zigzag:
            half = bi.shape[p.dim] // 2
            for c, part in ((rank, 0), (2 * n - 1 - rank, 1)):
                bo.narrow(p.dim, c * half, half).copy_(bi.narrow(p.dim, part * half, half))
        else:
            bo.narrow(p.dim, rank * bi.shape[p.dim], bi.shape[p.dim]).copy_(bi)
    return out


# --- autograd functions --------------------------------------------------------------------
def _is_avg(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce == "avg"


class _Redistribute(torch.autograd.Function):
    """Placement change on one axis. Forward goes through the whole value (``src`` ->
    whole -> ``dst``) with the cheapest collective for the pair; backward maps the incoming
    gradient the same way in reverse, under the per-placement gradient convention: whole for
    R and P(sum), g/n on every device for P(avg), the local slice for S."""

    @staticmethod
    def forward(ctx, x, axis: str, src: Placement, dst: Placement):
        group, n, rank = _group(axis)
        zz = axis in _ZIGZAG
        ctx.axis, ctx.src, ctx.dst, ctx.shape = axis, src, dst, x.shape
        if group is None or src == dst:
            return x.view_as(x)
        if isinstance(src, Partial) and isinstance(dst, Partial):  # sum <-> avg, locally
            return x * n if _is_avg(dst) else x / n
        if isinstance(src, Partial) and isinstance(dst, Shard):
            # shares of a mean are divided before they are summed: a mask's float-min
            # entries would overflow to -inf summed first
            return _reduce_scatter(x / n if _is_avg(src) else x, dst, group, n, rank, zz)
        if (isinstance(src, Shard) and isinstance(dst, Shard) and src.groups == dst.groups == 1
                and not zz):
            return _all_to_all(x, src, dst, group, n)
        if isinstance(src, Shard):
            whole = _gather(x, src, group, n, zz)
        elif isinstance(src, Partial):
            # shares of a mean divided first (no overflow); a sum stays in its dtype (an
            # integer count stays one)
            whole = _all_reduce(x / n if _is_avg(src) else x, group)
        else:
            whole = x
        if isinstance(dst, Shard):
            return local_slice(whole, dst, n, rank, zz).contiguous()
        if isinstance(dst, Partial) and not _is_avg(dst):
            return whole.clone() if rank == 0 else torch.zeros_like(whole)
        return whole if whole is not x else x.clone()

    @staticmethod
    def backward(ctx, grad):
        group, n, rank = _group(ctx.axis)
        zz = ctx.axis in _ZIGZAG
        src, dst = ctx.src, ctx.dst
        none = (None, None, None)
        if group is None or src == dst:
            return (grad, *none)
        if ctx.axis in DATA_AXES:
            # Each device holds the gradient of its own loss term (DDP/FSDP average later).
            if isinstance(src, Shard) and isinstance(dst, Replicate):
                return (_reduce_scatter(grad, src, group, n, rank, zz), *none)
            if isinstance(src, Replicate) and isinstance(dst, Shard):
                return (_zero_pad(grad, dst, n, rank, ctx.shape, zz), *none)
            if isinstance(src, Partial) and isinstance(dst, Replicate):
                # every device's loss term read the reduced value, and this device's part
                # of it fed them all: the gradient of the sum of their terms
                whole = _all_reduce(grad.contiguous(), group)
                return (whole / n if _is_avg(src) else whole, *none)
        if (isinstance(src, Shard) and isinstance(dst, Shard) and src.groups == dst.groups == 1
                and not zz):
            return (_all_to_all(grad.contiguous(), dst, src, group, n), *none)
        if isinstance(dst, Shard):
            whole = _gather(grad, dst, group, n, zz)
        else:
            whole = grad * n if _is_avg(dst) else grad
        if isinstance(src, Shard):
            return (local_slice(whole, src, n, rank, zz).contiguous(), *none)
        return (whole / n if _is_avg(src) else whole, *none)


class _Deferred:
    """Weights whose partial gradients wait for one bucketed all-reduce per step."""

    def __init__(self) -> None:
        self.active = False
        self.params: dict[int, tuple[torch.Tensor, str]] = {}


_DEFERRED = _Deferred()


class _GradAllReduce(torch.autograd.Function):
    """Megatron's "f": identity forward; the partial gradients of sharded consumers are
    summed in backward. For a weight (``deferrable``) inside :func:`deferred_weight_grads`,
    the sum waits for the end of the step, when one all-reduce covers every such weight
    (Megatron does the same for sequence-parallel LayerNorm weights)."""

    @staticmethod
    def forward(ctx, x, axis: str, deferrable: bool = False):
        ctx.axis = axis
        ctx.param = x if deferrable else None
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        group, _, _ = _group(ctx.axis)
        if group is None:
            return grad, None, None
        if ctx.param is not None and _DEFERRED.active:
            _DEFERRED.params[id(ctx.param)] = (ctx.param, ctx.axis)
            return grad, None, None
        return _all_reduce(grad, group), None, None


class deferred_weight_grads:
    """Within it, weights' partial gradients on a tensor-parallel axis accumulate locally;
    on exit (after the last microbatch's backward) one flattened all-reduce per axis sums
    them. Summing once after accumulation is exact: the sum is linear."""

    def __enter__(self):
        _DEFERRED.active = True
        _DEFERRED.params.clear()
        return self

    def __exit__(self, *exc) -> bool:
        _DEFERRED.active = False
        pending = list(_DEFERRED.params.values())
        _DEFERRED.params.clear()
        if exc[0] is not None or not pending:
            return False
        by_axis: dict[str, list[torch.Tensor]] = {}
        for param, axis in pending:
            if param.grad is not None:
                by_axis.setdefault(axis, []).append(param.grad)
        for axis, grads in by_axis.items():
            all_reduce_in_place(grads, _group(axis)[0])
        return False


class _GatherScatterGrad(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward: a gathered tensor read only by sharded
    computation (sequence parallelism's entry into a column-parallel matmul)."""

    @staticmethod
    def forward(ctx, x, axis: str, src: Shard):
        group, n, _ = _group(axis)
        ctx.axis, ctx.src = axis, src
        if group is None:
            return x.view_as(x)
        out = _gather(x, src, group, n)
        out._autopar_shard = (x.detach(), axis, src)  # see keep_gathered_as_shards
        return out

    @staticmethod
    def backward(ctx, grad):
        group, n, rank = _group(ctx.axis)
        if group is None:
            return grad, None, None
        return _reduce_scatter(grad, ctx.src, group, n, rank), None, None


def _pack(t: torch.Tensor):
    base = t._base if t._base is not None else t
    info = getattr(base, "_autopar_shard", None)
    if info is None:
        return t
    shard, axis, src = info
    return ("autopar-gathered", shard, axis, src, t.size(), t.stride(), t.storage_offset())


def _unpack(packed):
    if isinstance(packed, tuple) and packed and packed[0] == "autopar-gathered":
        _, shard, axis, src, size, stride, offset = packed
        group, n, _ = _group(axis)
        with torch.no_grad():
            whole = _gather(shard, src, group, n)
        return whole.as_strided(size, stride, offset)
    return packed


def keep_gathered_as_shards():
    """While active, a tensor gathered by :func:`gather_scatter_grad` that autograd saves
    for backward is kept as this device's shard and gathered again when backward needs it:
    sequence parallelism's memory saving (Korthikanti et al.) at the cost of one more
    all-gather."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


# --- what the graph calls ------------------------------------------------------------------
def redistribute(x: torch.Tensor, axis: str, src: str, dst: str) -> torch.Tensor:
    """Change ``x``'s placement on mesh ``axis`` from ``src`` to ``dst`` (e.g. 'P' -> 'R')."""
    return _Redistribute.apply(x, axis, parse_placement(src), parse_placement(dst))


_OUTPUTS_UNUSED: ContextVar[bool] = ContextVar("outputs_unused", default=False)


@contextmanager
def outputs_unused() -> Iterator[None]:
    """Within it, :func:`redistribute_output` hands its input back as it is: a training
    step reads only the loss, so the other outputs (an LM's logits, gigabytes at scale) are
    not made whole for a caller who drops them. Every rank of a step enters it alike (the
    collectives it skips are skipped everywhere)."""
    token = _OUTPUTS_UNUSED.set(True)
    try:
        yield
    finally:
        _OUTPUTS_UNUSED.reset(token)


def redistribute_output(x: torch.Tensor, axis: str, src: str, dst: str) -> torch.Tensor:
    """:func:`redistribute` of a graph output the caller reads, which a training step does
    not (:func:`outputs_unused`): there the local part, unchanged."""
    if _OUTPUTS_UNUSED.get():
        return x
    return redistribute(x, axis, src, dst)


def grad_all_reduce(x: torch.Tensor, axis: str, deferrable: bool = False) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``axis`` in backward (for a weight,
    ``deferrable``: at the end of the step when :class:`deferred_weight_grads` is on)."""
    return _GradAllReduce.apply(x, axis, deferrable)


def gather_scatter_grad(x: torch.Tensor, axis: str, src: str) -> torch.Tensor:
    """All-gather ``x`` (placement ``src``) forward; reduce-scatter its gradient backward."""
    placement = parse_placement(src)
    assert isinstance(placement, Shard)
    return _GatherScatterGrad.apply(x, axis, placement)


def axis_rank(axis: str) -> int:
    """This device's index on ``axis`` (0 when the axis is not bound)."""
    return _group(axis)[2]
