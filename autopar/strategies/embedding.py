"""Sharding rule for ``embedding(weight, indices)``, and the vocabulary-parallel local op.

- Embedding dim sharded: weight ``Shard(1)`` gives output ``Shard(last)``.
- Index dims sharded: indices ``Shard(d)`` with the weight whole gives output ``Shard(d)``.
- The lookup is linear in the weight: weight ``Partial`` gives output ``Partial``.
- Vocabulary-parallel (Megatron's ``VocabParallelEmbedding``): weight ``Shard(0)``, each
  device looks up only the ids in its vocabulary range and writes zeros elsewhere, and the
  output is ``Partial("sum")``. Plain ``embedding`` on the local rows would look up the wrong
  rows, so this strategy names :func:`vocab_parallel_embedding` as its local implementation.
"""

from __future__ import annotations

import torch

from autopar.core.placements import Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, replicate_all
from autopar.ops.local_ops import vocab_parallel_lookup as vocab_parallel_embedding  # noqa: F401
from autopar.strategies.pointwise import PSUM, R, group_options, partial_strategies
from autopar.strategies.registry import register_rule

aten = torch.ops.aten

VOCAB_PARALLEL = "vocab_parallel_embedding"


@register_rule(aten.embedding.default)
def embedding(call: OpCall, axis_size: int) -> list[Strategy]:
    """See the module docstring. Vocabulary-parallel is offered only without
    ``padding_idx``/``scale_grad_by_freq``/``sparse`` (they change the backward, which the
    local implementation does not reproduce)."""
    weight, indices = call.tensor_args
    out_ndim = call.out[0].ndim
    strategies = [replicate_all(call)]
    for g in group_options(call, out_ndim - 1, out_ndim):
        if can_shard(weight.shape[1], axis_size, g):
            strategies.append(Strategy((Shard(1, g), R), (Shard(out_ndim - 1, g),)))
    for d, size in enumerate(indices.shape):
        if can_shard(size, axis_size):
            strategies.append(Strategy((R, Shard(d)), (Shard(d),)))
    strategies += partial_strategies(call, [[0]])
    plain = (
        call.arg(2, "padding_idx", -1) in (-1, None)
        and not call.arg(3, "scale_grad_by_freq", False)
        and not call.arg(4, "sparse", False)
    )
    if plain and can_shard(weight.shape[0], axis_size):
        strategies.append(Strategy((Shard(0), R), (PSUM,), local_impl=VOCAB_PARALLEL))
    return strategies
