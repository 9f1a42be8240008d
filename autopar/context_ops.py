"""Attention with the sequence sharded over a process group (context parallelism): the op
a rank's program calls in place of each attention site when the plan has ``cp`` > 1
(:func:`context_attention`, bound to the ``cp`` axis like :mod:`autopar.comm_ops`).

All-gathering keys and values is Llama 3's choice, cheap with GQA's few key/value heads.

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

from autopar.comm_ops import _gather, _group, _reduce_scatter
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


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      algorithm: str, zigzag: bool, causal: bool = False,
                      scale: float | None = None) -> torch.Tensor:
    """This rank's attention output for its tokens ``q``/``k``/``v`` (batch, heads,
    local_len, head_dim) under the plan's cp ``algorithm``, on the group bound to ``cp``."""
    group, n, _ = _group("cp")
    if group is None or n == 1:
        from autopar.kernels import attention

        return attention(q, k, v, causal=causal, scale=scale)
    if algorithm != "all_gather":
        raise NotImplementedError(f"cp attention algorithm {algorithm!r} is not executed yet")
    out, _ = all_gather_kv_attention(q, k, v, group, zigzag=zigzag, causal=causal, scale=scale)
    return out


def token_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                             weight: torch.Tensor | None = None, ignore_index: int = -100,
                             label_smoothing: float = 0.0, axis: str = "cp") -> torch.Tensor:
    """``n x`` this rank's summed cross-entropy over the targets (their weights) counted on
    all ``n`` ranks of ``axis``: its average over the ranks is the exact mean over their
    tokens, however unevenly ignored targets fall (see passes.token_mean_loss)."""
    total = torch.nn.functional.cross_entropy(
        logits, target, weight=weight, ignore_index=ignore_index, reduction="sum",
        label_smoothing=label_smoothing)
    with torch.no_grad():
        valid = target != ignore_index
        count = (weight[target.clamp(min=0)] * valid).sum() if weight is not None else valid.sum()
        count = count.to(torch.float64)
        group, n, _ = _group(axis)
        if group is not None:
            dist.all_reduce(count, group=group)
    return total * n / count.to(total.dtype)
