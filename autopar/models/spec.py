"""A resolved model (what to build, how to call it) and the sizes autopar accepts.

Sizes are bounded (``SPEC_LIMITS``, and at most ``MAX_TOKENS`` tokens per step), far above any
published model, so that a typo (an extra zero, ``10**30``) fails with a message instead
of tracing for hours or overflowing a tensor's element count: tracing costs about 0.1 s per
layer on a laptop core, and within these bounds every tensor of a built-in family has fewer
than 2**63 elements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.core.errors import ModelSpecError

Device = str | torch.device
InputsFn = Callable[[int, int, Device], tuple[tuple, dict]]


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its hyperparameters, default batch, a builder and example inputs."""

    name: str  # the built-in name, or the spec text as given
    family: str  # "gpt" | "gpt2-hf" | "llama" | "mixtral" | "custom"
    config: Mapping[str, Any]  # resolved hyperparameters (for display and fingerprints)
    default_batch: int  # global batch in sequences; 0 if a custom factory gave no inputs
    default_seq: int
    build: Callable[[], nn.Module] = field(repr=False, compare=False)
    inputs_fn: InputsFn = field(repr=False, compare=False)

    def example_inputs(self, batch: int, seq: int, device: Device = "meta") -> tuple[tuple, dict]:
        """``(args, kwargs)`` that make the model return a loss, for a global batch.

        Token ids are int64 in ``[0, vocab)``, drawn from a fixed seed so every rank (and
        every run) sees the same batch; on meta they are uninitialized meta tensors.
        """
        if self.default_batch:  # 0: a factory gave no example inputs; inputs_fn says so
            check_batch_and_seq(batch, seq, f"model {self.name}")
        return self.inputs_fn(batch, seq, device)


SPEC_LIMITS = {
    "layers": 512,  # deepest published LLMs: 126 layers (Llama 3.1 405B)
    "hidden": 2**17,  # widest: 25,600 (Megatron 1T)
    "heads": 2**10,
    "kv_heads": 2**10,
    "ffn": 2**20,
    "vocab": 2**22,  # largest: 256k (Gemma)
    "seq": 2**20,  # 1M-token contexts
    "batch": 2**20,
    "experts": 2**12,  # DeepSeek-V3: 256
    "top_k": 2**12,
    "expert_ffn": 2**20,
    "shared_experts": 2**12,
    "dense_layers": 512,
    "q_lora": 2**17,
    "kv_lora": 2**17,
}
"""Upper bound of every size key of a spec (and of ``--seq``, ``--global-batch``)."""

MAX_TOKENS = 2**32
"""Tokens per step (batch x seq) at most: 1000x Llama 3's 4M-token batches."""


def check_batch_and_seq(batch: Any, seq: Any, where: str) -> None:
    """A batch and sequence length autopar can trace: positive, within the limits."""
    for what, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelSpecError(f"{what} must be a positive integer, got {value!r}",
                                 where=where, fix=f"pass {what} as an int >= 1")
        if value > SPEC_LIMITS[what]:
            raise ModelSpecError(f"{what} {value} is above autopar's limit of {SPEC_LIMITS[what]}",
                                 where=where, fix=f"use {what} <= {SPEC_LIMITS[what]} "
                                 "(limits are far above any published model; see SPEC_LIMITS)")
    if batch * seq > MAX_TOKENS:
        raise ModelSpecError(f"batch x seq = {batch} x {seq} = {batch * seq} tokens per step is "
                             f"above autopar's limit of {MAX_TOKENS}", where=where,
                             fix="use a smaller batch or sequence (Llama 3 trained with 4M tokens "
                             "per step)")


