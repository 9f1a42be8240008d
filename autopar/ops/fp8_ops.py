"""fp8 linear layers with tensorwise scaling: the recipe torchao's float8 training uses.

Forward: the input and the weight are scaled so their largest magnitude lands on
``float8_e4m3fn``'s largest value, cast, multiplied, and the product unscaled into bf16.
Backward: the output gradient is scaled into ``float8_e5m2`` (more range, less precision)
and each gradient matmul takes fp8 operands the same way.

Why written here: torchao converts ``nn.Linear`` modules (``Float8Linear``), while an autopar
program calls functional linears on (possibly sharded) weights; both end in the same
PyTorch op, ``torch._scaled_mm``, which this calls on CUDA. Elsewhere (CPU, the Triton
interpreter) the same quantisation is emulated — values rounded through the fp8 dtypes,
multiplied in fp32 — so the numerics of an fp8 plan can be checked on any machine.

>>> g = torch.Generator().manual_seed(0)
>>> x, w = torch.randn(4, 32, generator=g), torch.randn(16, 32, generator=g)
>>> y = fp8_linear(x, w)
>>> y.dtype, bool((y.float() - x @ w.T).norm() < 0.1 * (x @ w.T).norm())
(torch.bfloat16, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from autopar.ops.step_copies import one_weight_copy_per_step, step_copy

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
OUT_DTYPE = torch.bfloat16
_EPS = 1e-12


_BLOCK = 1 << 24
"""Elements scaled at a time by the eager cast: its fp32 temporaries stay under 128 MiB."""


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` in fp8 ``dtype``, the scale it was multiplied by): tensorwise, amax-based.

    Written to hold no full-size temporary: scaling a large tensor in one expression made
    an fp32 copy of it twice over (``x.float() * scale``, then ``clamp``) -- for the head's
    output gradient of Llama 3 at 16,384 tokens, 15.6 GiB beside a 3.9 GiB gradient, which
    one H200 measured as an fp8 step's peak 37% above the plan's (``benchmarks/results/
    h200_2026-11-29.md``). The amax is one reduction (``vector_norm``'s inf norm, no |x|
    copy); the cast runs compiled where it can (one fused kernel, as torchao's compiled
    ``Float8Linear`` casts) and otherwise a block at a time."""
    x = x.detach()
    amax = torch.linalg.vector_norm(x, float("inf")).float().clamp(min=_EPS)
    scale = torch.finfo(dtype).max / amax
    return _scaled_cast(x, scale, dtype), scale


def _scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(x * scale)`` in ``dtype``, computed in fp32 as one expression would."""
    compiled = _compiled_cast(dtype) if x.is_cuda else None
    if compiled is not None:
        try:
            return compiled(x, scale)
        except Exception as err:  # a compiler that fails here must not stop training
            _COMPILED[dtype] = None
            warnings.warn(f"fp8 casts run eagerly (a block at a time): torch.compile failed "
                          f"({type(err).__name__}: {err})", RuntimeWarning, stacklevel=2)
    limit = torch.finfo(dtype).max
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    source, target = x.reshape(-1), out.view(-1)
    for start in range(0, source.numel(), _BLOCK):
        block = source[start:start + _BLOCK].float() * scale
        target[start:start + _BLOCK] = block.clamp_(-limit, limit)
    return out


_COMPILED: dict[torch.dtype, Callable | None] = {}
"""fp8 dtype -> its compiled cast (None once compiling failed, or torch.compile is absent)."""


def _compiled_cast(dtype: torch.dtype) -> Callable | None:
    """The cast as one compiled kernel (torch.compile; dynamic shapes: one per dtype)."""
    if dtype not in _COMPILED:
        limit = torch.finfo(dtype).max

        def cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return (x.float() * scale).clamp(-limit, limit).to(dtype)

        compile_ = getattr(torch, "compile", None)
        _COMPILED[dtype] = compile_(cast, dynamic=True) if compile_ is not None else None
    return _COMPILED[dtype]


def _scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                   b_scale: torch.Tensor) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` in fp32 accumulation, output bf16; ``a`` is 2-d
    row-major, ``b`` 2-d (used as given)."""
    aligned = all(d % 16 == 0 for d in (*a.shape, b.shape[1]))  # _scaled_mm's rule
    if a.is_cuda and aligned and hasattr(torch, "_scaled_mm"):
        return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                                scale_b=b_scale.reciprocal(), out_dtype=OUT_DTYPE)
    return ((a.float() / a_scale) @ (b.float() / b_scale)).to(OUT_DTYPE)


_QUANTIZED: dict[tuple[int, object], tuple] = {}
"""Activations' e4m3 copies (:func:`autopar.ops.step_copies.step_copy`'s table). A copy is
held only by what saved it for backward: one no linear kept (a checkpointed layer's first
forward) is freed as it would be without sharing."""


def _quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` flattened to rows and quantized to e4m3, once per tensor: the q, k and v
    projections (or a gate and an up projection) reading one input share one copy, which
    each keeps for backward, as Transformer Engine's fused layers keep one. The entry lives
    as long as ``x``, and a write to ``x`` (its version) makes it stale."""
    return _copy_once(_QUANTIZED, x, lambda: x.reshape(-1, x.shape[-1]))


def _copy_once(table: dict, tensor: torch.Tensor,
               rows: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 copy, scale) of ``rows()``, made once per ``tensor`` as it is now while the
    copy is alive (held only by what saved it for backward: :func:`step_copy`)."""
    return step_copy(table, tensor, E4M3, lambda: quantize(rows(), E4M3))


def _quantized_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Within a step (:class:`one_weight_copy_per_step`) each weight is quantized once and
    its e4m3 copy shared by every microbatch, as Transformer Engine caches fp8 weights
    across microbatches: a pipeline's microbatches in flight keep one copy, not one each.
    The copy is held only by the microbatches that saved it for backward."""
    if not one_weight_copy_per_step.active:
        return quantize(weight, E4M3)
    return _copy_once(one_weight_copy_per_step.copies, weight, lambda: weight)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xq, xs = _quantized_input(x)
        wq, ws = _quantized_weight(weight)
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype)
        out = _scaled_matmul(xq, xs, wq.t(), ws)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = quantize(grad.reshape(-1, grad.shape[-1]), E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _scaled_matmul(gq, gs, wq, ws).reshape(ctx.shape).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_w = _scaled_matmul(gq.t().contiguous(), gs, xq, xs).to(ctx.dtypes[1])
        return grad_x, grad_w


def fp8_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with fp8 operands (tensorwise scaling); output bf16."""
    out = _Fp8Linear.apply(x, weight)
    return out if bias is None else out + bias.to(out.dtype)
