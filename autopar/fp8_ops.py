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

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
OUT_DTYPE = torch.bfloat16
_EPS = 1e-12


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` in fp8 ``dtype``, the scale it was multiplied by): tensorwise, amax-based."""
    amax = x.detach().abs().amax().float().clamp(min=_EPS)
    scale = torch.finfo(dtype).max / amax
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale


def _scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                   b_scale: torch.Tensor) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` in fp32 accumulation, output bf16; ``a`` is 2-d
    row-major, ``b`` 2-d (used as given)."""
    aligned = all(d % 16 == 0 for d in (*a.shape, b.shape[1]))  # _scaled_mm's rule
    if a.is_cuda and aligned and hasattr(torch, "_scaled_mm"):
        return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                                scale_b=b_scale.reciprocal(), out_dtype=OUT_DTYPE)
    return ((a.float() / a_scale) @ (b.float() / b_scale)).to(OUT_DTYPE)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        xq, xs = quantize(flat, E4M3)
        wq, ws = quantize(weight, E4M3)
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
