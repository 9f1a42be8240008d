"""Resolve a MODEL argument and trace it on the meta device (no weights allocated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.models import ModelSpec, resolve_model
from autopar.trace import trace


@dataclass
class TracedModel:
    spec: ModelSpec
    gm: fx.GraphModule
    batch: int
    seq: int
    trace_s: float


def trace_model(text: str, batch: int | None, seq: int | None) -> TracedModel:
    import time

    spec = resolve_model(text)
    batch = batch or spec.default_batch
    seq = seq or spec.default_seq
    started = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(batch, seq, device="meta"))
    return TracedModel(spec, gm, batch, seq, time.perf_counter() - started)


def zero_stages(text: str) -> tuple[int, ...]:
    from autopar.errors import AutoparError

    try:
        stages = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        stages = ()
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise AutoparError(
            f"--zero {text!r} is not a list of ZeRO stages",
            where="--zero",
            fix="give stages 0-3 separated by commas, e.g. --zero 0,3",
        )
    return stages


def recompute_modes(text: str) -> tuple[str, ...]:
    from autopar.errors import AutoparError

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    allowed = ("none", "selective", "full")
    if not modes or any(m not in allowed for m in modes):
        raise AutoparError(
            f"--recompute {text!r} is not a list of recomputation modes",
            where="--recompute",
            fix=f"give modes from {', '.join(allowed)} separated by commas, e.g. none,full",
        )
    return modes
