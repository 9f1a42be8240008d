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
