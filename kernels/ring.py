"""Ring attention on the generated kernels: a shard's queries against every shard's keys,
block by block, merged by log-sum-exp.

Context parallelism splits the sequence over ``cp`` ranks. Ring attention passes the key and
value blocks around the ring: at step ``s`` rank ``r`` holds the keys of rank
``(r - s) mod cp``, runs the fused kernel on its own queries against them, and folds the
partial result into its running one with :func:`merge_partials` (exact, given each part's
log-sum-exp). Each block is called with its global position (``q_offset`` = query start -
key start), so causal, sliding-window and ALiBi masks see global positions, and a block that
the mask hides entirely is skipped (with a causal mask, about half of them).

A rank holds its tokens as *pieces*: ``(start, length)`` runs of the global sequence, laid
end to end. Contiguous sharding gives rank ``r`` one piece; the zigzag layout gives it chunks
``r`` and ``2cp - 1 - r`` of ``2cp``, so under a causal mask every rank does the same work.

:func:`ring_attention_shard` is one rank's computation, given the blocks that visit it;
:func:`simulate_ring_attention` runs every rank in one process (tests, and the reference
the distributed version is checked against). :func:`block_forward` and
:func:`block_backward` are the two halves the distributed versions call between messages:
backward recomputes each block from the merged output and log-sum-exp (FlashAttention's
backward), so only q, the blocks, the output and the lse are kept.

    >>> import torch
    >>> from autopar.kernels import attention
    >>> q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    >>> out, lse = simulate_ring_attention(q, k, v, cp=4, causal=True, zigzag=True)
    >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .api import attention, merge_partials
from .attention_grad import attention_block_grad

Pieces = tuple[tuple[int, int], ...]
"""A rank's tokens: ``(global start, length)`` runs, in the order they are laid out."""


def shard_pieces(seq_len: int, cp: int, rank: int, *, zigzag: bool = False) -> Pieces:
    """The global positions rank ``rank`` of ``cp`` holds.

    >>> shard_pieces(16, 4, 1), shard_pieces(16, 4, 1, zigzag=True)
    (((4, 4),), ((2, 2), (12, 2)))
    """
    parts = 2 * cp if zigzag else cp
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not one of cp={cp} ranks")
    if seq_len % parts:
        layout = f"2·cp = {parts} zigzag chunks" if zigzag else f"cp = {cp} shards"
        raise ValueError(f"sequence length {seq_len} does not split into {layout}: pick a "
                         f"sequence length divisible by {parts}, or another cp")
    size = seq_len // parts
    if not zigzag:
        return ((rank * size, size),)
    return ((rank * size, size), ((2 * cp - 1 - rank) * size, size))


def _hidden(q: tuple[int, int], k: tuple[int, int], causal: bool,
            window: tuple[int, int] | None) -> bool:
    """Whether the mask hides every key of piece ``k`` from every query of piece ``q``."""
    (qs, qn), (ks, kn) = q, k
    left, right = (-1, -1) if window is None else window
    if causal:  # a causal mask is a window's right edge at 0
        right = 0
    if right >= 0 and ks > qs + qn - 1 + right:  # every key is further right than allowed
        return True
    return left >= 0 and ks + kn - 1 < qs - left  # every key is further left than allowed


@dataclass(frozen=True)
class RingMask:
    """What every block call of one attention shares: the mask and the score transform."""

    causal: bool = False
    window: tuple[int, int] | None = None
    scale: float | None = None
    softcap: float | None = None

    def kwargs(self) -> dict:
        return {"causal": self.causal, "window": self.window, "scale": self.scale,
                "softcap": self.softcap}


def _visible_pairs(q_pieces: Pieces, k_pieces: Pieces, mask: RingMask):
    """(query slice, key slice, q_offset) of every piece pair the mask does not hide."""
    q_at = 0
    for qp in q_pieces:
        k_at = 0
        for kp in k_pieces:
            if not _hidden(qp, kp, mask.causal, mask.window):
                yield (slice(q_at, q_at + qp[1]), slice(k_at, k_at + kp[1]), qp[0] - kp[0])
            k_at += kp[1]
        q_at += qp[1]


def _check_pieces(q: torch.Tensor, q_pieces: Pieces) -> None:
    if sum(n for _, n in q_pieces) != q.shape[2]:
        raise ValueError(f"q has {q.shape[2]} positions but its pieces {q_pieces} cover "
                         f"{sum(n for _, n in q_pieces)}")


