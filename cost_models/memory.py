"""Memory per device: model states (ZeRO accounting), communication buffers, and the
breakdown a plan reports.

Model states follow the ZeRO paper (Rajbhandari et al., SC'20, §3.1): with mixed precision and
Adam, each parameter costs 2 bytes (16-bit weights) + 2 (16-bit gradients) + K = 12 (fp32
master weights 4, momentum 4, variance 4); in fp32, 4 + 4 + 8 (the weights are their own
master copy). ZeRO stage 1 divides the optimizer states (master weights included) over the
data-parallel group, stage 2 also the gradients, stage 3 also the weights:

    stage 0: 2Ψ + 2Ψ + KΨ     stage 1: 2Ψ + 2Ψ + KΨ/N
    stage 2: 2Ψ + (2+K)Ψ/N    stage 3: (2+2+K)Ψ/N

Optimizer state bytes per trainable parameter (fp32 states, on top of the master copy):

=========== ============================================================================
sgd         0 (plain SGD keeps nothing)
momentum    4 (one fp32 velocity)
adam/adamw  8 (fp32 first and second moments); adam_fused/adamw_fused (fused=True) alike
adam8bit    2 + 2*4/2048: both moments in 8 bits, each with one fp32 absmax per block of
            2048 values (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
            ICLR'22; bitsandbytes' default block size)
adafactor   shape-dependent (:func:`adafactor_state_bytes`): a factored second moment,
            ``r + c`` fp32 numbers for an ``r x c`` weight, and no first moment by default
            (Shazeer & Stern 2018; ``beta1=None`` in HF transformers and torch.optim)
=========== ============================================================================

Frozen parameters (LoRA/QLoRA bases) have weights only, stored in 16, 8 or 4 bits.

CPU offload moves states off the device, and this module reports them as host bytes so a
report can show host memory: ``optimizer`` (ZeRO-Offload, DeepSpeed ``offload_optimizer``)
moves the optimizer states -- and, with ZeRO >= 2, the gradient partition the CPU optimizer
steps on; ``optimizer+params`` (ZeRO-Infinity ``offload_param``, FSDP2 ``CPUOffloadPolicy``)
also moves the sharded weights, which the device then only holds while gathered (buffers).

>>> s = model_state_bytes(1_000_000, trainable=True, precision="bf16", optimizer="adamw",
...                       zero_stage=0, dp=8)
>>> s.params, s.grads, s.optimizer
(2000000.0, 2000000.0, 12000000.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.core.knobs import OPTIMIZERS

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""fp8 trains with bf16 working weights (only the linears' operands are fp8)."""

ADAM8BIT_BLOCK_SIZE = 2048
"""Values per quantization block of 8-bit Adam's states (bitsandbytes' default, Dettmers et
al. ICLR'22 §2)."""


def adam8bit_state_bytes(block_size: int = ADAM8BIT_BLOCK_SIZE) -> float:
    """Bytes per parameter of 8-bit Adam: two 1-byte moments, each with an fp32 scale per
    ``block_size`` values.

    >>> adam8bit_state_bytes(2048)
    2.00390625
    """
    return 2 * (1 + 4 / block_size)


# Optimizer state bytes per trainable parameter (fp32 states), not counting master weights,
# for the optimizers whose state is a fixed number of bytes per element.
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adamw": 8,
    "adam": 8,
    "adamw_fused": 8,  # torch.optim.AdamW(fused=True): the same states, one kernel a step
    "adam_fused": 8,
    "momentum": 4,
    "sgd": 0,
    "adam8bit": adam8bit_state_bytes(),
}
assert OPTIMIZERS == (*OPTIMIZER_STATE_BYTES, "adafactor")  # Adafactor's: shape-dependent

OFFLOADS = ("none", "optimizer", "optimizer+params")
STORAGE_BITS = (32, 16, 8, 4)

REPORT_FRAGMENTATION = 0.1
"""A fragmentation allowance for reports: PyTorch's caching allocator typically reserves
5-20% above live tensor bytes in LLM training (block rounding to 512 B / 2 MiB segments,
freed blocks that do not fit the next request); ``torch.cuda.memory_reserved`` vs
``memory_allocated`` shows it. Planning uses 0 (live bytes), reports may add this."""


def weight_bytes(precision: str) -> int:
    """Bytes of the working copy of one weight (and of one gradient)."""
    _check_precision(precision)
    return 4 if precision == "fp32" else 2


