"""A grouped matmul for MoE models that traces in every dtype: ``autopar::grouped_mm``.

``torch._grouped_mm`` is the grouped GEMM torchtitan's experts use, but its meta kernel
accepts only bf16, so an fp32 model that calls it cannot be traced on fake tensors. This
op has the same signature and meaning (rows ``offs[e-1]:offs[e]`` of ``x`` go through
``w[e]``), a fake kernel for every dtype, and a backward made of the same op. Its eager
kernel is ``torch._grouped_mm`` where that runs (CUDA in bf16, CPU in any dtype), else one
matmul per group. Written here because torch has no dtype-general traceable grouped GEMM.

>>> import torch
>>> x, w = torch.randn(6, 4), torch.randn(2, 4, 8)
>>> offs = torch.tensor([2, 6], dtype=torch.int32)
>>> y = grouped_mm(x, w, offs)
>>> torch.allclose(y[:2], x[:2] @ w[0]) and torch.allclose(y[2:], x[2:] @ w[1])
True
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in) sorted by group, ``w`` (groups, in, out), ``offs`` the cumulative
    row counts (int32): rows of group ``e`` times ``w[e]``."""
    if _native(x, w):
        return torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offs.to(torch.int32))
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _native(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned strides, and bf16 on CUDA."""
    aligned = all(d * x.element_size() % 16 == 0 for d in (x.shape[-1], w.shape[-1]))
    if x.device.type == "cuda":
        return aligned and x.dtype == w.dtype == torch.bfloat16
    return (aligned and x.device.type == "cpu" and x.dtype == w.dtype
            and x.dtype in (torch.float32, torch.bfloat16))


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("autopar::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor,
                           groups: int) -> torch.Tensor:
    """Per group ``e``: ``x[rows e].T @ grad[rows e]`` — the gradient of ``w``."""
    out = x.new_zeros(groups, x.shape[-1], grad.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = x[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    return x.new_empty(groups, x.shape[-1], grad.shape[-1])


def _setup(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, w.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
    grad_w = (grouped_mm_weight_grad(x, grad, offs, w.shape[0])
              if ctx.needs_input_grad[1] else None)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


@flop_counter.register_flop_formula(torch.ops.autopar.grouped_mm)
def _grouped_mm_flops(x_shape, w_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    # every row goes through one group's (in, out) matmul
    return 2 * x_shape[0] * w_shape[-2] * w_shape[-1]


@flop_counter.register_flop_formula(torch.ops.autopar.grouped_mm_weight_grad)
def _weight_grad_flops(x_shape, grad_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[-1] * grad_shape[-1]


if torch.ops.aten._grouped_mm.default not in flop_counter.flop_registry:
    # torch (2.13) counts no FLOPs for its own grouped GEMM; a 3-D weight means one matmul
    # per row, a 2-D one (the weight gradient, ragged inner dim) one per column block.
    @flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)
    def _aten_grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        if len(b_shape) == 3:
            return 2 * a_shape[0] * b_shape[-2] * b_shape[-1]
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
