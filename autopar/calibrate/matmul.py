"""Measure one device: matmul rates by size, elementwise bandwidth and the per-op floor.

What the timings become (peak FLOP/s, the efficiency curve, bandwidth, the floor, and why
they are chosen so) is :mod:`autopar.calibrate.device_fit`.

The curve is built from compute-bound shapes: square ``n x n x n`` and tall ``4n x n x n``
(tokens x hidden x hidden, a transformer layer's shape). Skinny shapes (``m`` of 8-32 rows
against a large weight) are measured and recorded too, but kept out of the curve: a curve
keyed by FLOPs cannot tell them from a square matmul of the same FLOPs that runs 2x faster,
and what slows them is reading the weight, which the roofline's memory term already charges.

Every dtype the device trains in gets its own measured peak (on CPU fp32, bf16 and fp16:
bf16 on AMX can run several times faster than fp32), but a device has one curve, measured in
the dtype training uses by default there (fp32 on CPU, bf16 on GPUs); the other dtypes'
points are recorded in the measurements.

On CPU, a training process has the threads torchrun gives it (``OMP_NUM_THREADS=1`` per
process), so measurements run with ``threads`` (default 1) torch threads.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from autopar.calibrate.attention import measure_attention
from autopar.calibrate.device_fit import BandwidthPoint, DeviceCalibration, MatmulPoint
from autopar.calibrate.op_rates import measure_op_rates, measure_view_seconds
from autopar.calibrate.timing import time_call

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_DTYPES = {"cpu": ["fp32", "bf16", "fp16"], "cuda": ["bf16", "fp16", "tf32", "fp32"]}
"""Dtypes timed per device; the first is the one training defaults to there, and the curve's."""
MIB = 2**20


def matmul_shapes(device_type: str, quick: bool) -> list[tuple[int, int, int, bool]]:
    """``(m, k, n, skinny)`` to time: square, tall (4n x n x n) and skinny shapes.

    GPUs need larger sizes than CPUs to reach their peak, so their sweep goes further."""
    if device_type == "cuda":
        square = [64, 128, 256, 512, 1024, 2048, 4096] + ([] if quick else [8192])
        tall = [128, 512, 2048]
        skinny = [(16, 4096), (64, 4096)]
    elif quick:
        square = [32, 64, 128, 256, 512, 1024]
        tall = [32, 128, 512]
        skinny = [(8, 1024), (32, 1024)]
    else:
        square = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
        tall = [16, 32, 64, 128, 256, 512]
        skinny = [(8, 1024), (32, 1024), (128, 1024), (8, 2048), (32, 2048)]
    shapes = [(n, n, n, False) for n in square] + [(4 * n, n, n, False) for n in tall]
    shapes += [(m, n, n, True) for m, n in skinny]
    return sorted(shapes, key=lambda s: (2 * s[0] * s[1] * s[2], s))


def calibrate_device(
    device_type: str = "cpu",
    *,
    quick: bool = False,
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
    default_dtype_only: bool = False,
) -> DeviceCalibration:
    """Measure matmuls (every dtype the device trains in; ``default_dtype_only``: the one
    training defaults to, as on CPU the 16-bit ones take ~95% of a quick calibration),
    elementwise adds and the floor."""
    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    dtypes = _DTYPES["cuda" if device_type == "cuda" else "cpu"]
    dtypes = dtypes[:1] if default_dtype_only else dtypes
    repeats = 7 if quick else 11
    say = progress or (lambda _: None)
    with _threads(threads):
        say("kernel floor")
        one = torch.ones(1, device=device)
        raw_floor = time_call(lambda: torch.add(one, one), device, repeats=2 * repeats)
        floor = max(raw_floor, _training_floor(device, repeats))
        matmuls: list[MatmulPoint] = []
        for dtype in dtypes:
            say(f"matmul {dtype}")
            for m, k, n, skinny in matmul_shapes(device_type, quick):
                seconds = _time_matmul(m, k, n, dtype, device, repeats)
                matmuls.append(MatmulPoint(m, k, n, dtype, seconds, skinny))
        say("first-touch allocation")
        allocation = _allocation_cost(device, repeats) if device.type == "cpu" else 0.0
        say("elementwise bandwidth")
        bandwidth = [
            BandwidthPoint(size, _time_add(size, device, repeats))
            for size in _add_sizes(device_type, quick)
        ]
        say(f"fused attention {dtypes[0]}")
        attention = measure_attention(device, dtypes[0], quick=quick, repeats=repeats)
        op_rates, view_s = {}, 0.0
        if device.type == "cpu":  # a GPU's roofline prices them (op_rates module docstring)
            say("ops inside a training step")
            op_rates = measure_op_rates(device, floor)
            view_s = measure_view_seconds(device, repeats=repeats)
    return DeviceCalibration(
        device_type=device_type,
        threads=threads,
        curve_dtype=dtypes[0],
        matmuls=tuple(matmuls),
        bandwidth=tuple(bandwidth),
        kernel_floor_s=floor,
        allocation_s_per_byte=allocation,
        attention=tuple(attention),
        op_rates=op_rates,
        view_s=view_s,
    )