def activation_bytes_per_element(precision: str) -> int:
    """Bytes of one activation element under ``precision`` (autocast keeps activations in the
    16-bit type)."""
    return weight_bytes(precision)


def master_weight_bytes(precision: str) -> int:
    """Mixed precision keeps an fp32 master copy for the optimizer."""
    return 0 if precision == "fp32" else 4


def storage_bytes(bits: int) -> float:
    """Bytes per frozen weight stored in ``bits`` (16, 8 or 4 for LoRA/QLoRA bases; 32).

    >>> storage_bytes(4), storage_bytes(16)
    (0.5, 2.0)
    """
    if bits not in STORAGE_BITS:
        raise ValueError(f"storage_bits must be one of {STORAGE_BITS}, got {bits!r}")
    return bits / 8


def quantized_weight_bytes(
    numel: float, bits: int, *, block_size: int | None = None, scale_bits: int = 32
) -> float:
    """Bytes of ``numel`` weights quantized to ``bits``, with one ``scale_bits`` scale per
    ``block_size`` weights when the format has block scales (QLoRA's NF4: blocks of 64 with
    fp32 absmax, Dettmers et al. 2023 §3; its double quantization shrinks the scales to 8
    bits plus a second-level fp32 per 256 scales -- pass ``scale_bits`` to match).

    >>> quantized_weight_bytes(64, 4, block_size=64)
    36.0
    """
    scales = 0.0 if block_size is None else math.ceil(numel / block_size) * scale_bits / 8
    return numel * storage_bytes(bits) + scales


def lora_params(in_features: int, out_features: int, rank: int) -> int:
    """Trainable parameters of a LoRA adapter on an ``in -> out`` linear: ``A`` is
    ``rank x in`` and ``B`` is ``out x rank`` (Hu et al. 2021).

    >>> lora_params(4096, 4096, 16)
    131072
    """
    return rank * (in_features + out_features)


def adafactor_state_bytes(
    shape: Sequence[int], *, first_moment: bool = False, factored: bool = True
) -> float:
    """Bytes of Adafactor's fp32 state for one parameter of ``shape``.

    A parameter with two or more dims keeps its second moment factored over the last two:
    a row and a column vector per leading index, ``prod(shape[:-2]) * (r + c)`` numbers
    instead of ``r * c``; vectors keep it whole. ``first_moment`` adds a full fp32 momentum
    (``beta1`` set). Shazeer & Stern 2018, §3; HF ``transformers.Adafactor``.

    >>> adafactor_state_bytes((4096, 4096)), adafactor_state_bytes((4096,))
    (32768.0, 16384.0)
    """
    numel = math.prod(shape)
    if factored and len(shape) >= 2:
        second = math.prod(shape[:-2]) * (shape[-2] + shape[-1])
    else:
        second = numel
    return 4.0 * (second + (numel if first_moment else 0))


