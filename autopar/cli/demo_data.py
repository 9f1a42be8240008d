"""The demo's model and data: a small GPT learning its own source code, byte by byte."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.models import GPT, GPTConfig

BATCH, SEQ = 8, 64


def demo_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=256, n_layer=4, n_head=4, n_embd=128))


def demo_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (inputs, next-byte targets), the same on every rank."""
    text = Path(__file__).resolve().parents[1].joinpath("models", "gpt.py").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[s : s + SEQ] for s in starts])
        y = torch.stack([data[s + 1 : s + SEQ + 1] for s in starts])
        out.append((x, y))
    return out
