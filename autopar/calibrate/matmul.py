"""Measure one device: matmul rates by size, elementwise bandwidth and the per-op floor.

The numbers are chosen so that the compute model (``cost_models/compute.py``), fed them,
predicts what was measured. It charges one kernel ::

    time = max(flops / (peak * efficiency(flops per call)), bytes / (bandwidth * memory_eff))
           + kernel_floor

so calibration inverts exactly that, net of the floor:

- ``kernel_floor_s`` is the time of a one-element add: dispatch (CPU) or launch (GPU).
- A matmul's busy time is its measured time minus the floor; its rate is FLOPs / busy time.
  ``peak_flops[dtype]`` is the best such rate, so every efficiency is in (0, 1] and "peak"
  means "achievable here", not the datasheet.
- ``matmul_efficiency_curve`` holds one ``(FLOPs per call, rate / peak)`` point per measured
  size (equal FLOP counts averaged), so ``flops / (peak * efficiency) + floor`` gives back
  each measured time; the model interpolates between points in log-FLOPs. Calls shorter
  than twice the floor are left out: their efficiency would be mostly timer noise, and the
  floor prices them anyway.
- ``matmul_efficiency`` is the curve's value at the largest size: the large-GEMM figure.
- ``memory_bandwidth_bytes_per_s`` is bytes / busy time of out-of-place elementwise adds
  (two reads and one write, as the bytes model counts them), with ``memory_efficiency`` 1.0.
- ``op_s_per_element`` (CPU): seconds per element of GELU, softmax, the norms and other
  ops whose arithmetic bounds them, measured inside a training step
  (:mod:`autopar.calibrate.op_rates`).
- ``attention_efficiency`` is the share of that curve's rate causal fused attention (SDPA)
  reaches on the tiles it runs, so the cost model's SDPA forward and backward give back the
  measured time (``autopar.calibrate.attention``).

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
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.calibrate.attention import (
    AttentionPoint,
    attention_efficiency_from,
    measure_attention,
    stored_bytes,
)
from autopar.calibrate.op_rates import measure_op_rates, measure_view_seconds
from autopar.core.cluster.spec import _FrozenMap
from autopar.cost_models.compute import curve_efficiency, matmul_flops

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_DTYPES = {"cpu": ["fp32", "bf16", "fp16"], "cuda": ["bf16", "fp16", "tf32", "fp32"]}
"""Dtypes timed per device; the first is the one training defaults to there, and the curve's."""
MIB = 2**20


@dataclass(frozen=True)
class MatmulPoint:
    """One timed ``(m, k) @ (k, n)`` in one dtype; ``skinny`` shapes stay out of the curve."""

    m: int
    k: int
    n: int
    dtype: str
    seconds: float
    skinny: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def bytes_moved(self) -> int:
        """Both operands read and the product written, as the cost model counts a matmul."""
        return stored_bytes(self.dtype) * (self.m * self.k + self.k * self.n + self.m * self.n)

    def rate(self, floor: float, memory_s: float = 0.0) -> float:
        """FLOP/s while busy: FLOPs over the measured time net of the kernel floor (and of
        ``memory_s``, the traffic the device does not hide under the arithmetic)."""
        return self.flops / max(self.seconds - floor - memory_s, 1e-12)

    def in_curve(self, floor: float) -> bool:
        """Whether the point shapes the curve: not skinny, and not dominated by the floor."""
        return not self.skinny and self.seconds >= 2 * floor


@dataclass(frozen=True)
class BandwidthPoint:
    """One timed out-of-place ``a + b`` on tensors of ``tensor_bytes`` each."""

    tensor_bytes: int
    seconds: float

    @property
    def bytes_moved(self) -> int:
        return 3 * self.tensor_bytes  # read a, read b, write the result

    def rate(self, floor: float) -> float:
        """Bytes/s while busy: bytes over the measured time net of the kernel floor."""
        return self.bytes_moved / max(self.seconds - floor, 1e-12)