def optimizer_state_bytes(
    numel: float, optimizer: str, *, shape: Sequence[int] | None = None
) -> float:
    """Bytes of ``optimizer``'s state for ``numel`` trainable parameters (master weights not
    included). Adafactor needs the parameter's ``shape`` to factor; without one it is
    counted unfactored (4 B/param), an upper bound."""
    if optimizer == "adafactor":
        if shape is None:
            return 4.0 * numel
        return adafactor_state_bytes(shape) * numel / math.prod(shape)
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    return numel * OPTIMIZER_STATE_BYTES[optimizer]


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one device holds (``params``, ``grads``, ``optimizer``) and what
    CPU offload keeps in host memory for it instead (``host_*``)."""

    params: float
    grads: float
    optimizer: float
    host_params: float = 0.0
    host_grads: float = 0.0
    host_optimizer: float = 0.0

    @property
    def total(self) -> float:
        """Bytes on the device."""
        return self.params + self.grads + self.optimizer

    @property
    def host_total(self) -> float:
        """Bytes in host memory (offloaded)."""
        return self.host_params + self.host_grads + self.host_optimizer


def model_state_bytes(
    numel: float,
    *,
    trainable: bool,
    precision: str,
    optimizer: str,
    zero_stage: int,
    dp: int,
    shape: Sequence[int] | None = None,
    offload: str = "none",
    storage_bits: int | None = None,
    fp32_params: bool = False,
    fp32_grads: bool = False,
) -> StateBytes:
    """Bytes one device holds for ``numel`` parameters (already divided by tensor parallelism).

    ``shape`` is the (local) parameter shape, used by Adafactor. ``offload`` moves states to
    host memory (see the module docstring; it needs ZeRO >= 1, and ``optimizer+params``
    needs ZeRO 3). ``storage_bits`` is how a *frozen* weight is stored (16, 8, 4; default:
    the working precision). ``fp32_params``: mixed precision as autopar runs it (and
    ``torch.amp``, FSDP2's ``MixedPrecisionPolicy``): the parameter itself is the fp32
    master copy, its gradient is fp32, and the 16-bit working copies are made per use
    (priced as activations, or as ZeRO-3's gathered buffers) -- 4 + 4 + optimizer bytes.
    ``fp32_grads``: 16-bit weights with fp32 gradients (Megatron-LM's main grads under bf16,
    FSDP2's fp32 ``reduce_dtype``) -- 2 + 4 + 12 bytes with Adam, rather than ZeRO's 2 + 2 + 12.

    >>> s = model_state_bytes(10, trainable=True, precision="bf16", optimizer="adam",
    ...                       zero_stage=2, dp=2, offload="optimizer")
    >>> s.total, s.host_total   # 16-bit weights stay; grads and 12 B/param go to the host
    (20.0, 70.0)
    """
    _check_precision(precision)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    _check_offload(offload, zero_stage)
    if storage_bits is not None and trainable:
        raise ValueError(
            "storage_bits applies to frozen weights only (trainable weights are stored in the "
            "working precision); pass trainable=False for a quantized base"
        )
    master = fp32_params and storage_bits is None
    w = 4 if master else (weight_bytes(precision) if storage_bits is None
                          else storage_bytes(storage_bits))
    params = numel * w / (dp if zero_stage >= 3 else 1)
    grads = optimizer_bytes = 0.0
    if trainable:
        grad_word = 4 if master or fp32_grads else weight_bytes(precision)
        grads = numel * grad_word / (dp if zero_stage >= 2 else 1)
        masters = 0 if master else master_weight_bytes(precision)
        opt_per = numel * masters + optimizer_state_bytes(numel, optimizer, shape=shape)
        optimizer_bytes = opt_per / (dp if zero_stage >= 1 else 1)
    if offload == "none":
        return StateBytes(float(params), float(grads), float(optimizer_bytes))
    host_grads = grads if zero_stage >= 2 else 0.0
    host_params = params if offload == "optimizer+params" else 0.0
    return StateBytes(
        float(params - host_params),
        float(grads - host_grads),
        0.0,
        host_params=float(host_params),
        host_grads=float(host_grads),
        host_optimizer=float(optimizer_bytes),
    )


# --- Communication buffers ---------------------------------------------------------------
DDP_BUCKET_CAP_MB = 25.0
"""torch DDP's default ``bucket_cap_mb`` (MiB per gradient bucket)."""

DDP_FIRST_BUCKET_MB = 1.0
"""torch DDP's first bucket is capped at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) so the
first all-reduce starts early."""


def ddp_buffer_bytes(
    grad_bytes: float,
    *,
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB,
    gradient_as_bucket_view: bool = False,
) -> float:
    """Bytes torch DDP's reducer allocates beyond the gradients themselves.

    DDP copies every gradient into flat all-reduce buckets that together cover all
    parameters, so by default it holds a second copy of the gradients, whatever the bucket
    size; ``gradient_as_bucket_view=True`` makes the gradients views into the buckets and
    saves exactly "the total gradients size" (torch DDP docstring). ``bucket_cap_mb`` only
    splits the copy into :func:`ddp_bucket_count` pieces.

    >>> ddp_buffer_bytes(4e9), ddp_buffer_bytes(4e9, gradient_as_bucket_view=True)
    (4000000000.0, 0.0)
    """
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    return 0.0 if gradient_as_bucket_view else float(grad_bytes)


def ddp_bucket_count(grad_bytes: float, *, bucket_cap_mb: float = DDP_BUCKET_CAP_MB) -> int:
    """All-reduce calls DDP makes per step for ``grad_bytes`` of gradients: a 1 MiB first
    bucket, then buckets of ``bucket_cap_mb`` MiB (each call pays one collective latency).

    >>> ddp_bucket_count(0), ddp_bucket_count(2**20), ddp_bucket_count(100 * 2**20)
    (0, 1, 5)
    """
    return len(bucket_sizes(grad_bytes, bucket_cap_mb=bucket_cap_mb))


def bucket_sizes(grad_bytes: float, *, bucket_cap_mb: float = DDP_BUCKET_CAP_MB) -> list[float]:
    """Bytes of each gradient bucket DDP reduces, in the order backward fills them: a
    1 MiB first bucket, then buckets of ``bucket_cap_mb`` MiB, the last one partial.

    >>> [round(b / 2**20, 2) for b in bucket_sizes(60 * 2**20)]
    [1.0, 25.0, 25.0, 9.0]
    """
    sizes: list[float] = []
    left, cap = float(grad_bytes), DDP_FIRST_BUCKET_MB * 2**20
    while left > 0:
        sizes.append(min(left, cap))
        left -= sizes[-1]
        cap = bucket_cap_mb * 2**20
    return sizes


def fsdp_buffer_bytes(
    unit_bytes: float,
    *,
    prefetch: int = 1,
    root_bytes: float = 0.0,
    grad_unit_bytes: float | None = None,
) -> float:
    """Peak bytes FSDP2 (ZeRO-3) holds beyond the sharded states: the root module's weights
    (``fully_shard`` keeps the root unsharded after forward), the unit being computed plus
    ``prefetch`` units all-gathered ahead (unsharded ``unit_bytes`` each, the largest unit),
    and in backward one unit's unsharded gradients waiting for their reduce-scatter
    (``grad_unit_bytes``, by default as large as the unit's weights).

    >>> fsdp_buffer_bytes(1e9)   # two gathered blocks and one block of gradients
    3000000000.0
    """
    grads = unit_bytes if grad_unit_bytes is None else grad_unit_bytes
    return float(root_bytes + (1 + prefetch) * unit_bytes + grads)


# --- The breakdown ---------------------------------------------------------------------------
def with_fragmentation(live_bytes: float, fragmentation: float = 0.0) -> float:
    """Bytes the allocator reserves for ``live_bytes`` of tensors: ``fragmentation`` is the
    fraction it adds on top (0 for live-bytes accounting, :data:`REPORT_FRAGMENTATION` for
    reports).

    >>> with_fragmentation(1000.0, 0.25)
    1250.0
    """
    if fragmentation < 0:
        raise ValueError(f"fragmentation must be >= 0, got {fragmentation!r}")
    return live_bytes * (1 + fragmentation)


@dataclass(frozen=True)
class MemoryBreakdown:
    """What one device holds at its peak, in bytes (modelled).

    ``temporaries`` are short-lived tensors alive at the peak (the loss gradient when backward
    starts, the optimizer's scratch during its step); ``host`` is what CPU offload keeps in
    host memory instead (not in ``total``); ``fragmentation`` the allocator's allowance as a
    fraction of the live bytes (see :func:`with_fragmentation`).
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float  # communication buckets, gathered (ZeRO-3) weights, fp8 weight copies
    host: float = 0.0
    fragmentation: float = 0.0
    temporaries: float = 0.0

    @property
    def live(self) -> float:
        """Bytes of live tensors."""
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.temporaries)

    @property
    def total(self) -> float:
        """Bytes the device must have: live tensors plus the fragmentation allowance."""
        return with_fragmentation(self.live, self.fragmentation)

    def to_dict(self) -> dict[str, int]:
        return {
            "params": int(self.params),
            "grads": int(self.grads),
            "optimizer": int(self.optimizer),
            "activations": int(self.activations),
            "buffers": int(self.buffers),
            "temporaries": int(self.temporaries),
            "fragmentation": int(self.total - self.live),
            "host": int(self.host),
            "total": int(self.total),
        }


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")


def _check_offload(offload: str, zero_stage: int) -> None:
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; expected one of {OFFLOADS}")
    if offload == "optimizer" and zero_stage < 1:
        raise ValueError(
            "optimizer offload partitions the optimizer over data parallelism: it needs "
            "zero_stage >= 1 (DeepSpeed offload_optimizer)"
        )
    if offload == "optimizer+params" and zero_stage != 3:
        raise ValueError(
            "parameter offload gathers weights on demand: it needs zero_stage 3 "
            "(FSDP2 CPUOffloadPolicy, DeepSpeed offload_param)"
        )
