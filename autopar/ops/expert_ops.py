"""Token dispatch and combine for expert parallelism: the all-to-alls of an MoE layer.

Each rank of an ``ep`` group holds ``experts / ep`` consecutive experts and its own tokens.
Before the experts run, a rank's rows (sorted by expert, ``offs`` the cumulative count per
expert, as a grouped matmul reads them) go to the ranks that own their experts; after, the
results come back in the original order. Sizes differ per rank and per step, so the counts
are exchanged first (one small all-to-all), then the rows (``all_to_all_single`` with
uneven splits). On the owner the rows arrive by source rank, then by expert; they are
reordered expert-major so the local grouped matmul sees each local expert's rows together.

Written by hand: torch has the collective (``all_to_all_single``) but no autograd-aware
token dispatcher; torchtitan and Megatron-Core each carry their own. The backward of each
is the opposite movement (data-parallel gradient convention, :mod:`autopar.ops.comm_ops`).

The route (splits and permutation) travels between dispatch and combine as one int64
tensor, so the rewritten graph stays a graph of tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ops.comm_ops import _group

_ROUTE_HEAD = 2  # route = [k, k, send splits (k), recv splits (k), permutation (rows)]


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def _unpack(route: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    k = int(route[0])
    send = route[_ROUTE_HEAD:_ROUTE_HEAD + k].tolist()
    recv = route[_ROUTE_HEAD + k:_ROUTE_HEAD + 2 * k].tolist()
    return send, recv, route[_ROUTE_HEAD + 2 * k:]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offs, axis: str):
        group, k, _ = _group(axis)
        counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        experts = counts.numel()
        local = experts // k
        per_rank = counts.view(k, local)
        send = per_rank.sum(1).tolist()
        got = torch.empty_like(per_rank)  # row s: source s's counts for my local experts
        dist.all_to_all_single(got, per_rank.contiguous(), group=group)
        recv = got.sum(1).tolist()
        rows = _exchange(x, send, recv, group)
        # arrived as (source, expert); the grouped matmul wants (expert, source)
        starts = torch.cumsum(got.flatten(), 0) - got.flatten()
        starts = starts.view(k, local)
        perm = torch.cat([torch.arange(int(starts[s, j]), int(starts[s, j] + got[s, j]))
                          for j in range(local) for s in range(k)] or
                         [torch.empty(0, dtype=torch.int64)]).to(torch.int64)
        local_offs = torch.cumsum(got.sum(0), 0).to(offs.dtype)
        route = torch.tensor([k, 0, *send, *recv], dtype=torch.int64)
        route = torch.cat([route, perm])
        ctx.axis, ctx.send, ctx.recv, ctx.perm = axis, send, recv, perm
        ctx.mark_non_differentiable(local_offs, route)
        return rows[perm.to(rows.device)], local_offs, route

    @staticmethod
    def backward(ctx, grad, _offs, _route):
        group, _, _ = _group(ctx.axis)
        arrived = torch.empty_like(grad)
        arrived[ctx.perm.to(grad.device)] = grad
        return _exchange(arrived, ctx.recv, ctx.send, group), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, route, axis: str):
        group, _, _ = _group(axis)
        send, recv, perm = _unpack(route)
        ctx.axis, ctx.send, ctx.recv, ctx.perm = axis, send, recv, perm
        arrived = y
        if perm.numel():  # rows came grouped by expert; put them back as they arrived
            arrived = torch.empty_like(y)
            arrived[perm.to(y.device)] = y
        return _exchange(arrived, recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        group, _, _ = _group(ctx.axis)
        rows = _exchange(grad.contiguous(), ctx.send, ctx.recv, group)
        return (rows[ctx.perm.to(rows.device)] if ctx.perm.numel() else rows), None, None


def dispatch(x: torch.Tensor, offs: torch.Tensor, axis: str = "ep"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``x`` sorted by expert (``offs`` cumulative counts over all experts) to the
    ranks of ``axis`` that own their experts: ``(rows for my experts, their cumulative
    counts, route)``. Without a group (one rank) nothing moves."""
    group, k, _ = _group(axis)
    if group is None or k == 1:
        return x, offs, offs.new_zeros(0, dtype=torch.int64)
    return _Dispatch.apply(x, offs, axis)