def block_forward(q: torch.Tensor, q_pieces: Pieces, k: torch.Tensor, v: torch.Tensor,
                  k_pieces: Pieces, running: tuple[torch.Tensor, torch.Tensor] | None,
                  mask: RingMask, alibi_slopes: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one visiting block into the running (output fp32, lse fp32) of ``q``, without
    autograd (backward recomputes the block: :func:`block_backward`). Start from None."""
    _check_pieces(q, q_pieces)
    if running is None:
        b, h, m, d = q.shape
        running = (torch.zeros((b, h, m, d), dtype=torch.float32, device=q.device),
                   torch.full((b, h, m), float("-inf"), dtype=torch.float32, device=q.device))
    out, lse = running
    with torch.no_grad():
        for rows, keys, offset in _visible_pairs(q_pieces, k_pieces, mask):
            o, s = attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], **mask.kwargs(),
                             alibi_slopes=alibi_slopes, q_offset=offset, return_lse=True)
            out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows],
                                                              o.float(), s)
    return out, lse


def block_backward(q: torch.Tensor, q_pieces: Pieces, k: torch.Tensor, v: torch.Tensor,
                   k_pieces: Pieces, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                   dlse: torch.Tensor | None, mask: RingMask,
                   alibi_slopes: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fp32 of one block's share, from the merged ``out``/``lse`` of every
    block and their gradients; zeros where the mask hides the block."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows, keys, offset in _visible_pairs(q_pieces, k_pieces, mask):
        gq, gk, gv = attention_block_grad(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
            dout[:, :, rows], None if dlse is None else dlse[:, :, rows], **mask.kwargs(),
            alibi_slopes=alibi_slopes, q_offset=offset)
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    return dq, dk, dv


def _grad_or_zero(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


class _RingShard(torch.autograd.Function):
    """One rank's attention over its visiting blocks; keeps q, the blocks, the merged
    output and lse, and recomputes each block in backward."""

    @staticmethod
    def forward(ctx, q, q_pieces, block_pieces, mask, slopes, *kvs):
        running = None
        for i, pieces in enumerate(block_pieces):
            running = block_forward(q, q_pieces, kvs[2 * i], kvs[2 * i + 1], pieces, running,
                                    mask, slopes)
        out, lse = running
        ctx.save_for_backward(q, out, lse, slopes, *kvs)
        ctx.pieces, ctx.mask = (q_pieces, block_pieces), mask
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, out, lse, slopes, *kvs = ctx.saved_tensors
        q_pieces, block_pieces = ctx.pieces
        dout = _grad_or_zero(dout, q)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkvs = []
        for i, pieces in enumerate(block_pieces):
            gq, gk, gv = block_backward(q, q_pieces, kvs[2 * i], kvs[2 * i + 1], pieces, out,
                                        lse, dout, dlse, ctx.mask, slopes)
            dq += gq
            dkvs += [gk.to(kvs[2 * i].dtype), gv.to(kvs[2 * i + 1].dtype)]
        return (dq.to(q.dtype), None, None, None, None, *dkvs)


def ring_attention_shard(q: torch.Tensor, q_pieces: Pieces,
                         blocks: Sequence[tuple[torch.Tensor, torch.Tensor, Pieces]], *,
                         causal: bool = False, window: tuple[int, int] | None = None,
                         scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                         softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's attention: its queries ``q`` (laid out as ``q_pieces``) against each
    visiting block ``(k, v, k_pieces)``; returns the output and the log-sum-exp (fp32),
    with a query that sees no key getting 0 and ``-inf``. Differentiable in q and every
    block; backward keeps only q, the blocks, the output and the lse."""
    _check_pieces(q, q_pieces)
    mask = RingMask(causal, None if window is None else tuple(window), scale, softcap)
    kvs = [t for k, v, _ in blocks for t in (k, v)]
    return _RingShard.apply(q, tuple(q_pieces), tuple(tuple(p) for _, _, p in blocks), mask,
                            alibi_slopes, *kvs)


def _gather(x: torch.Tensor, pieces: Pieces) -> torch.Tensor:
    return torch.cat([x[:, :, s:s + n] for s, n in pieces], dim=2)


def simulate_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp: int,
                            zigzag: bool = False, causal: bool = False,
                            window: tuple[int, int] | None = None, scale: float | None = None,
                            alibi_slopes: torch.Tensor | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank of a ``cp``-way ring in this process: shard q, k, v by sequence, run each
    rank's ring (step ``s`` brings rank ``(r - s) mod cp``'s keys), and put the outputs back
    in global order. Equals ``attention(q, k, v, ...)`` with ``return_lse=True``."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"ring attention shards queries and keys alike: q_len {q.shape[2]} "
                         f"and k_len {k.shape[2]} differ")
    n = q.shape[2]
    pieces = [shard_pieces(n, cp, r, zigzag=zigzag) for r in range(cp)]
    local = [(_gather(k, p), _gather(v, p), p) for p in pieces]
    parts = []  # (global start, output piece, lse piece)
    for r in range(cp):
        visiting = [local[(r - s) % cp] for s in range(cp)]
        out, lse = ring_attention_shard(_gather(q, pieces[r]), pieces[r], visiting,
                                        causal=causal, window=window, scale=scale,
                                        alibi_slopes=alibi_slopes, softcap=softcap)
        at = 0
        for start, length in pieces[r]:
            parts.append((start, out[:, :, at:at + length], lse[:, :, at:at + length]))
            at += length
    parts.sort(key=lambda part: part[0])
    return (torch.cat([o for _, o, _ in parts], dim=2),
            torch.cat([s for _, _, s in parts], dim=2))
