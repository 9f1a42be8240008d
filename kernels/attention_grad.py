"""dQ, dK, dV of one block of keys, given the output and log-sum-exp over *all* keys.

Why: ring and all-gather context parallelism compute attention one block of keys at a time
and merge the parts. Differentiating that chain through autograd keeps every partial output
and merge temporary for backward (several sequence-long tensors per layer). FlashAttention's
backward needs only the final output O and log-sum-exp L: for a block of keys K_b, V_b,

    P = exp(S_b - L),  dV_b = P^T dO,  dS = P * (dO V_b^T - Delta),  Delta = rowsum(dO * O) - dL

gives exactly that block's share of the gradients, so the ring keeps q, k, v, O and L and
recomputes each block in backward, as the published ring attentions do. On CUDA and under
Triton's interpreter the generated backward kernels run (they take O, L and dL already); in
the SDPA fallback the same formula runs in plain torch, a block of query rows at a time.
"""

from __future__ import annotations

import torch

from .api import backend_for, spec_for
from .lse import expand_heads, rows_per_block
from .reference import alibi_bias, visible_mask


def attention_block_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, *,
                         causal: bool = False, window: tuple[int, int] | None = None,
                         scale: float | None = None,
                         alibi_slopes: torch.Tensor | None = None,
                         softcap: float | None = None,
                         q_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fp32 of attention of ``q`` against this block ``k``/``v`` (keys at
    global offset ``-q_offset`` from the queries), where ``out``/``lse`` are the outputs
    over every block and ``dout``/``dlse`` their gradients (``dlse`` may be None)."""
    spec = spec_for(q, k, v, causal=causal, window=window, scale=scale,
                    alibi_slopes=alibi_slopes, softcap=softcap, bias_grad=False)
    if backend_for(q) != "sdpa":
        from .triton_attention import attention_backward

        slopes = None if alibi_slopes is None else alibi_slopes.float()
        dq, dk, dv, _ = attention_backward(
            spec, q.contiguous(), k.contiguous(), v.contiguous(), None, slopes, 0,
            int(q_offset), out.contiguous(), lse, dout.contiguous(), dlse)
        return dq.float(), dk.float(), dv.float()
    return _math_block_grad(spec, q, k, v, out, lse, dout, dlse, alibi_slopes, int(q_offset))


def _math_block_grad(spec, q, k, v, out, lse, dout, dlse, slopes, q_offset):
    b, h, m, _ = q.shape
    n, group = k.shape[2], spec.group_size
    kk, vv = expand_heads(k, h).float(), expand_heads(v, h).float()
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse.float())
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dkk = torch.zeros(kk.shape, dtype=torch.float32, device=q.device)
    dvv = torch.zeros(vv.shape, dtype=torch.float32, device=q.device)
    rows = rows_per_block(q, n)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        qr, do = q[:, :, r0:r1].float(), dout[:, :, r0:r1].float()
        s = (qr @ kk.transpose(-1, -2)) * spec.scale
        if spec.softcap is not None:
            capped = torch.tanh(s / spec.softcap)
            s = spec.softcap * capped
        if slopes is not None:
            s = s + alibi_bias(slopes, b, h, r1 - r0, n, q_offset + r0, torch.float32)
        seen = visible_mask(r1 - r0, n, causal=spec.causal, window=spec.window,
                            q_offset=q_offset + r0, device=q.device)
        p = torch.exp(s.masked_fill(~seen, float("-inf")) - finite[:, :, r0:r1, None])
        dvv += p.transpose(-1, -2) @ do
        ds = p * (do @ vv.transpose(-1, -2) - delta[:, :, r0:r1, None])
        if spec.softcap is not None:
            ds = ds * (1 - capped * capped)
        dq[:, :, r0:r1] = (ds @ kk) * spec.scale
        dkk += (ds.transpose(-1, -2) @ qr) * spec.scale
    if group > 1:
        dkk = dkk.view(b, k.shape[1], group, n, -1).sum(2)
        dvv = dvv.view(b, k.shape[1], group, n, -1).sum(2)
    return dq, dkk, dvv