@dataclass(frozen=True)
class DeviceCalibration:
    """What one device measured, and the profile ``device`` section it implies."""

    device_type: str
    threads: int
    curve_dtype: str
    matmuls: tuple[MatmulPoint, ...]
    bandwidth: tuple[BandwidthPoint, ...]
    kernel_floor_s: float
    allocation_s_per_byte: float = 0.0
    attention: tuple[AttentionPoint, ...] = ()
    op_rates: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    view_s: float = 0.0
    """Seconds per pass of an op without a kernel (CPU only: :mod:`autopar.calibrate.op_rates`)."""
    """Seconds per element of arithmetic-bound ops, forward and backward (CPU only:
    :mod:`autopar.calibrate.op_rates`)."""
    peak_flops: Mapping[str, float] = field(init=False)
    matmul_efficiency_curve: tuple[tuple[float, float], ...] = field(init=False)
    attention_efficiency: float | None = field(init=False)
    """Measured from ``attention`` (None without it: the preset's figure stays)."""
    attention_efficiency_curve: tuple[tuple[float, float], ...] = field(init=False)
    """One ``(score-matmul FLOPs, efficiency)`` point per attention size measured in the
    curve's dtype (written when there are two or more)."""
    memory_overlap: float = field(init=False)
    """Fitted from the skinny matmuls on a CPU (:func:`fit_memory_overlap`); 1 on a GPU."""

    @property
    def net_floor_s(self) -> float:
        """What a back-to-back call's measured time holds besides the work itself: the floor
        on the CPU, where dispatch and the op run one after the other; nothing on a GPU,
        where the host launches the next kernel while this one runs (measured on an H100:
        2048³ bf16 took 24.3 µs and 4096³ 183.7 µs against an 11.5 µs floor; net of the floor
        that would be 1,341 TFLOP/s at the small size, above the datasheet's 989)."""
        return 0.0 if self.device_type == "cuda" else self.kernel_floor_s

    def __post_init__(self) -> None:
        floor, net = self.kernel_floor_s, self.net_floor_s
        if not self.bandwidth or not any(
                p.in_curve(floor) for p in self.matmuls if p.dtype == self.curve_dtype):
            raise ValueError(
                "a device calibration needs elementwise adds, and matmuls in "
                f"{self.curve_dtype} that take longer than twice the kernel floor"
            )
        bandwidth = self.memory_bandwidth_bytes_per_s
        curve_points = [p for p in self.matmuls if p.dtype == self.curve_dtype]
        # Rates are net of the traffic the device does not overlap with arithmetic, and the
        # overlap is fitted against the curve those rates make: rounds settle both.
        overlap, previous = 1.0, -1.0
        for _ in range(50):
            apart = {id(p): (1.0 - overlap) * p.bytes_moved / bandwidth for p in self.matmuls}
            peaks = matmul_peaks(self.matmuls, floor, net, apart)
            curve = efficiency_curve(curve_points, peaks[self.curve_dtype], floor, net,
                                     memory_s=apart)
            if self.device_type == "cuda" or abs(overlap - previous) < 1e-9:
                break
            previous, overlap = overlap, fit_memory_overlap(
                curve_points, peaks[self.curve_dtype], curve, bandwidth, floor, net)
        object.__setattr__(self, "memory_overlap", overlap)
        object.__setattr__(self, "peak_flops", _FrozenMap(peaks))
        object.__setattr__(self, "matmul_efficiency_curve", curve)
        attention = attention_efficiency_from(self.attention, peaks, curve, net,
                                              (1.0 - overlap) / bandwidth)
        object.__setattr__(self, "attention_efficiency", attention)
        by_size: dict[float, list[float]] = {}
        for point in self.attention:
            if point.dtype == self.curve_dtype:
                one = attention_efficiency_from([point], peaks, curve, net,
                                                (1.0 - overlap) / bandwidth)
                if one is not None:
                    by_size.setdefault(float(matmul_flops(point.shape)), []).append(one)
        object.__setattr__(self, "attention_efficiency_curve", tuple(
            (flops, statistics.fmean(effs)) for flops, effs in sorted(by_size.items())))

    def efficiency(self, point: MatmulPoint) -> float:
        """A point's busy rate over its dtype's peak (skinny points fall far below 1)."""
        return min(1.0, point.rate(self.net_floor_s) / self.peak_flops[point.dtype])

    @property
    def memory_bandwidth_bytes_per_s(self) -> float:
        """Median over sizes: the typical rate, not the best case of a cache-sized tensor."""
        return statistics.median(p.rate(self.net_floor_s) for p in self.bandwidth)

    def profile_device(self) -> dict[str, Any]:
        """The profile's ``device`` section, in base units (see the module docstring)."""
        return {
            "peak_flops": dict(self.peak_flops),
            "matmul_efficiency": self.matmul_efficiency_curve[-1][1],
            "matmul_efficiency_curve": [list(p) for p in self.matmul_efficiency_curve],
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "memory_efficiency": 1.0,
            "kernel_floor_s": self.kernel_floor_s,
            "allocation_s_per_byte": self.allocation_s_per_byte,
            "memory_overlap": self.memory_overlap,
            **({"attention_efficiency": self.attention_efficiency}
               if self.attention_efficiency is not None else {}),
            **({"attention_efficiency_curve": [list(p) for p in
                                               self.attention_efficiency_curve]}
               if len(self.attention_efficiency_curve) > 1 else {}),
            **({"view_s": self.view_s} if self.view_s else {}),
            **({"op_s_per_element": {op: list(r) for op, r in self.op_rates.items()}}
               if self.op_rates else {}),
        }

    def attention_pass_efficiency(self, point: AttentionPoint) -> tuple[float, float]:
        """The attention efficiency the forward and the backward of ``point`` imply alone
        (recorded, not written: the profile's one figure reproduces their sum)."""
        peak = self.peak_flops[point.dtype]
        forward, backward = point.matmul_seconds(peak, self.matmul_efficiency_curve)
        floor = self.net_floor_s
        return (forward / max(point.forward_s - floor, 1e-12),
                backward / max(point.backward_s - floor, 1e-12))

    def measurements(self) -> dict[str, Any]:
        """Raw points for the profile's ``measurements`` section."""
        floor, net = self.kernel_floor_s, self.net_floor_s
        return {
            "one_element_add_seconds": floor,
            "allocation_seconds_per_byte": self.allocation_s_per_byte,
            "matmul": [
                {
                    "dtype": p.dtype,
                    "m": p.m,
                    "k": p.k,
                    "n": p.n,
                    "flops": p.flops,
                    "seconds": p.seconds,
                    # within the floor's noise, the net time (and its rate) means nothing
                    "busy_flops_per_s": p.rate(net) if p.seconds >= 2 * floor else None,
                    "skinny": p.skinny,
                    "in_curve": p.in_curve(floor),
                }
                for p in self.matmuls
            ],
            "elementwise_add": [
                {
                    "tensor_bytes": p.tensor_bytes,
                    "bytes_moved": p.bytes_moved,
                    "seconds": p.seconds,
                    "busy_bytes_per_s": p.rate(net),
                }
                for p in self.bandwidth
            ],
            "attention": [
                {
                    "kernel": "scaled_dot_product_attention, is_causal=True",
                    "dtype": p.dtype,
                    "batch": p.batch,
                    "heads": p.heads,
                    "seq": p.seq,
                    "head_dim": p.head_dim,
                    "forward_seconds": p.forward_s,
                    "forward_backward_seconds": p.forward_backward_s,
                    "forward_flops": p.forward_flops,  # the full square, as a trace counts
                    "backward_flops": p.backward_flops,
                    "causal_fraction": p.work,
                    **dict(zip(("forward_efficiency", "backward_efficiency"),
                               self.attention_pass_efficiency(p))),
                }
                for p in self.attention
                if p.dtype in self.peak_flops
            ],
        }


