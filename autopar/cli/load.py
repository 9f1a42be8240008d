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
    note: str = ""  # how the batch was chosen, when the user did not give it


def keep_tokens(spec: ModelSpec, batch: int | None, seq: int | None) -> tuple[int, int, str]:
    """(sequences, tokens each, note): ``--seq`` without ``--global-batch`` keeps the preset's
    tokens per step (512 x 8,192 at 131,072 tokens is 32 sequences, not 512 of them)."""
    if batch is not None or seq is None or seq == spec.default_seq or not spec.default_batch:
        return batch or spec.default_batch, seq or spec.default_seq, ""
    tokens = spec.default_batch * spec.default_seq
    kept = max(1, tokens // seq)
    note = (f"--seq {seq:,} without --global-batch: {kept:,} sequences a step, keeping "
            f"{spec.name}'s {tokens:,} tokens a step ({spec.default_batch:,} x "
            f"{spec.default_seq:,})")
    if kept * seq != tokens:
        note += f"; {kept * seq:,} tokens at {kept:,} whole sequences"
    return kept, seq, note + " (--global-batch sets it)"


def trace_model(text: str, batch: int | None, seq: int | None,
                frozen: bool = False) -> TracedModel:
    """Resolve and trace on meta. ``frozen`` freezes every weight first (LoRA: the trace's
    backward FLOPs and states then leave out the base weights' gradients)."""
    spec = resolve_model(text)
    batch, seq, note = keep_tokens(spec, batch, seq)
    started = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    if frozen:
        model.requires_grad_(False)
    gm = trace(model, spec.example_inputs(batch, seq, device="meta"))
    return TracedModel(spec, gm, batch, seq, time.perf_counter() - started, note)
