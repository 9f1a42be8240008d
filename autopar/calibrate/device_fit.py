"""What one device measured, and the numbers it implies for the compute model.

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

The timings come from :func:`autopar.calibrate.matmul.calibrate_device`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.calibrate.attention import AttentionPoint, attention_efficiency_from, stored_bytes
from autopar.core.cluster.checks import _FrozenMap
from autopar.cost_models.matmul_efficiency import curve_efficiency, matmul_flops


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
