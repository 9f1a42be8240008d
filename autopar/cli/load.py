"""Resolve a MODEL argument and trace it on the meta device (no weights allocated)."""

from __future__ import annotations

import time
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


def trace_model(text: str, batch: int | None, seq: int | None,
                frozen: bool = False) -> TracedModel:
    """Resolve and trace on meta. ``frozen`` freezes every weight first (LoRA: the trace's
    backward FLOPs and states then leave out the base weights' gradients)."""
    spec = resolve_model(text)
    batch = batch or spec.default_batch
    seq = seq or spec.default_seq
    started = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    if frozen:
        model.requires_grad_(False)
    gm = trace(model, spec.example_inputs(batch, seq, device="meta"))
    return TracedModel(spec, gm, batch, seq, time.perf_counter() - started)
