"""Memory per device: model states (ZeRO accounting) and the breakdown a plan reports.

Model states follow the ZeRO paper: with mixed precision and Adam, each parameter costs
2 bytes (16-bit weights) + 2 (16-bit gradients) + K = 12 (fp32 master weights, momentum and
variance); in fp32, 4 + 4 + 8. ZeRO stage 1 divides the optimizer states over the
data-parallel group, stage 2 also the gradients, stage 3 also the weights. Frozen parameters
have weights only.

>>> s = model_state_bytes(1_000_000, trainable=True, precision="bf16", optimizer="adamw",
...                       zero_stage=0, dp=8)
>>> s.params, s.grads, s.optimizer
(2000000, 2000000, 12000000)
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16")
# Optimizer state bytes per trainable parameter (fp32 states), not counting master weights.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "momentum": 4, "sgd": 0}


def weight_bytes(precision: str) -> int:
    """Bytes of the working copy of one weight (and of one gradient)."""
    _check_precision(precision)
    return 4 if precision == "fp32" else 2


def activation_bytes_per_element(precision: str) -> int:
    return weight_bytes(precision)


def master_weight_bytes(precision: str) -> int:
    """Mixed precision keeps an fp32 master copy for the optimizer."""
    return 0 if precision == "fp32" else 4


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    numel: float,
    *,
    trainable: bool,
    precision: str,
    optimizer: str,
    zero_stage: int,
    dp: int,
) -> StateBytes:
    """Bytes one device holds for ``numel`` parameters (already divided by tensor parallelism)."""
    _check_precision(precision)
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected {sorted(OPTIMIZER_STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    w = weight_bytes(precision)
    params = numel * w / (dp if zero_stage >= 3 else 1)
    if not trainable:
        return StateBytes(params, 0.0, 0.0)
    grads = numel * w / (dp if zero_stage >= 2 else 1)
    opt_per = master_weight_bytes(precision) + OPTIMIZER_STATE_BYTES[optimizer]
    optimizer_bytes = numel * opt_per / (dp if zero_stage >= 1 else 1)
    return StateBytes(params, grads, optimizer_bytes)


@dataclass(frozen=True)
class MemoryBreakdown:
    """What one device holds at its peak, in bytes (modelled)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float  # communication buckets and gathered (ZeRO-3) weights

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_dict(self) -> dict[str, int]:
        return {
            "params": int(self.params),
            "grads": int(self.grads),
            "optimizer": int(self.optimizer),
            "activations": int(self.activations),
            "buffers": int(self.buffers),
            "total": int(self.total),
        }


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
