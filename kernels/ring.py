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
the distributed version is checked against). Both are differentiable through autograd: the
kernels' backward gives each block's dK and dV, which the distributed version sends back
around the ring.

    >>> import torch
    >>> from autopar.kernels import attention
    >>> q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    >>> out, lse = simulate_ring_attention(q, k, v, cp=4, causal=True, zigzag=True)
    >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .api import attention, merge_partials

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


def ring_attention_shard(q: torch.Tensor, q_pieces: Pieces,
                         blocks: Sequence[tuple[torch.Tensor, torch.Tensor, Pieces]], *,
                         causal: bool = False, window: tuple[int, int] | None = None,
                         scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                         softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's attention: its queries ``q`` (laid out as ``q_pieces``) against each
    visiting block ``(k, v, k_pieces)``; returns the output and the log-sum-exp (fp32),
    with a query that sees no key getting 0 and ``-inf``."""
    if sum(n for _, n in q_pieces) != q.shape[2]:
        raise ValueError(f"q has {q.shape[2]} positions but its pieces {q_pieces} cover "
                         f"{sum(n for _, n in q_pieces)}")
    outs, lses = [], []
    q_at = 0
    for qp in q_pieces:
        q_part = q[:, :, q_at:q_at + qp[1]]
        q_at += qp[1]
        out = lse = None
        for k, v, k_pieces in blocks:
            k_at = 0
            for kp in k_pieces:
                k_part, v_part = k[:, :, k_at:k_at + kp[1]], v[:, :, k_at:k_at + kp[1]]
                k_at += kp[1]
                if _hidden(qp, kp, causal, window):
                    continue
                o, s = attention(q_part, k_part, v_part, causal=causal, window=window,
                                 scale=scale, alibi_slopes=alibi_slopes, softcap=softcap,
                                 q_offset=qp[0] - kp[0], return_lse=True)
                out, lse = (o, s) if out is None else merge_partials(out, lse, o, s)
        if out is None:  # every key is hidden from this piece
            b, h = q.shape[:2]
            out = q_part.new_zeros(q_part.shape)
            lse = torch.full((b, h, qp[1]), float("-inf"), dtype=torch.float32,
                             device=q.device)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


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
