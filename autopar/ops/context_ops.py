"""Attention with the sequence sharded over a process group (context parallelism): the op
a rank's program calls in place of each attention site when the plan has ``cp`` > 1
(:func:`context_attention`, bound to the ``cp`` axis like :mod:`autopar.ops.comm_ops`).

All-gathering keys and values is Llama 3's choice, cheap with GQA's few key/value heads.

Each rank holds the queries, keys and values of the positions ``shard_pieces`` gives it
(contiguous, or zigzag for causal balance). An all-gather brings every rank's keys and
values, or the ring brings them one block at a time; ``kernels.ring.block_forward`` folds
this rank's queries against each block at its global position into a running output and
log-sum-exp, skipping blocks the mask hides. Backward brings the blocks again and
``block_backward`` takes each block's share of dQ/dK/dV from the merged output and lse
(FlashAttention's backward), so a layer keeps q, k, v, the output and the lse: what the
memory model prices. dK/dV go home by reduce-scatter, or round the ring with their block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.placements import Shard
from autopar.kernels import shard_pieces
from autopar.kernels.ring import RingMask, block_backward, block_forward
from autopar.ops.comm_ops import _gather, _group, _reduce_scatter, _unzigzag, local_slice


def _gathered(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new dim 0 (an all-gather, outside autograd)."""
    return _gather(x.unsqueeze(0), Shard(0), group, dist.get_world_size(group))


def _layout(q: torch.Tensor, group: dist.ProcessGroup, zigzag: bool) -> tuple[int, list]:
    """This rank's index on ``group`` and every rank's pieces of the global sequence."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    return rank, [shard_pieces(q.shape[2] * n, n, r, zigzag=zigzag) for r in range(n)]


def _keep_for_backward(ctx, q, k, v, running, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep q, k, v and the merged (output, lse) for the recomputing backward; return them."""
    out, lse = running
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = args
    ctx.set_materialize_grads(False)
    return out.to(q.dtype), lse


class _AllGatherAttention(torch.autograd.Function):
    """Forward gathers K/V and folds in every block; backward gathers them again (the
    gathered copy is not kept between the passes), takes each block's share of the
    gradients, and reduce-scatters dK/dV to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag: bool, mask: RingMask):
        rank, pieces = _layout(q, group, zigzag)
        cp = len(pieces)
        keys, values = _gathered(k, group), _gathered(v, group)
        running = None
        for r in [(rank - step) % cp for step in range(cp)]:  # its own block first
            running = block_forward(q, pieces[rank], keys[r], values[r], pieces[r], running,
                                    mask)
        return _keep_for_backward(ctx, q, k, v, running, (group, pieces, rank, mask))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, pieces, rank, mask = ctx.args
        keys, values = _gathered(k, group), _gathered(v, group)
        dout = torch.zeros_like(q) if dout is None else dout
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkeys = torch.empty(keys.shape, dtype=torch.float32, device=k.device)
        dvalues = torch.empty(values.shape, dtype=torch.float32, device=v.device)
        for r in range(len(pieces)):
            gq, dkeys[r], dvalues[r] = block_backward(q, pieces[rank], keys[r], values[r],
                                                      pieces[r], out, lse, dout, dlse, mask)
            dq += gq
        n = len(pieces)
        dk = _reduce_scatter(dkeys, Shard(0), group, n, rank).squeeze(0)
        dv = _reduce_scatter(dvalues, Shard(0), group, n, rank).squeeze(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def all_gather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            group: dist.ProcessGroup | None = None, *, zigzag: bool = False,
                            causal: bool = False, window: tuple[int, int] | None = None,
                            scale: float | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and log-sum-exp for its sequence shard ``q`` (batch,
    heads, local_len, head_dim), against the keys and values of every rank of ``group``."""
    mask = RingMask(causal, None if window is None else tuple(window), scale, softcap)
    return _AllGatherAttention.apply(q, k, v, group, zigzag, mask)


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Every rank's ``x`` moved ``step`` places along the ring (one send and one receive)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    to = dist.get_global_rank(group, (rank + step) % n)
    source = dist.get_global_rank(group, (rank - step) % n)
    ops = [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, source, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _RingAttention(torch.autograd.Function):
    """Ring attention. Forward: ``cp - 1`` shifts pass each rank's K/V to the next rank and
    the queries fold in each block as it arrives. Backward: the blocks go round again, each
    carrying its dK/dV accumulator, to which every rank adds its share; after ``cp`` shifts
    the accumulators are home. A rank holds one visiting block at a time, never all."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag: bool, mask: RingMask):
        rank, pieces = _layout(q, group, zigzag)
        n = len(pieces)
        running, key, value = None, k, v
        for step in range(n):
            running = block_forward(q, pieces[rank], key, value, pieces[(rank - step) % n],
                                    running, mask)
            if step < n - 1:
                key, value = _shift(key, group, +1), _shift(value, group, +1)
        return _keep_for_backward(ctx, q, k, v, running, (group, pieces, rank, mask))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, pieces, rank, mask = ctx.args
        n = len(pieces)
        dout = torch.zeros_like(q) if dout is None else dout
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        key, value = k, v
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(n):
            gq, gk, gv = block_backward(q, pieces[rank], key, value, pieces[(rank - step) % n],
                                        out, lse, dout, dlse, mask)
            dq += gq
            dk, dv = _shift(dk + gk, group, +1), _shift(dv + gv, group, +1)
            if step < n - 1:
                key, value = _shift(key, group, +1), _shift(value, group, +1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup, *, zigzag: bool = False, causal: bool = False,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention over ``group`` (see :class:`_RingAttention`): p2p with the two
    neighbours only, one visiting block held at a time in both passes."""
    mask = RingMask(causal, None, scale, None)
    return _RingAttention.apply(q, k, v, group, zigzag, mask)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, src: int, src_zigzag: bool,
              dst: int, dst_zigzag: bool) -> torch.Tensor:
    """All-to-all: ``x`` split along ``src`` (zigzag pairs if ``src_zigzag``) becomes split
    along ``dst``: each rank sends every other rank the part of ``dst`` it owns, and joins
    what it receives along ``src`` in global order. 1/cp of the tensor crosses per peer."""
    n = dist.get_world_size(group)
    pieces = [local_slice(x, Shard(dst), n, r, dst_zigzag).contiguous() for r in range(n)]
    send = torch.cat([p.reshape(-1) for p in pieces])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    shape = pieces[0].shape
    parts = [chunk.view(shape) for chunk in recv.chunk(n)]
    if src_zigzag:
        return _unzigzag(parts, src, n)
    return torch.cat(parts, src)


