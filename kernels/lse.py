"""The log-sum-exp of attention scores without keeping the scores: the SDPA fallback's lse.

Why hand-written: ring and all-gather context parallelism merge partial attention by each
part's log-sum-exp, and differentiate through it. On CUDA the generated kernel returns lse
at no cost; SDPA's CPU flash kernel returns one too, but marks it non-differentiable. Taking
`torch.logsumexp` over the materialised fp32 scores is exact but autograd then keeps the
whole (batch, heads, q_len, k_len) matrix per layer until backward, which is not what the
memory model prices (the kernels keep lse only) and not what a long sequence can afford.
Here the scores are built a block of query rows at a time in forward, and again in
backward, so only lse (batch, heads, q_len) stays alive.

    >>> import torch
    >>> q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4)
    >>> lse = chunked_lse(q, k, None, scale=0.5, causal=False, q_offset=0)
    >>> torch.allclose(lse, torch.logsumexp(q @ k.transpose(-1, -2) * 0.5, -1))
    True
"""

from __future__ import annotations

import torch

from .reference import visible_mask

# Score elements one block of query rows may hold at once (4 Mi fp32 = 16 MiB).
BLOCK_ELEMENTS = 1 << 22


def rows_per_block(q: torch.Tensor, k_len: int) -> int:
    """Query rows per block, so a block's scores hold at most BLOCK_ELEMENTS."""
    b, h, _, _ = q.shape
    return max(1, BLOCK_ELEMENTS // max(1, b * h * k_len))


def _scores(q_rows: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
            causal: bool, row0: int, q_offset: int) -> torch.Tensor:
    """fp32 scaled scores of a block of query rows, masked; k already has q's head count."""
    s = (q_rows.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask[..., row0:row0 + q_rows.shape[2], :].float()
    elif causal:
        seen = visible_mask(q_rows.shape[2], k.shape[2], causal=True, q_offset=q_offset + row0,
                            device=q_rows.device)
        s = s.masked_fill(~seen, float("-inf"))
    return s


def expand_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    """k with each key/value head repeated for the query heads sharing it (GQA)."""
    group = heads // k.shape[1]
    return k.repeat_interleave(group, dim=1) if group > 1 else k


class _ChunkedLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, mask, scale, causal, q_offset):
        kk = expand_heads(k, q.shape[1])
        b, h, m, _ = q.shape
        lse = torch.empty(b, h, m, dtype=torch.float32, device=q.device)
        rows = rows_per_block(q, k.shape[2])
        for r0 in range(0, m, rows):
            s = _scores(q[:, :, r0:r0 + rows], kk, mask, scale, causal, r0, q_offset)
            # a query that sees no key: lse -inf (and no NaN from logsumexp)
            none = torch.isneginf(s).all(dim=-1)
            lse[:, :, r0:r0 + rows] = torch.logsumexp(
                s.masked_fill(none[..., None], 0.0), dim=-1).masked_fill(none, float("-inf"))
        ctx.save_for_backward(q, k, mask, lse)
        ctx.scale, ctx.causal, ctx.q_offset = scale, causal, q_offset
        return lse

    @staticmethod
    def backward(ctx, dlse):
        q, k, mask, lse = ctx.saved_tensors
        kk = expand_heads(k, q.shape[1]).float()
        m = q.shape[2]
        # d lse_i / d s_ij = p_ij, the softmax; p is 0 for a query that saw no key
        finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dkk = torch.zeros(kk.shape, dtype=torch.float32, device=q.device)
        rows = rows_per_block(q, k.shape[2])
        for r0 in range(0, m, rows):
            qr = q[:, :, r0:r0 + rows]
            s = _scores(qr, kk, mask, ctx.scale, ctx.causal, r0, ctx.q_offset)
            g = torch.exp(s - finite[:, :, r0:r0 + rows, None]) * dlse[:, :, r0:r0 + rows, None]
            dq[:, :, r0:r0 + rows] = (g @ kk) * ctx.scale
            dkk += (g.transpose(-1, -2) @ qr.float()) * ctx.scale
        group = q.shape[1] // k.shape[1]
        dk = dkk.view(k.shape[0], k.shape[1], group, *k.shape[2:]).sum(2) if group > 1 else dkk
        return dq.to(q.dtype), dk.to(k.dtype), None, None, None, None


def chunked_lse(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, *, scale: float,
                causal: bool, q_offset: int) -> torch.Tensor:
    """logsumexp over keys of q k^T * scale (+ mask), (batch, heads, q_len) fp32, keeping
    only its inputs and the result for backward. `mask` is additive, broadcasting to
    (batch, heads, q_len, k_len), and must not need a gradient; without it `causal` masks
    key j from query i when j > i + q_offset. k may have fewer heads (GQA)."""
    if mask is not None and mask.requires_grad:
        raise ValueError("chunked_lse: the mask must not require a gradient (a learned "
                         "bias takes the materialised path)")
    return _ChunkedLse.apply(q, k, mask, float(scale), bool(causal), int(q_offset))