def efficiency_curve(
    points: list[MatmulPoint], peak: float, floor: float, net: float | None = None,
    memory_s: Mapping[int, float] | None = None,
) -> tuple[tuple[float, float], ...]:
    """``(flops, busy rate / peak)`` per distinct FLOP count among the points ``in_curve``,
    rising; equal counts are averaged. ``net`` is what a measured time holds besides the
    work (``DeviceCalibration.net_floor_s``; the floor when not given), ``memory_s`` the
    traffic each point (by ``id``) spends outside its arithmetic.

    Keeping every measured size (no smoothing) is what makes predictions reproduce the
    measurements; repeats and medians already took the noise out."""
    by_flops: dict[int, list[float]] = {}
    for point in points:
        if point.in_curve(floor):
            by_flops.setdefault(point.flops, []).append(point.rate(
                floor if net is None else net, (memory_s or {}).get(id(point), 0.0)))
    return tuple(
        (float(flops), min(1.0, statistics.fmean(rates) / peak))
        for flops, rates in sorted(by_flops.items())
    )


def matmul_peaks(points: tuple[MatmulPoint, ...], floor: float, net: float,
                 apart: Mapping[int, float]) -> dict[str, float]:
    """Each dtype's best busy rate over the curve's points, net of the floor and of the
    traffic left ``apart`` from the arithmetic (by point ``id``). Points whose traffic takes
    a quarter of their time or more are left out: netting them rests on all of that traffic
    coming from memory, while a small operand may be served from cache, which would make
    its arithmetic look faster than any large matmul ran."""
    peaks: dict[str, float] = {}
    for point in points:
        left = apart.get(id(point), 0.0)
        if point.in_curve(floor) and left < 0.25 * (point.seconds - net):
            peaks[point.dtype] = max(peaks.get(point.dtype, 0.0), point.rate(net, left))
    return peaks


