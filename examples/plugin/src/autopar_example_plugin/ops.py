"""The functions and the custom op the plugin's pass and rule are about."""

from __future__ import annotations

import math

import torch


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU written out with erf: x * (1 + erf(x / sqrt(2))) / 2 (what aten.gelu computes
    with approximate='none'), as ordinary differentiable torch ops."""
    return x * 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


@torch.library.custom_op("autopar_example::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * tanh(x): an elementwise custom op, whose sharding rule the plugin adds."""
    return scale * torch.tanh(x)


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


scaled_tanh.register_autograd(_backward, setup_context=_setup)
