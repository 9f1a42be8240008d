"""`attention`: the public entry, with SDPA's tensor conventions, and its dispatch.

Why three backends: the generated kernels need Triton on CUDA, or Triton's interpreter (which
runs them on CPU tensors, slowly, for tests); everywhere else the same call goes through
PyTorch's `scaled_dot_product_attention` with an explicit mask, so a model whose attention
was fused still runs in any process. The backend is chosen at each call from the tensors
and the environment (TRITON_INTERPRET is read at call time, never at import).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .codegen import interpreting
from .lse import chunked_lse
from .reference import alibi_bias, reference_attention, visible_mask
from .spec import AttentionSpec, dtype_name

logger = logging.getLogger(__name__)

_fallback_logged = False


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(q: torch.Tensor) -> str:
    """Which backend `attention` uses for q: "interpreter", "triton" or "sdpa"."""
    if _triton_available():
        if interpreting():
            return "interpreter"
        if q.is_cuda:
            return "triton"
    return "sdpa"


def _log_fallback(q: torch.Tensor) -> None:
    global _fallback_logged
    if _fallback_logged:
        return
    _fallback_logged = True
    if not _triton_available():
        reason = "triton is not installed"
    else:
        reason = f"tensors are on {q.device.type} (not CUDA) and TRITON_INTERPRET is not set"
    logger.info("autopar.kernels.attention runs through torch SDPA with an explicit mask: %s "
                "(logged once)", reason)


def spec_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
             window: tuple[int, int] | None = None, scale: float | None = None,
             bias: torch.Tensor | None = None, dropout_p: float = 0.0,
             alibi_slopes: torch.Tensor | None = None, softcap: float | None = None,
             bias_grad: bool | None = None) -> AttentionSpec:
    """Check the tensors of an attention call (listing every problem) and build its spec."""
    errors = []
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    for name, shape in shapes.items():
        if len(shape) != 4:
            errors.append(f"{name} must be (batch, heads, seq, head_dim), got shape {tuple(shape)}")
    if not errors:
        if k.shape != v.shape:
            errors.append(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if q.shape[2] == 0 or k.shape[2] == 0:
            errors.append(f"q_len and k_len must be positive, got {q.shape[2]} and {k.shape[2]}")
        if q.shape[0] != k.shape[0]:
            errors.append(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
        if q.shape[3] != k.shape[3]:
            errors.append(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
            errors.append(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
        if bias is not None:
            try:
                full = torch.broadcast_shapes(bias.shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
            except RuntimeError:
                full = None
            if full != (q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
                errors.append(f"bias of shape {tuple(bias.shape)} does not broadcast to "
                              f"(batch, heads, q_len, k_len) = {(q.shape[0], q.shape[1], q.shape[2], k.shape[2])}")
        if alibi_slopes is not None and tuple(alibi_slopes.shape) not in (
                (q.shape[1],), (q.shape[0], q.shape[1])):
            errors.append(f"alibi_slopes must be (heads,) or (batch, heads), got {tuple(alibi_slopes.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        errors.append(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v, bias, alibi_slopes) if t is not None}
    if len(devices) > 1:
        errors.append(f"tensors are on different devices: {sorted(str(d) for d in devices)}")
    try:
        dtype = dtype_name(q.dtype)
    except ValueError as e:
        errors.append(str(e))
        dtype = "float32"
    if errors:
        raise ValueError("autopar.kernels.attention: invalid arguments:\n  - " + "\n  - ".join(errors))
    if bias_grad is None:
        bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    return AttentionSpec(
        head_dim=q.shape[3], dtype=dtype, causal=causal,
        window=None if window is None else tuple(window), group_size=q.shape[1] // k.shape[1],
        scale=scale, softcap=softcap, bias=bias is not None, bias_grad=bias_grad,
        alibi=alibi_slopes is not None, dropout_p=dropout_p)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] | None = None, scale: float | None = None,
              bias: torch.Tensor | None = None, dropout_p: float = 0.0, return_lse: bool = False,
              seed: int | None = None, alibi_slopes: torch.Tensor | None = None,
              q_offset: int = 0, softcap: float | None = None):
    """Fused attention with `scaled_dot_product_attention`'s conventions.

    q is (batch, heads, q_len, head_dim); k and v are (batch, kv_heads, k_len, head_dim) with
    heads a multiple of kv_heads (GQA/MQA). `window=(left, right)` counts as FlashAttention
    does (-1 unbounded); `causal` is SDPA's top-left `is_causal` unless `q_offset` moves the
    queries (query i sits at key position i + q_offset; `k_len - q_len` gives
    FlashAttention's bottom-right alignment). `bias` is additive and broadcasts to
    (batch, heads, q_len, k_len) (a bool mask means "attend where True");
    `alibi_slopes` (heads,) or (batch, heads) adds -slope * |i + q_offset - j|. `softcap`
    caps the scaled scores to softcap * tanh(scores / softcap) before the bias (Gemma-2). Dropout is
    applied when `dropout_p > 0`, from a Philox stream keyed by `seed` (drawn from torch's
    generator if None). Returns the output, and with `return_lse` also the log-sum-exp
    (batch, heads, q_len) in fp32 (-inf for a query that sees no key), differentiable.
    """
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=bias.device).masked_fill(
            ~bias, float("-inf"))
    spec = spec_for(q, k, v, causal=causal, window=window, scale=scale, bias=bias,
                    dropout_p=dropout_p, alibi_slopes=alibi_slopes, softcap=softcap)
    if spec.dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    seed = 0 if seed is None else int(seed)
    if backend_for(q) == "sdpa":
        _log_fallback(q)
        out, lse = _sdpa_attention(spec, q, k, v, bias, alibi_slopes, seed, q_offset, return_lse)
    else:
        from .triton_attention import TritonAttention

        slopes = None if alibi_slopes is None else alibi_slopes.float()
        out, lse = TritonAttention.apply(q, k, v, bias, slopes, spec, seed, int(q_offset))
    return (out, lse) if return_lse else out


def _sdpa_attention(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    bias: torch.Tensor | None, slopes: torch.Tensor | None, seed: int,
                    q_offset: int, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fallback: SDPA with an explicit additive mask; lse (when asked) block by block."""
    if spec.softcap is not None:
        return _math_attention(spec, q, k, v, bias, slopes, seed, q_offset, return_lse)
    b, h, m, _ = q.shape
    n = k.shape[2]
    plain = bias is None and slopes is None and spec.window is None and (
        not spec.causal or q_offset == 0)
    mask = None
    if not plain:
        visible = visible_mask(m, n, causal=spec.causal, window=spec.window, q_offset=q_offset,
                               device=q.device)
        mask = torch.zeros((m, n), dtype=q.dtype, device=q.device).masked_fill(
            ~visible, float("-inf"))
        if bias is not None:
            mask = mask + bias.to(q.dtype)
        if slopes is not None:
            mask = mask + alibi_bias(slopes, b, h, m, n, q_offset, q.dtype)
    kwargs = {"attn_mask": mask, "dropout_p": spec.dropout_p, "scale": spec.scale,
              "is_causal": plain and spec.causal, "enable_gqa": spec.group_size > 1}
    if spec.dropout_p > 0:
        devices = [q.device] if q.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    if mask is not None:
        # a query that sees no key gets 0, as from the kernels (and no NaN in its gradient)
        empty = torch.isneginf(mask).all(dim=-1, keepdim=True)
        if bool(empty.any()):
            out = out.masked_fill(empty, 0.0)
    lse = None
    if return_lse and mask is not None and mask.requires_grad:
        lse = _materialised_lse(spec, q, k, mask)
    elif return_lse:
        lse = chunked_lse(q, k, mask, scale=spec.scale, causal=spec.causal and plain,
                          q_offset=q_offset)
    return out, lse


def _materialised_lse(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """lse through the full fp32 scores, so a learned bias gets its gradient (autograd
    keeps the scores: only for this rare case)."""
    kk = k.repeat_interleave(spec.group_size, dim=1) if spec.group_size > 1 else k
    s = (q.float() @ kk.float().transpose(-1, -2)) * spec.scale + mask.float()
    # a query that sees no key: lse -inf, and no NaN from logsumexp's backward
    # (0 * exp(-inf - -inf)) when ring attention merges this block with others
    none = torch.isneginf(s).all(dim=-1, keepdim=True)
    return torch.logsumexp(s.masked_fill(none, 0.0), dim=-1).masked_fill(
        none.squeeze(-1), float("-inf"))


def _math_attention(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    bias: torch.Tensor | None, slopes: torch.Tensor | None, seed: int,
                    q_offset: int, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fallback for what SDPA cannot do (soft-capping): the math, materialized."""
    if spec.dropout_p > 0:
        devices = [q.device] if q.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            keep = torch.rand(q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                              device=q.device) >= spec.dropout_p
    out, lse = reference_attention(
        q, k, v, causal=spec.causal, window=spec.window, scale=spec.scale, bias=bias,
        alibi_slopes=slopes, q_offset=q_offset, softcap=spec.softcap, return_lse=True,
        keep=keep if spec.dropout_p > 0 else None, dropout_p=spec.dropout_p)
    return out, (lse if return_lse else None)


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint sets of keys into attention over their union.

    Ring attention computes each block of keys separately; with each part's log-sum-exp,
    out = (e^lse1 out1 + e^lse2 out2) / (e^lse1 + e^lse2) is exact. Differentiable (the
    kernels pass gradients through lse), and safe when a part saw no key (lse = -inf).
    """
    lse1, lse2 = lse1.float(), lse2.float()
    top = torch.maximum(lse1, lse2).detach()
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), top + torch.log(total))
    out = (out1.float() * (w1 / total)[..., None] + out2.float() * (w2 / total)[..., None])
    return out.to(out1.dtype), lse