class _SwapSplit(torch.autograd.Function):
    """Ulysses' exchange between a split sequence and split heads (:func:`_exchange`); its
    backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, x, group, src: int, src_zigzag: bool, dst: int, dst_zigzag: bool):
        ctx.args = (group, src, src_zigzag, dst, dst_zigzag)
        return _exchange(x, group, src, src_zigzag, dst, dst_zigzag)

    @staticmethod
    def backward(ctx, grad):
        group, src, src_zigzag, dst, dst_zigzag = ctx.args
        return (_exchange(grad.contiguous(), group, dst, dst_zigzag, src, src_zigzag),
                None, None, None, None, None)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup, *, zigzag: bool = False, causal: bool = False,
                      scale: float | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses: q, k, v go from a split sequence to split heads (every rank then
    holds whole sequences of heads / cp, in order), attention runs unsplit, and the output
    goes back, each exchange one all-to-all."""
    from autopar.kernels import attention

    heads = [_SwapSplit.apply(t, group, 2, zigzag, 1, False) for t in (q, k, v)]
    out = attention(*heads, causal=causal, scale=scale)
    return _SwapSplit.apply(out, group, 1, False, 2, zigzag)


def masked_all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 bias: torch.Tensor, *, scale: float | None = None
                                 ) -> torch.Tensor:
    """Attention of this rank's queries to the keys and values of every rank of ``cp``,
    with this rank's rows of a mask or bias over (queries, keys): keys and values gathered
    whole in sequence order (their gradients reduce-scattered back), then one kernel call.
    A padded batch's mask is arbitrary, so it does not travel block by block as a ring's
    causal flag does."""
    from autopar.kernels import attention
    from autopar.ops.comm_ops import redistribute

    keys, values = (redistribute(t, "cp", "S(2)", "R") for t in (k, v))
    return attention(q, keys, values, bias=bias, scale=scale)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      algorithm: str, zigzag: bool, causal: bool = False,
                      scale: float | None = None, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """This rank's attention output for its tokens ``q``/``k``/``v`` (batch, heads,
    local_len, head_dim) under the plan's cp ``algorithm``, on the group bound to ``cp``;
    ``bias``: this rank's query rows of a mask (``all_gather`` only)."""
    group, n, _ = _group("cp")
    if group is None or n == 1:
        from autopar.kernels import attention

        return attention(q, k, v, causal=causal, scale=scale, bias=bias)
    if bias is not None:
        return masked_all_gather_attention(q, k, v, bias, scale=scale)
    if algorithm == "ulysses":
        return ulysses_attention(q, k, v, group, zigzag=zigzag, causal=causal, scale=scale)
    run = ring_kv_attention if algorithm == "ring" else all_gather_kv_attention
    out, _ = run(q, k, v, group, zigzag=zigzag, causal=causal, scale=scale)
    return out

