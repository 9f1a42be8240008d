"""Local implementations that some strategies run instead of the traced op.

A strategy names one in ``Strategy.local_impl`` when running the same op on local shards
would be wrong: looking up token ids in a vocabulary-sharded embedding must skip ids that
live on other devices. The graph calls these by name through :data:`LOCAL_IMPLS`.
"""

from __future__ import annotations

import torch

from autopar import comm_ops


def vocab_parallel_embedding(
    weight_local: torch.Tensor, indices: torch.Tensor, axis: str, vocab_size: int
) -> torch.Tensor:
    """Embedding lookup in this device's rows ``[r*V/n, (r+1)*V/n)`` of a vocabulary-sharded
    table; ids held elsewhere give zeros, so the sum over the axis (a Partial) is the
    full lookup (Megatron's VocabParallelEmbedding)."""
    n = max(vocab_size // weight_local.shape[0], 1)
    start = comm_ops.axis_rank(axis) * (vocab_size // n)
    outside = (indices < start) | (indices >= start + weight_local.shape[0])
    local_ids = (indices - start).masked_fill(outside, 0)
    out = torch.ops.aten.embedding.default(weight_local, local_ids)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


LOCAL_IMPLS = {"vocab_parallel_embedding": vocab_parallel_embedding}
