"""Generated Triton fused-attention kernels (forward, backward, log-sum-exp) and their reference.

`attention` is the entry point; `kernel_source(spec)` prints the code generated for a spec;
`merge_partials` combines partial results over disjoint keys, and `ring_attention_shard` /
`simulate_ring_attention` build ring attention (context parallelism) on it;
`reference_attention` is the plain-math definition the tests compare against.
"""

from .api import attention, backend_for, merge_partials, spec_for
from .blocks import BLOCK_TABLE, Blocks, block_sizes
from .codegen import build_kernels, kernel_source
from .reference import dropout_keep_mask, reference_attention
from .ring import ring_attention_shard, shard_pieces, simulate_ring_attention
from .spec import AttentionSpec

__all__ = [
    "BLOCK_TABLE",
    "AttentionSpec",
    "Blocks",
    "attention",
    "backend_for",
    "block_sizes",
    "build_kernels",
    "dropout_keep_mask",
    "kernel_source",
    "merge_partials",
    "reference_attention",
    "ring_attention_shard",
    "shard_pieces",
    "simulate_ring_attention",
    "spec_for",
]
