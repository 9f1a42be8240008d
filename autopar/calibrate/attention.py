"""Measure fused attention's share of the matmul rate: the device's ``attention_efficiency``.

The cost model prices a ``scaled_dot_product_attention`` node (``autopar/solver/pricing/attention_costs.py``)
with the compute model's roofline (``cost_models/compute.py``), at the FLOPs the kernel
runs and a scaled matmul efficiency::

    forward  = op_time(fwd_flops * work, moved,     device, dtype, shape=qk, efficiency_scale=a)
    backward = op_time(bwd_flops * work, 2 * moved, device, dtype, shape=qk, efficiency_scale=a)

``fwd_flops``/``bwd_flops`` are what ``FlopCounterMode`` counts (the full ``seq x seq``
square), ``work`` is :func:`causal_fraction` for a causal mask (the score tiles a fused
kernel runs), ``qk`` is the ``(batch*heads*seq, seq, head_dim)`` matmul the model keys the
efficiency on (``solver.pricing.traced_ops.matmul_shape``), and ``a`` is ``attention_efficiency``. Both
passes are compute-bound at training lengths, so each costs
``flops * work / (peak * a * efficiency(qk)) + floor``, and calibration inverts exactly that::

    a = (fwd_run + bwd_run) / (peak * efficiency(qk)) / (t_forward + t_backward - 2 * floor)

with ``peak``, the efficiency curve and the floor the calibrated device's own (the curve's
dtype: fp32 on CPU, bf16 on GPUs), so a cluster fed the profile predicts the time measured
here. Over several shapes the sums are taken, so the total is reproduced.

Why measure it rather than take the preset's: it is a property of the attention kernel as
much as of the device. The softmax, its exponentials and the online rescaling between the
two matmuls keep every fused kernel below a GEMM's rate, by how much depends on the kernel:
FlashAttention-2 (what PyTorch's flash backend runs) is an Ampere kernel, and a
Hopper-native one (FlashAttention-3, cuDNN) runs 1.5-2x faster on an H100 (Shah et al.,
2024); PyTorch's CPU flash kernel is different again. Calibration times the kernel
``torch.nn.functional.scaled_dot_product_attention`` picks on this machine, with
``is_causal=True``, forward alone and forward with backward (``torch.autograd.grad``, as
for the intermediate ``q``, ``k``, ``v`` of a model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from autopar.analysis.precision import BYTES
from autopar.calibrate.timing import time_call
from autopar.cost_models.compute import causal_fraction
from autopar.cost_models.matmul_efficiency import matmul_efficiency

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def stored_bytes(dtype: str) -> int:
    """Bytes per element of a timed dtype (tf32 is fp32 in memory)."""
    return BYTES["fp32" if dtype == "tf32" else dtype]


@dataclass(frozen=True)
class AttentionPoint:
    """One timed causal SDPA of ``(batch, heads, seq, head_dim)`` in ``dtype``: seconds of
    the forward and of forward plus backward, and the FLOPs ``FlopCounterMode`` counted for
    each pass (the full square, as a trace counts them)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str
    forward_s: float
    forward_backward_s: float
    forward_flops: int
    backward_flops: int

    @property
    def backward_s(self) -> float:
        return self.forward_backward_s - self.forward_s

    @property
    def work(self) -> float:
        """Share of the counted FLOPs the causal kernel runs (:func:`causal_fraction`)."""
        return causal_fraction(self.seq)

    @property
    def bytes_moved(self) -> int:
        """Bytes of a forward as the cost model counts a fused kernel's: ``q``, ``k``, ``v``
        read and the output written (its backward moves twice as many)."""
        return 4 * self.batch * self.heads * self.seq * self.head_dim * stored_bytes(self.dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(m, n, k)`` of the score matmul, as the cost model reads an SDPA node
        (``solver.pricing.traced_ops.matmul_shape``): its matmul efficiency is looked up at this shape."""
        return self.batch * self.heads * self.seq, self.seq, self.head_dim

    def matmul_seconds(
        self, peak: float, curve: Sequence[tuple[float, float]]
    ) -> tuple[float, float]:
        """Seconds the forward and the backward would be busy at the matmul rate: the FLOPs
        the kernel runs over ``peak`` times the curve's efficiency, as the compute model
        charges them before ``efficiency_scale``."""
        rate = peak * matmul_efficiency(_Curve(tuple(curve)), self.shape)  # type: ignore[arg-type]
        return (self.forward_flops * self.work / rate, self.backward_flops * self.work / rate)


@dataclass(frozen=True)
class _Curve:
    """What :func:`matmul_efficiency` reads of a device that carries a measured curve."""

    matmul_efficiency_curve: tuple[tuple[float, float], ...]

    @property
    def matmul_efficiency(self) -> float:
        return self.matmul_efficiency_curve[-1][1]


def attention_efficiency_from(
    points: Sequence[AttentionPoint],
    peak_flops: Mapping[str, float],
    curve: Sequence[tuple[float, float]],
    floor: float,
    traffic_apart_s_per_byte: float = 0.0,
) -> float | None:
    """``attention_efficiency`` the points imply (module docstring), in (0, 1]; None without
    points in a dtype that has a peak. Forward and backward are one kernel each, so each
    pays one ``floor``, and the traffic a device does not overlap with the arithmetic
    (``traffic_apart_s_per_byte``: ``(1 - memory_overlap) / bandwidth``) is set apart too; a
    time within those means the kernel ran at (at least) the matmul rate: 1."""
    at_rate = busy = 0.0
    for point in points:
        if point.dtype not in peak_flops:
            continue
        forward, backward = point.matmul_seconds(peak_flops[point.dtype], curve)
        at_rate += forward + backward
        busy += (point.forward_backward_s - 2 * floor
                 - 3 * point.bytes_moved * traffic_apart_s_per_byte)
    if at_rate <= 0:
        return None
    if busy <= 0:
        return 1.0
    return min(1.0, at_rate / busy)


def attention_shapes(device_type: str, quick: bool) -> list[tuple[int, int, int, int]]:
    """``(batch, heads, seq, head_dim)`` to time: training lengths, long enough that the
    kernel is compute-bound and its causal tiles matter, short enough to stay quick (a CPU
    core runs the 1024 one forward and backward in ~40 ms)."""
    if device_type == "cuda":
        return [(1, 16, 4096, 128)] + ([] if quick else [(1, 16, 8192, 128)])
    # and shorter ones down to a small model's (seq 64, head dim 32), where a CPU core's
    # kernel reaches less of the matmul rate: the curve's ends, not an extrapolation
    return [(4, 4, 64, 32), (2, 4, 256, 64), (1, 4, 1024, 64)] + (
        [] if quick else [(1, 4, 2048, 64)])


def measure_attention(
    device: torch.device,
    dtype: str,
    *,
    quick: bool,
    repeats: int,
) -> list[AttentionPoint]:
    """Time causal SDPA at :func:`attention_shapes` in ``dtype`` on ``device``."""
    # FlopCounterMode knows only the CUDA attention kernels until the tracer teaches it
    # PyTorch's CPU flash kernel (the same formulas): importing the tracer does that.
    from autopar.trace import op_measure as op_costs  # noqa: F401

    return [
        _time_sdpa((batch, heads, seq, head_dim), dtype, device, repeats)
        for batch, heads, seq, head_dim in attention_shapes(device.type, quick)
    ]


def _time_sdpa(
    shape: tuple[int, int, int, int], dtype: str, device: torch.device, repeats: int
) -> AttentionPoint:
    """One causal SDPA of ``shape`` timed forward and forward+backward, its FLOPs counted."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    gen = torch.Generator(device="cpu").manual_seed(0)
    kind = _TORCH_DTYPES[dtype]
    q, k, v = (torch.randn(shape, generator=gen).to(device, kind).requires_grad_()
               for _ in range(3))
    grad = torch.randn(shape, generator=gen).to(device, kind)

    def forward() -> torch.Tensor:
        return sdpa(q, k, v, is_causal=True)

    def forward_backward() -> object:
        return torch.autograd.grad(forward(), (q, k, v), grad)

    with FlopCounterMode(display=False) as counted:
        out = forward()
    fwd_flops = counted.get_total_flops()
    with FlopCounterMode(display=False) as counted:
        torch.autograd.grad(out, (q, k, v), grad)
    bwd_flops = counted.get_total_flops()
    if not fwd_flops or not bwd_flops:  # a kernel FlopCounterMode has no formula for
        fwd_flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        bwd_flops = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
    del out
    forward_s = time_call(forward, device, repeats=repeats)
    forward_backward_s = time_call(forward_backward, device, repeats=repeats)
    return AttentionPoint(*shape, dtype, forward_s, forward_backward_s, int(fwd_flops),
                          int(bwd_flops))
