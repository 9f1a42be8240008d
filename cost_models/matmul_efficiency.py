"""The fraction of peak a matmul of a given shape reaches, and the shapes of matmuls.

The efficiency of a matmul depends on its shape, because a GPU runs a GEMM as a grid of
output tiles, one per thread block (CTA), spread over the streaming multiprocessors (SMs).
Large GEMMs saturate at ``device.matmul_efficiency`` (what cuBLAS reaches on big squares);
small or skinny ones fall below it for three reasons, each a factor in
:func:`matmul_efficiency`:

- **wave fill**: fewer tiles (times split-K slices) than SMs leaves SMs idle for the whole
  kernel (NVIDIA, "Matrix Multiplication Background User's Guide": wave quantization);
- **tile quantization**: an ``m`` or ``n`` that is not a multiple of the 128-wide tile
  computes padding (same guide: tile quantization);
- **K-loop depth**: each tile fills a multistage load pipeline before its first MMA, a fixed
  cost that a short ``k`` does not amortize.

When the device carries a measured ``matmul_efficiency_curve`` (``autopar calibrate``), it
replaces the parametric curve: efficiency is interpolated in log-FLOPs per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.core.cluster import DeviceSpec

TILE = 128
"""Edge of the output tile one CTA computes: 128x128 (or 128x256) is what cuBLAS/CUTLASS
pick for large bf16/fp16 GEMMs on Ampere and Hopper (CUTLASS default tile shapes)."""

DEFAULT_SM_COUNT = 108
"""SMs in one wave of tiles when the device does not say (``device.sm_count``): the A100's
108 (A100 whitepaper); an H100 SXM has 132, an MI300X 304 CUs."""

SPLIT_K_MIN = 512
"""Shortest K slice cuBLAS-style split-K keeps when too few output tiles fill the SMs: 16
main-loop iterations of a 32-deep K step, enough to amortize the slice's own pipeline fill
and the extra pass that sums partial tiles."""

K_PIPELINE_FILL = 64
"""K-depth equivalent of a tile's fixed cost: filling the multistage shared-memory pipeline
takes one global-memory round trip (~0.5-0.8 µs) before the first MMA, about two 32-deep
K-steps of a 128x128 tile (~0.36 µs each on an A100 SM: 2*128*128*32 FLOP at 312/108
TFLOP/s). Efficiency carries a factor k / (k + 64): 0.5 at k = 64, 0.98 at k = 4096."""


def sm_count(device: DeviceSpec) -> int:
    """Tiles in one wave: the device's SMs (CUs)."""
    return int(getattr(device, "sm_count", DEFAULT_SM_COUNT))


# --- Matmul shapes ------------------------------------------------------------------------
def matmul_dims(a_shape: Sequence[int], b_shape: Sequence[int]) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of ``torch.matmul(a, b)``: ``a`` is ``[..., m, k]``, ``b`` is
    ``[..., k, n]``, leading dims broadcast into the batch; a 1-D operand is a vector.

    >>> matmul_dims((8, 16, 512, 64), (8, 16, 64, 512))   # attention scores, 8x16 heads
    (128, 512, 512, 64)
    >>> matmul_dims((4096,), (4096, 1024))
    (1, 1, 1024, 4096)
    """
    a = list(a_shape) if len(a_shape) > 1 else [1, *a_shape]
    b = list(b_shape) if len(b_shape) > 1 else [*b_shape, 1]
    if a[-1] != b[-2]:
        raise ValueError(f"matmul of {tuple(a_shape)} and {tuple(b_shape)}: inner dims differ")
    batch_a, batch_b = a[:-2], b[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a = [1] * (width - len(batch_a)) + batch_a
    batch_b = [1] * (width - len(batch_b)) + batch_b
    batch = math.prod(max(x, y) for x, y in zip(batch_a, batch_b))
    return batch, a[-2], b[-1], a[-1]


def linear_dims(input_shape: Sequence[int], out_features: int) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of ``F.linear`` on ``input_shape``: every leading dim folds into
    ``m`` (one GEMM), ``k`` is the input feature dim, ``n`` the output features.

    >>> linear_dims((4, 2048, 4096), 11008)
    (1, 8192, 11008, 4096)
    """
    return 1, math.prod(input_shape[:-1]), out_features, input_shape[-1]


def matmul_flops(shape: Sequence[int]) -> float:
    """FLOPs of a matmul of ``shape`` = ``(m, n, k)`` or ``(batch, m, n, k)``: 2 per MAC."""
    batch, m, n, k = batched_dims(shape)
    return 2.0 * batch * m * n * k


