"""fp16 dynamic loss scaling for a distributed train step.

The rule is ``torch.amp.GradScaler``'s, bit for bit (the scale is kept rounded to float32 and
never grows to inf, as torch's ``_amp_update_scale_`` kernel does), but it takes parameters
instead of an optimizer, unscales DTensor gradients (FSDP2 shards) through their local
tensors, and agrees on overflow over a process group with one all-reduce: under tensor or
pipeline parallelism each rank holds different gradients, and if any rank skips the step
every rank must, or the replicas drift apart. ``ShardedGradScaler`` does the all-reduce for
FSDP1 but binds to one optimizer and reduces once per device.

Per step::

    scaler.scale_loss(loss).backward()
    found_inf = scaler.unscale_and_check(model.parameters(), group)
    if not found_inf:
        optimizer.step()
    scaler.update(found_inf)
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.core.errors import AutoparError

_STATE_KEYS = ("scale", "growth_tracker", "skipped_steps", "last_step_skipped",
               "growth_factor", "backoff_factor", "growth_interval")


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest), as GradScaler's float32 scale tensor holds it."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass(frozen=True)
class LossScaleConfig:
    """GradScaler's knobs, with its defaults."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> AutoparError:
            return AutoparError(
                f"loss scale {name} must be {rule}, got {getattr(self, name)!r}",
                where=f"LossScaleConfig.{name}",
                fix=f"pass {name} {rule} (GradScaler's default is "
                    f"{next(f.default for f in fields(self) if f.name == name)!r})")

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "a number")
            return float(value)

        if not 0 < _f32(number("init_scale")) < math.inf:
            raise bad("init_scale", "positive and finite in float32")
        if not 1 < number("growth_factor") < math.inf:
            raise bad("growth_factor", "finite and > 1")
        if not 0 < number("backoff_factor") < 1:
            raise bad("backoff_factor", "between 0 and 1 (exclusive)")
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise bad("growth_interval", "an integer >= 1")


class DynamicLossScaler:
    """Scales the loss, unscales the gradients, and grows or backs off the scale."""

    def __init__(self, config: LossScaleConfig = LossScaleConfig()) -> None:  # noqa: B008 (frozen)
        self.config = config
        self._scale = _f32(float(config.init_scale))
        self._growth_tracker = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._unscaled = False  # set by unscale_and_check, cleared by update

    @property
    def scale(self) -> float:
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``, in at least float32 (as GradScaler's float32 scale promotes it),
        so an fp16 loss does not overflow in the multiply itself."""
        return loss.to(torch.promote_types(loss.dtype, torch.float32)) * self._scale

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter],
                          group: dist.ProcessGroup | None = None) -> bool:
        """Divide every gradient by the scale in place; True if any gradient on any rank of
        ``group`` (default: the world, when torch.distributed is initialized) is inf or nan.
        Every rank of ``group`` must call it, with or without gradients."""
        if self._unscaled:
            raise AutoparError(
                "unscale_and_check was called twice in one step; the gradients would be "
                "divided by the scale twice",
                where="DynamicLossScaler.unscale_and_check",
                fix="call update(found_inf) once after each unscale_and_check")
        self._unscaled = True
        params = list(params)
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = (
            defaultdict(lambda: defaultdict(list)))
        with torch.no_grad():
            for param in params:
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(grad, DTensor):
                    grad = grad.to_local()
                if grad.is_sparse:  # as GradScaler: coalesced fp16 values may overflow
                    if grad.dtype is torch.float16:
                        grad = param.grad = grad.coalesce()
                    grad = grad._values()
                by_device[grad.device][grad.dtype].append(grad)
            inv_scale = _f32(1.0 / self._scale)  # GradScaler: scale.double().reciprocal().float()
            found = {}
            for device, by_dtype in by_device.items():
                found[device] = torch.zeros(1, dtype=torch.float32, device=device)
                inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv)
            flag = (sum(f.to(next(iter(found))) for f in found.values()) if found
                    else torch.zeros(1, dtype=torch.float32, device=_flag_device(params, group)))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def update(self, found_inf: bool) -> None:
        """GradScaler's rule: on overflow back off and start counting again; after
        ``growth_interval`` clean steps in a row grow, unless that would overflow float32."""
        self._unscaled = False
        self.last_step_skipped = bool(found_inf)
        if found_inf:
            self._scale = _f32(self._scale * self.config.backoff_factor)
            self._growth_tracker = 0
            self.skipped_steps += 1
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.config.growth_interval:
            grown = _f32(self._scale * self.config.growth_factor)
            if not math.isinf(grown):
                self._scale = grown
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers for a checkpoint; the knobs too, as GradScaler saves them."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "skipped_steps": self.skipped_steps,
                "last_step_skipped": int(self.last_step_skipped),
                "growth_factor": self.config.growth_factor,
                "backoff_factor": self.config.backoff_factor,
                "growth_interval": self.config.growth_interval}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Restore what ``state_dict`` saved (the knobs too, as GradScaler does)."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise AutoparError(
                f"loss scaler state is missing {', '.join(missing)}",
                where="DynamicLossScaler.load_state_dict",
                fix="pass a dict saved by DynamicLossScaler.state_dict()")
        # Validated as a config would be: the saved scale as the initial one.
        saved = LossScaleConfig(
            init_scale=state["scale"], growth_factor=state["growth_factor"],
            backoff_factor=state["backoff_factor"], growth_interval=state["growth_interval"])
        tracker, skipped = state["growth_tracker"], state["skipped_steps"]
        for name, value in (("growth_tracker", tracker), ("skipped_steps", skipped)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AutoparError(
                    f"loss scaler state {name} must be an integer >= 0, got {value!r}",
                    where=f"DynamicLossScaler.load_state_dict: {name}",
                    fix="pass a dict saved by DynamicLossScaler.state_dict()")
        self.config = replace(saved, init_scale=self.config.init_scale)
        self._scale = _f32(float(saved.init_scale))
        self._growth_tracker = tracker
        self.skipped_steps = skipped
        self.last_step_skipped = bool(state["last_step_skipped"])
        self._unscaled = False


def _flag_device(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None
                 ) -> torch.device:
    """Where the overflow flag lives on a rank without gradients: with its parameters, else
    on the backend's device (cuda for nccl, cpu for gloo)."""
    if params:
        first = params[0]
        return (first.to_local() if isinstance(first, DTensor) else first).device
    if (dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group))
            and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
