"""Attention with the sequence sharded over a process group (context parallelism), by
all-gathering keys and values: Llama 3's choice, cheap with GQA's few key/value heads.

Each rank holds the queries, keys and values of the positions ``shard_pieces`` gives it
(contiguous, or zigzag for causal balance). An all-gather brings every rank's keys and
values; its backward returns each block's dK and dV, summed over the ranks that read it, to
the rank that owns it (``comm_ops``'s reduce-scatter).
``ring_attention_shard`` then runs this rank's queries against every block at its global
position, skipping blocks the mask hides. The same shard function serves the ring algorithm,
where the blocks arrive one by one instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.comm_ops import _gather, _reduce_scatter
from autopar.kernels import ring_attention_shard, shard_pieces
from autopar.placements import Shard


class _GatherBlocks(torch.autograd.Function):
    """Every rank's ``x`` stacked along a new dim 0 (all-gather); backward: the summed
    gradient of this rank's block (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather(x.unsqueeze(0), Shard(0), group, dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return _reduce_scatter(grad, Shard(0), ctx.group, n, rank).squeeze(0), None


def sequence_shard(x: torch.Tensor, cp: int, rank: int, *, zigzag: bool = False,
                   dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s positions of ``x`` along ``dim``, laid end to end as
    ``shard_pieces`` orders them.

    >>> sequence_shard(torch.arange(8), 2, 0, zigzag=True, dim=0).tolist()
    [0, 1, 6, 7]
    """
    pieces = shard_pieces(x.shape[dim], cp, rank, zigzag=zigzag)
    return torch.cat([x.narrow(dim, start, length) for start, length in pieces], dim=dim)


def all_gather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            group: dist.ProcessGroup | None = None, *, zigzag: bool = False,
                            causal: bool = False, window: tuple[int, int] | None = None,
                            scale: float | None = None,
                            alibi_slopes: torch.Tensor | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and log-sum-exp for its sequence shard ``q`` (batch,
    heads, local_len, head_dim), against the keys and values of every rank of ``group``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [shard_pieces(q.shape[2] * cp, cp, r, zigzag=zigzag) for r in range(cp)]
    keys = _GatherBlocks.apply(k, group)
    values = _GatherBlocks.apply(v, group)
    order = [(rank - step) % cp for step in range(cp)]  # its own block first, as a ring
    blocks = [(keys[r], values[r], pieces[r]) for r in order]
    return ring_attention_shard(q, pieces[rank], blocks, causal=causal, window=window,
                                scale=scale, alibi_slopes=alibi_slopes, softcap=softcap)
