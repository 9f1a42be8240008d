"""Local implementations that some strategies run instead of the traced op.

A strategy names one in ``Strategy.local_impl`` when running the same op on local shards
would be wrong: looking up token ids in a vocabulary-sharded embedding must skip ids that
live on other devices; a cross-entropy over logits split by class must combine every
device's log-sum-exp. The graph calls these by name through :data:`LOCAL_IMPLS`.
"""

from __future__ import annotations

import torch

from autopar import comm_ops
from autopar.context_ops import token_mean_scale
from autopar.loss_ops import chunked_cross_entropy, vocab_parallel_cross_entropy


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


def vocab_parallel_loss(logits_local: torch.Tensor, target: torch.Tensor, axis: str, *,
                        ignore_index: int = -100, reduction: str = "mean",
                        label_smoothing: float = 0.0,
                        token_mean_axis: str | None = None) -> torch.Tensor:
    """What the graph calls for a cross-entropy whose logits are split by class over
    ``axis``: :func:`autopar.loss_ops.vocab_parallel_cross_entropy` on the axis's group.
    ``token_mean_axis``: a mean made exact over that axis's tokens (``token_mean_scale``)."""
    group, n, _ = comm_ops._group(axis)
    kwargs = {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
              "reduction": "sum" if token_mean_axis else reduction}
    if group is None or n == 1:
        loss = chunked_cross_entropy(logits_local, target, **kwargs)
    else:
        loss = vocab_parallel_cross_entropy(logits_local, target, group, **kwargs)
    if token_mean_axis:
        loss = token_mean_scale(loss, target, ignore_index=ignore_index, axis=token_mean_axis)
    return loss


LOCAL_IMPLS = {"vocab_parallel_embedding": vocab_parallel_embedding,
               "vocab_parallel_cross_entropy": vocab_parallel_loss}
