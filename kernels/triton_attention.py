"""Launch the generated kernels, and the autograd.Function that pairs forward with backward.

Kept apart from code generation so that the source can be printed and timed without a
device, and apart from dispatch so that this file only ever runs where Triton can run
(CUDA, or the interpreter on CPU tensors).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .blocks import COMPILE_OPTIONS, Blocks, autotune_candidates, block_sizes
from .codegen import KernelSet, build_kernels, interpreting
from .spec import AttentionSpec


@dataclass(frozen=True)
class _Launchers:
    """The kernels of one spec ready to launch on one device (autotuned on CUDA)."""

    kernels: KernelSet
    blocks: Blocks | None
    fwd: object
    dkdv: object
    dq: object



def _capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA capability of `device`, or None under the interpreter (or off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _autotuned(kernel: object, blocks: Blocks, which: str) -> object:
    """Wrap a jit kernel in `triton.autotune` over the table entry's neighbours (CUDA only)."""
    import triton

    configs = []
    for cand in autotune_candidates(blocks):
        bm, bn = getattr(cand, which)
        configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=cand.num_warps,
                                     num_stages=cand.num_stages))
    return triton.autotune(configs=configs, key=["q_len", "k_len", "H"])(kernel)


@functools.lru_cache(maxsize=512)
def _launchers(spec: AttentionSpec, interpret: bool,
               capability: tuple[int, int] | None) -> _Launchers:
    """Kernels for (spec, mode, device), built once; autotune wrappers only when compiled."""
    kernels = build_kernels(spec, interpret)
    if interpret:
        return _Launchers(kernels, block_sizes(spec, None), kernels.fwd, kernels.dkdv, kernels.dq)
    blocks = block_sizes(spec, capability)
    return _Launchers(kernels, None, _autotuned(kernels.fwd, blocks, "fwd"),
                      _autotuned(kernels.dkdv, blocks, "dkdv"), _autotuned(kernels.dq, blocks, "dq"))


def _get(spec: AttentionSpec, device: torch.device) -> _Launchers:
    interpret = interpreting()
    return _launchers(spec, interpret, None if interpret else _capability(device))


def _grid(n: int, block: int | None, key: str, batch_heads: int):
    """A launch grid; with autotuning the block size is only known inside the launch."""
    if block is not None:
        return (triton_cdiv(n, block), batch_heads)
    return lambda meta: (triton_cdiv(n, meta[key]), batch_heads)


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division (what `triton.cdiv` does, without importing triton here)."""
    return -(-a // b)


def _seed_words(seed: int) -> tuple[int, int]:
    """The 64-bit Philox key as the (low, high) 32-bit words the kernels take."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def _bias_view(bias: torch.Tensor | None, q: torch.Tensor, k_len: int) -> tuple[torch.Tensor, tuple]:
    """The bias as a (batch, heads, q_len, k_len) view (stride 0 on broadcast dims)."""
    b, h, m, _ = q.shape
    if bias is None:
        return q, (0, 0, 0, 0)
    view = bias.expand(b, h, m, k_len)
    return view, tuple(view.stride())


