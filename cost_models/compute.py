"""Compute time of one op on one device: a roofline with a shape-aware matmul efficiency and a
per-kernel floor.

An op takes the longer of its FLOPs at the rate a matmul of its shape reaches and its bytes
at the bandwidth streaming kernels reach, plus what of the shorter the device does not
overlap, plus a fixed floor per kernel launched:

    compute = flops / (peak(dtype) * efficiency(shape))
    memory = bytes / (memory_bandwidth * memory_efficiency)
    time = max(compute, memory) + (1 - memory_overlap) * min(compute, memory)
           + kernels * kernel_floor

``memory_overlap`` is 1 on GPUs (the roofline) and fitted on CPUs, where one core packs a
GEMM's operands and then runs its micro-kernel on them (``DeviceSpec.memory_overlap``).

Ops without FLOPs (elementwise, norms, softmax) are memory-bound; an op that neither computes
nor moves bytes (a view, a reshape) launches no kernel and costs nothing.

How far below peak a matmul of a given shape runs (wave fill, tile quantization, K-loop
depth, or a measured curve) is :mod:`autopar.cost_models.matmul_efficiency`.

>>> from autopar.core.cluster import load_cluster
>>> dev = load_cluster("8xA100-80GB").device
>>> big = op_time(2 * 8192**3, 3 * 8192**2 * 2, dev, "bf16", shape=(8192, 8192, 8192))
>>> small = op_time(2 * 256**3, 3 * 256**2 * 2, dev, "bf16", shape=(256, 256, 256))
>>> 2 * 256**3 / small < 0.2 * (2 * 8192**3 / big)   # small matmuls run far below peak
True
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.core.cluster import DeviceSpec
from autopar.core.cluster.presets import (
    DEFAULT_ATTENTION_EFFICIENCY,
    DEFAULT_KERNEL_FLOOR_S,
    DEFAULT_MEMORY_EFFICIENCY,
)
from autopar.cost_models.matmul_efficiency import (
    batched_dims,
    curve_efficiency,
    matmul_efficiency,
    matmul_flops,
)

# --- Backward -----------------------------------------------------------------------------
BACKWARD_BYTES_FACTOR = 2.0
"""Bytes a memory-bound op's backward moves relative to its forward, where the trace did not
measure them (``NodeFacts.bwd_bytes``: an op it could not replay) or a fused chain runs it:
the backward of an elementwise op reads the output gradient and the saved input and writes
the input gradient (3 tensors against the forward's 2), and a norm's backward adds
reductions for its weight gradients; 2x covers both."""


def peak_flops(device: DeviceSpec, dtype: str) -> float:
    """Dense peak FLOP/s of ``device`` in ``dtype`` (fp32, tf32, bf16, fp16, fp8); an
    unsupported dtype raises the cluster's error rather than guessing."""
    return device.peak(dtype)


def kernel_floor(device: DeviceSpec) -> float:
    """Seconds no kernel beats on ``device`` (the presets' default where a device-like object
    does not say)."""
    return float(getattr(device, "kernel_floor_s", DEFAULT_KERNEL_FLOOR_S))


def compute_share(device: DeviceSpec) -> float:
    """The share of its speed the device gets beside its node's other devices (CPU processes
    outnumbering cores: ``Cluster.cores_per_node``); every device time divides by it."""
    return float(getattr(device, "compute_share", 1.0))


def memory_overlap(device: DeviceSpec) -> float:
    """How much of an op's memory time its arithmetic hides (``DeviceSpec.memory_overlap``):
    1 on GPUs (the roofline's max), 0 where a core moves operands and then computes."""
    return float(getattr(device, "memory_overlap", 1.0))


def memory_efficiency(device: DeviceSpec) -> float:
    """Fraction of the datasheet memory bandwidth that streaming kernels reach."""
    return float(getattr(device, "memory_efficiency", DEFAULT_MEMORY_EFFICIENCY))


# --- Times --------------------------------------------------------------------------------
def attention_efficiency(device: DeviceSpec, shape: Sequence[int] | None = None) -> float:
    """Share of the matmul rate fused attention reaches on ``device``, on the FLOPs the
    kernel runs (for a causal mask about half the square the trace counts:
    :func:`causal_fraction`). The softmax, its exponentials and the online rescaling sit
    between the two matmuls, so it is below 1; how far below depends on the kernel
    (FlashAttention-2 is an Ampere kernel: on an H100 it reaches about half the share it
    reaches on an A100). ``device.attention_efficiency`` says it: the presets' sources are in
    ``autopar/core/cluster/presets.py``; ``autopar calibrate`` measures it.

    With a measured ``device.attention_efficiency_curve`` and the score matmul's ``shape``
    (``(batch*heads*seq, seq, head_dim)``), the curve at that matmul's FLOPs: a CPU core's
    flash kernel reaches less of the matmul rate at a short sequence than at a long one.

    >>> from autopar.core.cluster import load_cluster
    >>> attention_efficiency(load_cluster("H100-80GB").device)
    0.4
    """
    curve = tuple(getattr(device, "attention_efficiency_curve", ()) or ())
    if curve and shape is not None:
        return curve_efficiency(curve, matmul_flops(shape))
    return float(getattr(device, "attention_efficiency", DEFAULT_ATTENTION_EFFICIENCY))


ATTENTION_BLOCK = 128
"""Query and key rows a fused attention kernel takes per tile (FlashAttention's 128)."""


def causal_fraction(seq: int, block: int = ATTENTION_BLOCK) -> float:
    """Share of a causal ``seq x seq`` attention's score tiles a fused kernel computes: it
    skips the tiles above the diagonal (FlashAttention, the generated kernels, PyTorch's
    flash kernels with ``is_causal``) and runs the diagonal ones whole. The FLOPs a trace
    counts (``FlopCounterMode``) are the full square's; model FLOPs keep them, as
    Megatron-LM's and PaLM's MFU formulas do.

    >>> causal_fraction(8192), causal_fraction(100)
    (0.5078125, 1.0)
    """
    tiles = max(1, -(-seq // block))
    return (tiles + 1) / (2 * tiles)

# glibc maps an allocation above its mmap threshold fresh from the OS, and the threshold
# adapts up to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): on a CPU, only tensors past
# that size pay first-touch page faults on every step.
ALLOCATION_THRESHOLD_BYTES = 32 * 2**20


def allocation_time(new_bytes: float, device: DeviceSpec) -> float:
    """Seconds to write a freshly allocated tensor of ``new_bytes`` the first time."""
    per_byte = float(getattr(device, "allocation_s_per_byte", 0.0) or 0.0)
    if per_byte <= 0 or new_bytes < ALLOCATION_THRESHOLD_BYTES:
        return 0.0
    return new_bytes * per_byte / compute_share(device)


def op_time(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: str,
    *,
    shape: Sequence[int] | None = None,
    kernels: int = 1,
    efficiency_scale: float = 1.0,
    loop_depth: int | None = None,
) -> float:
    """Seconds for an op doing ``flops`` and moving ``bytes_moved`` in ``kernels`` launches.

    ``shape`` is the matmul's ``(m, n, k)`` or ``(batch, m, n, k)`` when the op is one (it
    sets the efficiency; ``flops`` stays authoritative for the work). Without it the large-GEMM
    efficiency applies, or the measured curve at ``flops / kernels`` per call.
    ``efficiency_scale`` multiplies that efficiency for kernels that reach less of peak than a
    GEMM (fused attention: :func:`attention_efficiency`), ``loop_depth`` the depth of their
    tiles' main loop (:func:`matmul_efficiency`).

    >>> from autopar.core.cluster import load_cluster
    >>> dev = load_cluster("H100-80GB").device
    >>> op_time(0, 0, dev, "bf16")   # a view: no kernel
    0.0
    >>> op_time(0, 1024, dev, "bf16") == kernel_floor(dev) + 1024 / (
    ...     dev.memory_bandwidth_bytes_per_s * memory_efficiency(dev))
    True
    """
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    compute = 0.0
    if flops > 0:
        per_call = flops / max(kernels, 1)
        rate = (peak_flops(device, dtype) * efficiency_scale
                * matmul_efficiency(device, shape, flops=per_call, loop_depth=loop_depth))
        if dtype == "fp8":  # fp8 GEMMs reach less of their peak than bf16's do of theirs
            rate *= float(getattr(device, "fp8_matmul_efficiency", 1.0))
        compute = flops / rate
    memory = 0.0
    if bytes_moved > 0:
        memory = bytes_moved / (device.memory_bandwidth_bytes_per_s * memory_efficiency(device))
    busy = max(compute, memory) + (1.0 - memory_overlap(device)) * min(compute, memory)
    return (busy + kernels * kernel_floor(device)) / compute_share(device)


def attention_time(
    flops: float, bytes_moved: float, device: DeviceSpec, dtype: str,
    *, shape: Sequence[int] | None = None, kernel_speed: float = 1.0,
) -> float:
    """Seconds of one pass of a fused attention kernel: :func:`op_time` at the device's
    :func:`attention_efficiency`, with ``shape`` one of its two matmuls' ``(m, n, k)``. A
    query tile fills its load pipeline once and then sweeps every key, so its loop depth is
    the key length (``n`` of the scores matmul, ``k`` of the one that weights the values),
    not the head dim they contract. ``kernel_speed``: the kernel that runs against the one
    ``attention_efficiency`` describes (``DeviceSpec.generated_attention_forward``).

    >>> from autopar.core.cluster import load_cluster
    >>> dev = load_cluster("H100-80GB").device
    >>> f = 4 * 32 * 8192 * 8192 * 128
    >>> attention_time(f, 0, dev, "bf16", shape=(32 * 8192, 8192, 128)) == attention_time(
    ...     f, 0, dev, "bf16", shape=(32 * 8192, 128, 8192))
    True
    """
    depth = max(shape[-2], shape[-1]) if shape is not None else None
    return op_time(flops, bytes_moved, device, dtype, shape=shape,
                   efficiency_scale=attention_efficiency(device, shape) * kernel_speed,
                   loop_depth=depth)


def aten_name(target: str) -> str:
    """The op name ``op_s_per_element`` is keyed by: ``"aten.gelu.default"`` -> ``"gelu"``
    (a target outside aten is its own name).

    >>> aten_name("aten.layer_norm.default"), aten_name("mylib.op")
    ('layer_norm', 'mylib.op')
    """
    parts = target.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else target


def bias_times(elements: float, device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds a matmul's bias adds on ``elements`` outputs: the
    broadcast written into its fresh output before the GEMM accumulates (CPU ``addmm``),
    and the sum over rows into its gradient, at the device's measured rates for a
    broadcast ``add`` (``op_s_per_element``); (0, 0) without one (a GPU's GEMM adds the
    bias in its epilogue)."""
    rates = getattr(device, "op_s_per_element", None) or {}
    rate = rates.get("add")
    if rate is None or elements <= 0:
        return 0.0, 0.0
    return elements * rate[0] / compute_share(device), elements * rate[1] / compute_share(device)


def arithmetic_times(target: str, elements: float, device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds op ``target`` spends computing ``elements`` outputs at the
    device's measured per-element rates (``DeviceSpec.op_s_per_element``), one kernel each;
    (0, 0) for an op the device has no rate for (the roofline prices it alone). A cost is
    the larger of this and the roofline's: on a CPU core GELU's erf or a norm's reductions
    bound the op, not its traffic.

    >>> from autopar.core.cluster import load_cluster
    >>> dev = load_cluster({"name": "c", "nodes": 1, "devices_per_node": 1, "device": {
    ...     "preset": "cpu", "kernel_floor_us": 0, "op_ns_per_element": {"gelu": [2, 3]}}})
    >>> [round(t * 1e6, 6) for t in arithmetic_times("aten.gelu.default", 1e6, dev.device)]
    [2000.0, 3000.0]
    """
    rates = getattr(device, "op_s_per_element", None) or {}
    rate = rates.get(aten_name(target))
    if rate is None or elements <= 0:
        return 0.0, 0.0
    floor = kernel_floor(device)
    return ((elements * rate[0] + floor) / compute_share(device),
            (elements * rate[1] + floor) / compute_share(device))


# An op's forward, and its recomputation in backward (activation checkpointing: the same
# kernels on the same shapes), cost what :func:`op_time` says.
forward_time = op_time
recompute_time = op_time


def backward_time(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: str,
    *,
    shape: Sequence[int] | None = None,
    kernels: int = 1,
    input_grad: bool = True,
    weight_grad: bool = True,
    efficiency_scale: float = 1.0,
) -> float:
    """Seconds of an op's backward, from its *forward* ``flops``, ``bytes_moved`` and shape.

    A matmul ``Y[m,n] = X[m,k] W[k,n]`` has two backward matmuls with the forward's FLOPs:
    ``dX = dY Wᵀ`` of shape ``(m, k, n)`` and ``dW = Xᵀ dY`` of shape ``(k, n, m)``, each
    reading two operands and writing one as large as the forward's. ``input_grad`` /
    ``weight_grad`` drop one of them (a frozen weight needs no ``dW``; the first layer's
    input needs no ``dX``) — they are also the B and W passes of zero-bubble pipelines.
    Without a shape: 2x FLOPs and bytes in 2x kernels. A memory-bound op (no FLOPs) moves
    ``BACKWARD_BYTES_FACTOR`` times its bytes in as many kernels.

    >>> from autopar.core.cluster import load_cluster
    >>> dev = load_cluster("A100-80GB").device
    >>> f = forward_time(2 * 4096**3, 3 * 4096**2 * 2, dev, "bf16", shape=(4096,) * 3)
    >>> b = backward_time(2 * 4096**3, 3 * 4096**2 * 2, dev, "bf16", shape=(4096,) * 3)
    >>> round(b / f, 6)
    2.0
    """
    if flops <= 0:
        return op_time(0.0, BACKWARD_BYTES_FACTOR * bytes_moved, device, dtype, kernels=kernels)
    passes = int(input_grad) + int(weight_grad)
    if passes == 0:
        return 0.0
    if shape is None:
        return op_time(
            passes * flops, passes * bytes_moved, device, dtype, kernels=passes * kernels,
            efficiency_scale=efficiency_scale,
        )
    batch, m, n, k = batched_dims(shape)
    total = 0.0
    if input_grad:
        total += op_time(flops, bytes_moved, device, dtype, shape=(batch, m, k, n),
                         kernels=kernels, efficiency_scale=efficiency_scale)
    if weight_grad:
        total += op_time(flops, bytes_moved, device, dtype, shape=(batch, k, n, m),
                         kernels=kernels, efficiency_scale=efficiency_scale)
    return total


def efficiency_from_measurement(
    flops: float, seconds: float, device: DeviceSpec, dtype: str, *, kernels: int = 1
) -> float:
    """The matmul efficiency a measured call implies, net of the kernel floor: the inverse of
    :func:`op_time` for compute-bound calls, so a calibrated ``matmul_efficiency_curve``
    plugged back into :func:`op_time` reproduces the measured time.

    >>> from autopar.core.cluster import load_cluster
    >>> dev = load_cluster("A100-80GB").device
    >>> t = op_time(2 * 4096**3, 0, dev, "bf16", shape=(4096,) * 3)
    >>> e = efficiency_from_measurement(2 * 4096**3, t, dev, "bf16")
    >>> round(e / matmul_efficiency(dev, (4096,) * 3), 9)
    1.0
    """
    busy = seconds - kernels * kernel_floor(device)
    if busy <= 0:
        raise ValueError(
            f"{seconds:.3g} s is not longer than the kernel floor of {kernels} kernel(s) "
            f"({kernels * kernel_floor(device):.3g} s); measure a larger matmul"
        )
    return min(1.0, flops / (busy * peak_flops(device, dtype)))


# Bytes of memory traffic per trainable parameter in one optimizer step (fp32 states,
# elementwise kernels): AdamW's foreach step runs about a dozen passes (decay, two moment
# updates, bias corrections, sqrt, division, the update) over 4-byte tensors, ~96 B/param
# (measured on this project's CI machine: 5 ns/param at its ~19 GB/s); momentum SGD reads
# weight, gradient and buffer and writes two (20 B); plain SGD 12 B; Adafactor's factored
# statistics cost about as much as Adam's; 8-bit Adam adds (de)quantization to Adam's passes.
# Fused Adam/AdamW (``fused=True``: one kernel reads weight, gradient and both moments and
# writes weight and moments) moves 28 B/param, its floor; measured on an H200: 1.5 B
# parameters in 13.1 ms, 3.2 TB/s (benchmarks/results/h200_2026-11-29.md).
OPTIMIZER_STEP_BYTES = {"adamw": 96, "adam": 96, "adamw_fused": 28, "adam_fused": 28,
                        "momentum": 20, "sgd": 12, "adafactor": 96, "adam8bit": 112}


def optimizer_step_time(numel: float, optimizer: str, device: DeviceSpec) -> float:
    """Seconds of one optimizer step over ``numel`` trainable parameters on ``device``."""
    per_param = OPTIMIZER_STEP_BYTES.get(optimizer, OPTIMIZER_STEP_BYTES["adamw"])
    if numel <= 0:
        return 0.0
    return numel * per_param / (device.memory_bandwidth_bytes_per_s * memory_efficiency(device)
                                * compute_share(device))