def _time_matmul(m: int, k: int, n: int, dtype: str, device: torch.device, repeats: int) -> float:
    """Mean time over the three layouts a training step runs a matmul in: ``x @ Wᵀ`` (a
    Linear's forward), ``dY @ W`` (its input gradient) and ``Xᵀ @ dY`` (its weight
    gradient). The transposed layouts run measurably slower than a plain ``a @ b``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    kind = _TORCH_DTYPES[dtype]
    a = torch.randn(m, k, generator=gen).to(device, kind)
    b = torch.randn(k, n, generator=gen).to(device, kind)
    b_rows = torch.randn(n, k, generator=gen).to(device, kind)  # a weight as stored: (out, in)
    a_cols = torch.randn(k, m, generator=gen).to(device, kind)
    # Operands are cycled through copies totalling past the last-level cache (64 MiB: twice
    # a 32 MiB L3, past an H100's 50 MB L2), as a model's weights and activations are when
    # each matmul runs once per step: hot in cache, a mid-sized CPU matmul ran ~20% faster
    # than the same shapes inside a training step (measured on the 2-core VM).
    copies = max(1, min(1024, (64 * MIB) // max((m * k + k * n + n * k + k * m) * 4, 1)))
    pool = [tuple(t.clone() for t in (a, b, b_rows, a_cols)) for _ in range(copies)]
    turn = itertools.cycle(pool)

    def run(layout: int) -> Callable[[], object]:
        def call() -> object:
            x, y, y_rows, x_cols = next(turn)
            if layout == 0:
                return torch.mm(x, y_rows.t())
            return torch.mm(x, y) if layout == 1 else torch.mm(x_cols.t(), y)

        return call

    with _tf32(device, dtype == "tf32"):
        return statistics.mean(time_call(run(i), device, repeats=repeats) for i in range(3))


def _add_sizes(device_type: str, quick: bool) -> list[int]:
    """Bytes per tensor: past the caches, at the sizes a training step's activations have."""
    if device_type == "cuda":
        return [s * MIB for s in ([64, 256] if quick else [16, 64, 256, 1024])]
    # Below glibc's 32 MiB mmap threshold: page faults are measured apart (allocation).
    return [s * MIB for s in ([1, 4, 16] if quick else [1, 2, 4, 8, 16])]


def _training_floor(device: torch.device, repeats: int, ops: int = 64) -> float:
    """Seconds per kernel of tiny ops inside a training step: a chain of ``ops`` one-element
    multiplications run forward and backward under autograd, divided by the kernels that
    ran (each op's forward and its backward). Autograd's bookkeeping per node is part of
    every op a training step runs, which a bare one-element add does not see."""
    x = torch.ones(1, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.backward()

    return time_call(step, device, repeats=repeats) / (2 * ops)


def _allocation_cost(device: torch.device, repeats: int) -> float:
    """Seconds per byte of writing a fresh tensor larger than glibc's mmap threshold, over
    writing an existing one: the first-touch page faults a CPU step pays for big tensors."""
    n = 64 * MIB // 4
    existing = torch.empty(n, device=device)
    fresh = time_call(lambda: torch.empty(n, device=device).fill_(1.0), device, repeats=repeats)
    reused = time_call(lambda: existing.fill_(1.0), device, repeats=repeats)
    return max(fresh - reused, 0.0) / (n * 4)


def _time_add(tensor_bytes: int, device: torch.device, repeats: int) -> float:
    """Seconds for the work of one "3-tensor" elementwise op at this size, from a mix of the
    memory-bound ops a training step runs: add, GELU, softmax, LayerNorm and their traffic.
    On a CPU core the transcendental ones are far slower per byte than an add, so an add
    alone would overstate what a model's elementwise ops get."""
    n = tensor_bytes // 4
    rows = max(n // 1024, 1)
    a = torch.ones(rows, 1024, device=device)
    b = torch.ones_like(a)
    ops = (  # (op, tensors it reads and writes)
        (lambda: torch.add(a, b), 3),
        (lambda: torch.nn.functional.gelu(a), 2),
        (lambda: torch.softmax(a, -1), 2),
        (lambda: torch.nn.functional.layer_norm(a, (1024,)), 2),
    )
    seconds = sum(time_call(f, device, repeats=repeats) for f, _ in ops)
    traffic = sum(t for _, t in ops)
    return seconds * 3 / traffic  # the time 3 tensors' worth of traffic takes


@contextmanager
def _threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` intra-op threads, as a torchrun-launched process would."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _tf32(device: torch.device, enabled: bool) -> Iterator[None]:
    """fp32 matmuls on tensor cores (tf32) or not; a no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