def _slopes_view(slopes: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """ALiBi slopes as a (batch, heads) view (they may be given per head only)."""
    if slopes is None:
        return q, (0, 0)
    view = slopes.expand(q.shape[0], q.shape[1])
    return view, tuple(view.stride())


def _launch_args(q, k, v, bias, slopes):
    b, h, m, _ = q.shape
    n = k.shape[2]
    bias_t, bias_s = _bias_view(bias, q, n)
    slopes_t, slopes_s = _slopes_view(slopes, q)
    strides = (*q.stride(), *k.stride(), *v.stride(), *bias_s, *slopes_s)
    return b, h, m, n, bias_t, slopes_t, strides


def attention_forward(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      bias: torch.Tensor | None, slopes: torch.Tensor | None, seed: int,
                      q_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: (output like q, log-sum-exp (batch, heads, q_len) fp32)."""
    ks = _get(spec, q.device)
    b, h, m, n, bias_t, slopes_t, strides = _launch_args(q, k, v, bias, slopes)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, h, m), device=q.device, dtype=torch.float32)
    blocks = None if ks.blocks is None else ks.blocks.fwd
    grid = _grid(m, None if blocks is None else blocks[0], "BLOCK_M", b * h)
    meta = {} if blocks is None else {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
    ks.fwd[grid](q, k, v, bias_t, slopes_t, out, lse, *strides, *out.stride(), *lse.stride(),
                 h, m, n, q_offset, *_seed_words(seed), **meta, **COMPILE_OPTIONS)
    return out, lse


def attention_backward(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, slopes: torch.Tensor | None, seed: int,
                       q_offset: int, out: torch.Tensor, lse: torch.Tensor,
                       dout: torch.Tensor | None, dlse: torch.Tensor | None):
    """Run the two backward kernels: (dq, dk, dv, dS full (b, h, q, k) fp32 or None).

    Delta = rowsum(dO * O) - dLSE, so a gradient flowing into the log-sum-exp (ring
    attention's merge) folds into the same dS = P * (dP - Delta).
    """
    ks = _get(spec, q.device)
    b, h, m, n, bias_t, slopes_t, strides = _launch_args(q, k, v, bias, slopes)
    if dout is None:
        dout = torch.zeros_like(out)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    lse = lse.contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if spec.bias_grad:
        dbias = torch.zeros((b, h, m, n), device=q.device, dtype=torch.float32)
    else:
        dbias = lse
    dbias_s = tuple(dbias.stride()) if spec.bias_grad else (0, 0, 0, 0)
    common = (*strides, *dout.stride(), *lse.stride())
    tail = (h, m, n, q_offset, *_seed_words(seed))
    kv_heads = k.shape[1]

    blocks = None if ks.blocks is None else ks.blocks.dkdv
    grid = _grid(n, None if blocks is None else blocks[1], "BLOCK_N", b * kv_heads)
    meta = {} if blocks is None else {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
    ks.dkdv[grid](q, k, v, bias_t, slopes_t, dout, lse, delta, dk, dv, dbias, *common,
                  *dk.stride(), *dv.stride(), *dbias_s, *tail, **meta, **COMPILE_OPTIONS)

    blocks = None if ks.blocks is None else ks.blocks.dq
    grid = _grid(m, None if blocks is None else blocks[0], "BLOCK_M", b * h)
    meta = {} if blocks is None else {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
    ks.dq[grid](q, k, v, bias_t, slopes_t, dout, lse, delta, dq, *common, *dq.stride(), *tail,
                **meta, **COMPILE_OPTIONS)
    return dq, dk, dv, (dbias if spec.bias_grad else None)


def reduce_bias_grad(dbias_full: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Sum the full (b, h, q, k) dS over the dims the bias was broadcast along."""
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    dims = [i for i in range(4) if shape[i] == 1 and dbias_full.shape[i] != 1]
    grad = dbias_full.sum(dim=dims, keepdim=True) if dims else dbias_full
    return grad.reshape(bias.shape).to(bias.dtype)


class TritonAttention(torch.autograd.Function):
    """Generated forward kernel on the way in, the two generated backward kernels on the way out."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor | None, slopes: torch.Tensor | None, spec: AttentionSpec,
                seed: int, q_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attention_forward(spec, q, k, v, bias, slopes, seed, q_offset)
        ctx.save_for_backward(q, k, v, bias, slopes, out, lse)
        ctx.spec, ctx.seed, ctx.q_offset = spec, seed, q_offset
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, bias, slopes, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None, None, None, None
        dq, dk, dv, dbias = attention_backward(ctx.spec, q, k, v, bias, slopes, ctx.seed,
                                               ctx.q_offset, out, lse, dout, dlse)
        dbias_out = None
        if dbias is not None and ctx.needs_input_grad[3]:
            dbias_out = reduce_bias_grad(dbias, bias)
        return dq, dk, dv, dbias_out, None, None, None, None
