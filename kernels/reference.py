"""Reference attention: plain materialized math, with the same options as the kernels.

It is what the tests trust, so it is written for clarity, not speed: full (b, h, q, k)
scores in the inputs' dtype (pass fp64 tensors for the fp64 reference, fp16/bf16 ones for
"PyTorch eager in low precision"), differentiable by autograd, and it reproduces the
kernels' dropout mask bit for bit by running Philox-4x32-10 in numpy with the same key and
counters (`dropout_keep_mask`), independently of Triton.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .codegen import keep_threshold

_M32 = np.uint64(0xFFFFFFFF)


def _umulhi(a: np.ndarray, b: np.uint64) -> np.ndarray:
    """High 32 bits of a 32x32-bit product (exact in uint64)."""
    return (a * b) >> np.uint64(32)


def philox4x32(seed: int, c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray,
               rounds: int = 10) -> tuple[np.ndarray, ...]:
    """Philox-4x32 as `tl.philox` computes it: 64-bit seed split into the two key words."""
    c = [np.asarray(x, dtype=np.uint64) & _M32 for x in (c0, c1, c2, c3)]
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64((seed >> 32) & 0xFFFFFFFF)
    ra, rb = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    ka, kb = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(rounds):
        a0, a2 = c[0], c[2]
        c = [_umulhi(a2, rb) ^ c[1] ^ k0, (rb * a2) & _M32,
             _umulhi(a0, ra) ^ c[3] ^ k1, (ra * a0) & _M32]
        k0 = (k0 + ka) & _M32
        k1 = (k1 + kb) & _M32
    return tuple(c)


def dropout_keep_mask(seed: int, batch: int, heads: int, q_len: int, k_len: int,
                      dropout_p: float) -> torch.Tensor:
    """The kernels' keep mask, (batch, heads, q_len, k_len) bool: counter (j, i, b*H + h, 0)."""
    j = np.arange(k_len, dtype=np.uint64)[None, None, :]
    i = np.arange(q_len, dtype=np.uint64)[None, :, None]
    bh = np.arange(batch * heads, dtype=np.uint64)[:, None, None]
    shape = (batch * heads, q_len, k_len)
    r, _, _, _ = philox4x32(seed, np.broadcast_to(j, shape), np.broadcast_to(i, shape),
                            np.broadcast_to(bh, shape), np.zeros(shape, dtype=np.uint64))
    keep = (r & np.uint64(0x7FFFFFFF)) >= np.uint64(keep_threshold(dropout_p))
    return torch.from_numpy(keep.reshape(batch, heads, q_len, k_len).copy())


def visible_mask(q_len: int, k_len: int, *, causal: bool = False,
                 window: tuple[int, int] | None = None, q_offset: int = 0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """(q_len, k_len) bool: key j visible to query i (at position i + q_offset)."""
    dist = (torch.arange(q_len, device=device)[:, None] + q_offset
            - torch.arange(k_len, device=device)[None, :])
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if right >= 0:
        visible &= dist >= -right
    if left >= 0:
        visible &= dist <= left
    return visible


def alibi_bias(slopes: torch.Tensor, batch: int, heads: int, q_len: int, k_len: int,
               q_offset: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ALiBi as FlashAttention adds it: -slope * |i + q_offset - j|, shape (b, h, q, k)."""
    dist = (torch.arange(q_len, device=slopes.device)[:, None] + q_offset
            - torch.arange(k_len, device=slopes.device)[None, :]).abs().to(dtype)
    s = slopes.to(dtype).expand(batch, heads)
    return -s[:, :, None, None] * dist


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, window: tuple[int, int] | None = None,
                        scale: float | None = None, bias: torch.Tensor | None = None,
                        dropout_p: float = 0.0, seed: int | None = None,
                        alibi_slopes: torch.Tensor | None = None, q_offset: int = 0,
                        softcap: float | None = None, keep: torch.Tensor | None = None,
                        return_lse: bool = False):
    """Attention by the definition, in q's dtype; same conventions as `attention`.

    Rows that see no key give output 0 and log-sum-exp -inf (as the kernels do), without
    NaNs in the gradients. Dropout keeps where `keep` (b, h, q, k) is True, or by the
    kernels' Philox mask for `seed`.
    """
    b, h, m, d = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    dtype = q.dtype
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if h != kv_heads:
        k = k.repeat_interleave(h // kv_heads, dim=1)
        v = v.repeat_interleave(h // kv_heads, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device).masked_fill(
                ~bias, float("-inf"))
        s = s + bias.to(dtype)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, b, h, m, n, q_offset, dtype)
    visible = visible_mask(m, n, causal=causal, window=window, q_offset=q_offset, device=q.device)
    s = s.masked_fill(~visible, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    expd = torch.exp(s - row_max)
    total = expd.sum(dim=-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    p = expd / total
    lse = torch.where(empty, torch.full_like(total, float("-inf")), row_max + torch.log(total))
    if dropout_p > 0:
        if keep is None and seed is None:
            raise ValueError("reference dropout needs the seed the kernel used (or `keep`)")
        if keep is None:
            keep = dropout_keep_mask(seed, b, h, m, n, dropout_p).to(q.device)
        p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    out = p @ v
    if not return_lse:
        return out
    lse = lse.squeeze(-1)
    return out, (lse if dtype == torch.float64 else lse.float())