def batched_dims(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """A matmul ``shape``, ``(m, n, k)`` or ``(batch, m, n, k)``, as ``(batch, m, n, k)``."""
    if len(shape) == 3:
        return (1, *shape)  # type: ignore[return-value]
    if len(shape) == 4:
        return tuple(shape)  # type: ignore[return-value]
    raise ValueError(f"a matmul shape is (m, n, k) or (batch, m, n, k), got {tuple(shape)}")


# --- Efficiency ---------------------------------------------------------------------------
def matmul_efficiency(
    device: DeviceSpec, shape: Sequence[int] | None = None, *, flops: float | None = None,
    loop_depth: int | None = None,
) -> float:
    """Fraction of peak a matmul reaches on ``device``.

    With a measured ``device.matmul_efficiency_curve``, the curve at this call's FLOPs
    (``2*batch*m*n*k``, or ``flops`` when no shape is known). Otherwise the parametric
    model when ``shape`` is known: ``matmul_efficiency * wave_fill * tile_use * k_depth``
    (see :func:`wave_fill`, :func:`tile_use`, :func:`k_depth`); with neither, the
    large-GEMM asymptote ``device.matmul_efficiency``. ``loop_depth`` replaces ``k`` in the
    K-loop term for a kernel whose tiles loop over something else: fused attention's
    query tile fills its load pipeline once and then sweeps every key block, so its depth
    is the key length, not the head dim its matmuls contract.

    >>> from autopar.core.cluster import load_cluster
    >>> dev = load_cluster("A100-80GB").device
    >>> matmul_efficiency(dev, (8192, 8192, 8192)) > 0.95 * dev.matmul_efficiency
    True
    >>> matmul_efficiency(dev, (16, 8192, 8192)) < 0.2 * dev.matmul_efficiency  # skinny
    True
    """
    curve = tuple(getattr(device, "matmul_efficiency_curve", ()) or ())
    per_call = matmul_flops(shape) if shape is not None else flops
    if curve and per_call:
        return curve_efficiency(curve, per_call)
    if shape is None:
        return device.matmul_efficiency
    batch, m, n, k = batched_dims(shape)
    return (
        device.matmul_efficiency
        * wave_fill(batch, m, n, k, sm_count(device))
        * tile_use(m, n)
        * k_depth(loop_depth or k)
    )


def best_efficiency(device: DeviceSpec) -> float:
    """The highest fraction of peak any op reaches in this model on ``device`` (the measured
    curve's best point, else the large-GEMM asymptote): ``flops / (peak * best_efficiency)``
    bounds a step's compute from below.

    >>> from autopar.core.cluster import load_cluster
    >>> best_efficiency(load_cluster("A100-80GB").device)
    0.75
    """
    curve = tuple(getattr(device, "matmul_efficiency_curve", ()) or ())
    return max((point[1] for point in curve), default=device.matmul_efficiency)


def wave_fill(batch: int, m: int, n: int, k: int, sms: int) -> float:
    """Fraction of SMs a matmul keeps busy: its output tiles (times split-K slices when the
    tiles alone are too few) over one wave of ``sms``; 1 once a full wave is in flight.

    >>> wave_fill(1, 1024, 1024, 1024, 108)   # 64 tiles x 2 slices of K
    1.0
    >>> round(wave_fill(1, 512, 512, 256, 108), 3)   # 16 tiles, K too short to split
    0.148
    """
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    if tiles >= sms:
        return 1.0
    slices = max(1, min(math.ceil(sms / tiles), k // SPLIT_K_MIN))
    return min(1.0, tiles * slices / sms)


def tile_use(m: int, n: int) -> float:
    """Useful fraction of the tiles computed: an ``m`` or ``n`` short of a multiple of the
    128-wide tile computes padding (tile quantization).

    >>> tile_use(4096, 4096), tile_use(64, 4096), round(tile_use(4097, 4096), 3)
    (1.0, 0.5, 0.97)
    """
    return (m / (math.ceil(m / TILE) * TILE)) * (n / (math.ceil(n / TILE) * TILE))


def k_depth(k: int) -> float:
    """Share of a tile's time spent in its K loop rather than filling the load pipeline.

    >>> k_depth(64), round(k_depth(4096), 3)
    (0.5, 0.985)
    """
    return k / (k + K_PIPELINE_FILL)


def curve_efficiency(curve: Sequence[tuple[float, float]], flops: float) -> float:
    """Efficiency at ``flops`` per call on a measured curve of ``(flops, efficiency)`` points
    (FLOPs rising), linear in log-FLOPs between points and flat beyond the ends.

    >>> round(curve_efficiency(((1e6, 0.1), (1e9, 0.7)), 1e7), 9)
    0.3
    """
    points = sorted(curve)
    if flops <= points[0][0]:
        return points[0][1]
    if flops >= points[-1][0]:
        return points[-1][1]
    x = math.log(flops)
    for (f0, e0), (f1, e1) in zip(points, points[1:]):
        if flops <= f1:
            t = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
            return e0 + t * (e1 - e0)
    return points[-1][1]  # unreachable: flops < points[-1][0] was checked
