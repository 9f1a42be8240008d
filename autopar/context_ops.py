"""Attention with the sequence sharded over a process group (context parallelism): the op
a rank's program calls in place of each attention site when the plan has ``cp`` > 1
(:func:`context_attention`, bound to the ``cp`` axis like :mod:`autopar.comm_ops`).

All-gathering keys and values is Llama 3's choice, cheap with GQA's few key/value heads.

Each rank holds the queries, keys and values of the positions ``shard_pieces`` gives it
(contiguous, or zigzag for causal balance). An all-gather brings every rank's keys and
values; its backward returns each block's dK and dV, summed over the ranks that read it, to
the rank that owns it (``comm_ops``'s reduce-scatter).
``ring_attention_shard`` then runs this rank's queries against every block at its global
position, skipping blocks the mask hides. The same shard function serves the ring algorithm,
where the blocks arrive one by one instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.comm_ops import _gather, _group, _reduce_scatter, _unzigzag, local_slice
from autopar.kernels import ring_attention_shard, shard_pieces
from autopar.placements import Shard


class _GatherBlocks(torch.autograd.Function):
    """Every rank's ``x`` stacked along a new dim 0 (all-gather); backward: the summed
    gradient of this rank's block (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather(x.unsqueeze(0), Shard(0), group, dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return _reduce_scatter(grad, Shard(0), ctx.group, n, rank).squeeze(0), None


def all_gather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            group: dist.ProcessGroup | None = None, *, zigzag: bool = False,
                            causal: bool = False, window: tuple[int, int] | None = None,
                            scale: float | None = None,
                            alibi_slopes: torch.Tensor | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and log-sum-exp for its sequence shard ``q`` (batch,
    heads, local_len, head_dim), against the keys and values of every rank of ``group``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [shard_pieces(q.shape[2] * cp, cp, r, zigzag=zigzag) for r in range(cp)]
    keys = _GatherBlocks.apply(k, group)
    values = _GatherBlocks.apply(v, group)
    order = [(rank - step) % cp for step in range(cp)]  # its own block first, as a ring
    blocks = [(keys[r], values[r], pieces[r]) for r in order]
    return ring_attention_shard(q, pieces[rank], blocks, causal=causal, window=window,
                                scale=scale, alibi_slopes=alibi_slopes, softcap=softcap)


class _RingPass(torch.autograd.Function):
    """Send ``x`` to the next rank of the ring and receive the previous rank's; backward
    sends the gradient the other way (a visiting block's dK/dV travel back to its owner)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, -1), None


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


def ring_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup, *, zigzag: bool = False, causal: bool = False,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention: ``cp - 1`` steps pass each rank's keys and values to the next rank;
    this rank's queries meet every block as it arrives (``ring_attention_shard``, merged by
    log-sum-exp); backward returns each block's dK/dV around the ring to its owner.

    The visiting blocks are kept for backward, as all-gather keeps its gathered copy: the
    communication is the ring's (p2p with the neighbours only), the memory is not yet its
    (a block recomputed in backward's own ring pass would be)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [shard_pieces(q.shape[2] * n, n, r, zigzag=zigzag) for r in range(n)]
    blocks, key, value = [], k, v
    for step in range(n):
        blocks.append((key, value, pieces[(rank - step) % n]))
        if step < n - 1:
            key, value = _RingPass.apply(key, group), _RingPass.apply(value, group)
    out, lse = ring_attention_shard(q, pieces[rank], blocks, causal=causal, scale=scale)
    # Every rank must run every backward shift (each is a send paired with a receive): a
    # block the mask hides from this rank's queries still gets its (zero) gradient.
    hidden = sum((key.sum() + value.sum()) * 0 for key, value, _ in blocks[1:])
    return out + hidden, lse


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


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      algorithm: str, zigzag: bool, causal: bool = False,
                      scale: float | None = None) -> torch.Tensor:
    """This rank's attention output for its tokens ``q``/``k``/``v`` (batch, heads,
    local_len, head_dim) under the plan's cp ``algorithm``, on the group bound to ``cp``."""
    group, n, _ = _group("cp")
    if group is None or n == 1:
        from autopar.kernels import attention

        return attention(q, k, v, causal=causal, scale=scale)
    if algorithm == "ulysses":
        return ulysses_attention(q, k, v, group, zigzag=zigzag, causal=causal, scale=scale)
    run = ring_kv_attention if algorithm == "ring" else all_gather_kv_attention
    out, _ = run(q, k, v, group, zigzag=zigzag, causal=causal, scale=scale)
    return out


def token_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                             weight: torch.Tensor | None = None, ignore_index: int = -100,
                             label_smoothing: float = 0.0, axis: str = "cp") -> torch.Tensor:
    """``n x`` this rank's summed cross-entropy over the targets (their weights) counted on
    all ``n`` ranks of ``axis``: its average over the ranks is the exact mean over their
    tokens, however unevenly ignored targets fall (see passes.token_mean_loss)."""
    total = torch.nn.functional.cross_entropy(
        logits, target, weight=weight, ignore_index=ignore_index, reduction="sum",
        label_smoothing=label_smoothing)
    with torch.no_grad():
        valid = target != ignore_index
        count = (weight[target.clamp(min=0)] * valid).sum() if weight is not None else valid.sum()
        count = count.to(torch.float64)
        group, n, _ = _group(axis)
        if group is not None:
            dist.all_reduce(count, group=group)
    return total * n / count.to(total.dtype)
