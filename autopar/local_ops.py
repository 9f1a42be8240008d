"""Local implementations that some strategies run instead of the traced op.

A strategy names one in ``Strategy.local_impl`` when running the same op on local shards
would be wrong: looking up token ids in a vocabulary-sharded embedding must skip ids that
live on other devices. The graph calls these by name through :data:`LOCAL_IMPLS`.
"""

from __future__ import annotations

import torch

from autopar import comm_ops


def vocab_parallel_lookup(
    weight_local: torch.Tensor,
    indices: torch.Tensor,
    *,
    rank: int,
    axis_size: int,
    vocab_size: int,
) -> torch.Tensor:
    """Look up ``indices`` in device ``rank``'s rows ``[rank*V/n, (rank+1)*V/n)`` of a
    vocabulary-sharded table. Ids held elsewhere give zero vectors (and no gradient to any
    local row), so the sum over the axis (a Partial) is the full lookup (Megatron's
    VocabParallelEmbedding)."""
    per_rank = vocab_size // axis_size
    start = rank * per_rank
    outside = (indices < start) | (indices >= start + per_rank)
    local_ids = (indices - start).masked_fill(outside, 0)
    out = torch.ops.aten.embedding.default(weight_local, local_ids)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_embedding(
    weight_local: torch.Tensor, indices: torch.Tensor, axis: str, vocab_size: int
) -> torch.Tensor:
    """What the graph calls: :func:`vocab_parallel_lookup` for this device on ``axis``."""
    n = max(vocab_size // weight_local.shape[0], 1)
    return vocab_parallel_lookup(
        weight_local, indices, rank=comm_ops.axis_rank(axis), axis_size=n, vocab_size=vocab_size
    )


LOCAL_IMPLS = {"vocab_parallel_embedding": vocab_parallel_embedding}