def combine(y: torch.Tensor, route: torch.Tensor, axis: str = "ep") -> torch.Tensor:
    """The experts' results ``y`` back to the ranks and rows their tokens came from."""
    group, k, _ = _group(axis)
    if group is None or k == 1:
        return y
    return _Combine.apply(y, route, axis)


def _swap(x: torch.Tensor, split_dim: int, cat_dim: int, group, k: int) -> torch.Tensor:
    """Cut ``x`` in ``k`` equal parts along ``split_dim``, send part ``q`` to rank ``q`` of
    ``group``, and join what arrives along ``cat_dim`` (in rank order)."""
    moved = x.movedim(split_dim, 0).contiguous()
    out = torch.empty_like(moved)
    dist.all_to_all_single(out, moved, group=group)
    parts = out.chunk(k, 0)
    return torch.cat([p.movedim(0, split_dim) for p in parts], cat_dim).contiguous()


class _Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim: int, cat_dim: int, axis: str):
        group, k, _ = _group(axis)
        ctx.split_dim, ctx.cat_dim, ctx.axis = split_dim, cat_dim, axis
        return _swap(x, split_dim, cat_dim, group, k)

    @staticmethod
    def backward(ctx, grad):
        group, k, _ = _group(ctx.axis)
        return _swap(grad, ctx.cat_dim, ctx.split_dim, group, k), None, None, None


def dispatch_slots(x: torch.Tensor, expert_dim: int, axis: str = "ep") -> torch.Tensor:
    """Dense (GShard) dispatch: ``x`` holds every expert's capacity slots for this rank's
    sequences (batch first, experts on ``expert_dim``); each rank gets its experts' slots of
    every rank's sequences (batch joined in rank order). Equal splits: one all-to-all."""
    group, k, _ = _group(axis)
    if group is None or k == 1:
        return x
    return _Swap.apply(x, expert_dim, 0, axis)


def combine_slots(y: torch.Tensor, expert_dim: int, axis: str = "ep") -> torch.Tensor:
    """The inverse of :func:`dispatch_slots`: each rank's sequences back, all experts."""
    group, k, _ = _group(axis)
    if group is None or k == 1:
        return y
    return _Swap.apply(y, 0, expert_dim, axis)


class _ToOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner: int, axis: str):
        group, k, rank = _group(axis)
        n = torch.tensor([x.shape[0]], dtype=torch.int64)
        counts = [torch.zeros_like(n) for _ in range(k)]
        dist.all_gather(counts, n, group=group)
        counts = [int(c) for c in counts]
        send = [counts[rank] if q == owner else 0 for q in range(k)]
        recv = counts if rank == owner else [0] * k
        ctx.axis, ctx.send, ctx.recv = axis, send, recv
        route = torch.tensor([k, owner, *send, *recv], dtype=torch.int64)
        ctx.mark_non_differentiable(route)
        return _exchange(x, send, recv, group), route

    @staticmethod
    def backward(ctx, grad, _route):
        group, _, _ = _group(ctx.axis)
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, group), None, None


def to_owner(x: torch.Tensor, owner: int, axis: str = "ep") -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's rows (an expert written as its own module, picked by ``nonzero``): every
    rank's go to rank ``owner`` of ``axis``, which gets them all (in rank order) and the
    others none; and the route back (:func:`combine`)."""
    group, k, _ = _group(axis)
    if group is None or k == 1:
        return x, x.new_zeros(0, dtype=torch.int64)
    return _ToOwner.apply(x, owner, axis)


def no_rows(like: torch.Tensor, features: int) -> torch.Tensor:
    """What an expert this rank does not hold gives for the (zero) rows it got:
    ``(0, features)``, on the autograd path of ``like`` so that this rank joins the
    backward all-to-alls the expert's owner runs."""
    return like.sum(-1, keepdim=True).expand(like.shape[0], features)
