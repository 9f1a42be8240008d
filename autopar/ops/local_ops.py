"""Local implementations that some strategies run instead of the traced op.

A strategy names one in ``Strategy.local_impl`` when running the same op on local shards
would be wrong: looking up token ids in a vocabulary-sharded embedding must skip ids that
live on other devices; a cross-entropy over logits split by class must combine every
device's log-sum-exp; a batch norm over split samples must take every device's statistics. The graph calls these by name through :data:`LOCAL_IMPLS`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.knobs import LOCAL_IMPL_NAMES
from autopar.ops import comm_ops
from autopar.ops.loss_ops import chunked_cross_entropy, vocab_parallel_cross_entropy


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
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """What the graph calls for a cross-entropy whose logits are split by class over
    ``axis``: :func:`autopar.ops.loss_ops.vocab_parallel_cross_entropy` on the axis's group."""
    group, n, _ = comm_ops._group(axis)
    kwargs = {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
              "reduction": reduction}
    if group is None or n == 1:
        return chunked_cross_entropy(logits_local, target, **kwargs)
    return vocab_parallel_cross_entropy(logits_local, target, group, **kwargs)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm in training over the samples of every rank of a group.

    Why hand-written: ``torch.nn.SyncBatchNorm`` runs on CUDA only (``batch_norm_stats``
    has no CPU kernel). Forward all-reduces each channel's sum, then its squared deviation
    from the global mean (two passes, as torch's own variance is exact to rounding), and
    updates the running statistics with the global ones; backward all-reduces the two
    per-channel sums the input gradient needs. Under the data-parallel gradient convention
    (:mod:`autopar.ops.comm_ops`) each rank's backward is the gradient of every rank's loss term
    along its own samples; the weight and bias gradients stay this rank's share."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        stats = torch.cat([x.sum(dims, dtype=torch.float64),
                           torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64)])
        dist.all_reduce(stats, group=group)
        count = stats[-1]
        mean = (stats[:-1] / count).to(x.dtype)
        centred = x - mean.view(shape)
        square = (centred * centred).sum(dims, dtype=torch.float64)
        dist.all_reduce(square, group=group)
        var = square / count
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / max(float(count) - 1, 1.0)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        x_hat = centred * invstd.view(shape)
        out = x_hat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.count, ctx.group, ctx.has_bias = count, group, bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x_hat, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, grad.dim())]
        shape = [1, -1] + [1] * (grad.dim() - 2)
        d_bias = grad.sum(dims)
        d_weight = (grad * x_hat).sum(dims)
        scaled = d_bias if weight is None else d_bias * weight
        scaled_hat = d_weight if weight is None else d_weight * weight
        sums = torch.cat([scaled, scaled_hat]).to(torch.float64)
        dist.all_reduce(sums, group=ctx.group)
        mean_dy = (sums[: len(scaled)] / ctx.count).to(grad.dtype)
        mean_dy_hat = (sums[len(scaled):] / ctx.count).to(grad.dtype)
        dy = grad if weight is None else grad * weight.view(shape)
        dx = (dy - mean_dy.view(shape) - x_hat * mean_dy_hat.view(shape)) * invstd.view(shape)
        return (dx, d_weight if weight is not None else None,
                d_bias if ctx.has_bias else None, None, None, None, None, None)


SYNC_BATCH_NORM = "sync_batch_norm"


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    training: bool, momentum: float, eps: float, cudnn_enabled: bool = True,
                    *, axis: str = "dp") -> torch.Tensor:
    """``aten.batch_norm`` whose training statistics are those of the samples of every rank
    of ``axis`` (the same arguments, then the axis)."""
    group, n, _ = comm_ops._group(axis)
    if not training or group is None or n == 1:
        return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var,
                                                 training, momentum, eps, cudnn_enabled)
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps,
                                group)


LOCAL_IMPLS = dict(zip(LOCAL_IMPL_NAMES, (vocab_parallel_embedding, vocab_parallel_loss,
                                          sync_batch_norm), strict=True))