def fit_memory_overlap(points: list[MatmulPoint], peak: float,
                       curve: tuple[tuple[float, float], ...], bandwidth: float,
                       floor: float, net: float) -> float:
    """The ``memory_overlap`` that makes the cost model give back the skinny matmuls' times:
    each point's arithmetic (at the curve's rate) and traffic (at ``bandwidth``) are both
    known, so its measured time says how much of the shorter one ran apart from the
    longer (``cost_models.compute.op_time``); the median over points, within [0, 1]. Skinny
    shapes are where it shows: their arithmetic is too short to hide their traffic. 1 (the
    roofline) when no skinny point outlasts twice the floor.

    On the project's 2-core EPYC VM a matmul of 32 rows against a 1024-square weight took
    1.67 ms where the roofline gives 0.88 (its arithmetic; its traffic 0.45): a core packs
    the operands and then computes, one after the other (measured, 2026-11-28)."""
    shares = []
    for point in points:
        if not point.skinny or point.seconds < 2 * floor:
            continue
        compute = point.flops / (peak * curve_efficiency(curve, point.flops))
        memory = point.bytes_moved / bandwidth
        apart = (point.seconds - net - max(compute, memory)) / max(min(compute, memory), 1e-12)
        shares.append(apart)
    if not shares:
        return 1.0
    return min(1.0, max(0.0, 1.0 - statistics.median(shares)))


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


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    repeats: int,
    batch_s: float = 0.005,
) -> float:
    """Median seconds per call: one warm-up, then ``repeats`` batches of back-to-back calls.

    Batching amortizes the timer and the device sync over enough calls to last ``batch_s``,
    so a microsecond op is timed as precisely as a second-long one."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(10_000, math.ceil(batch_s / once)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
