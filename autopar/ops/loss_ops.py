"""Cross-entropy over a large vocabulary, a block of tokens at a time.

Why hand-written: ``aten.cross_entropy_loss`` keeps the whole ``[tokens, vocab]``
log-softmax for backward, in fp32 under autocast, and backward makes its fp32 gradient beside
it: for Llama 3 at 8,192 tokens and a 128,256 vocabulary that is 2 x 3.9 GiB on top of the
logits. Here forward keeps only the log-sum-exp of each token (4 bytes a token) and
backward rebuilds the softmax a block of tokens at a time, writing the gradient straight into
the logits' dtype. The plan's memory model prices exactly this (:func:`chunked_saved_floats`,
:func:`chunked_working_bytes`); ``passes/chunked_loss.py`` puts it in every program. It is the
same function torch computes (class weights, ``ignore_index``, label smoothing, every
reduction), checked against it in tests.

    >>> import torch
    >>> x, t = torch.randn(6, 11), torch.tensor([1, 2, -100, 4, 5, 10])
    >>> a = chunked_cross_entropy(x, t, label_smoothing=0.1)
    >>> b = torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1)
    >>> bool(torch.allclose(a, b))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 24
"""Logit elements one block holds (16 Mi: 64 MiB in fp32); at least one token per block.
Blocks of 4 Mi elements (32 tokens of Llama 3's 128,256 classes) left an H200 idle between
their ~17 small kernels each: 512 blocks a step at 16,384 tokens, 2,639 copies, a third of
the loss's time in launches, and row reductions over 32 rows filling few SMs
(``benchmarks/results/h200_2026-11-29.md``)."""

REDUCTIONS = ("none", "mean", "sum")
"""``aten.cross_entropy_loss``'s reduction argument 0, 1, 2, by name."""


def chunk_rows(vocab: int) -> int:
    """Tokens per block for a vocabulary of ``vocab`` classes."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def chunked_saved_floats(tokens: int) -> int:
    """fp32 elements kept for backward (one log-sum-exp a token), beside the logits and
    the targets."""
    return tokens


def chunked_working_bytes(tokens: int, vocab: int) -> int:
    """The temporary backward holds beside the logits' gradient, in bytes: one block's fp32
    softmax, turned into its gradient in place."""
    return min(tokens, chunk_rows(vocab)) * vocab * 4


LOGSUMEXP_KERNELS = 9
"""Kernels one ``torch.logsumexp`` call launches on CUDA (amax, abs, eq, masked_fill_, sub,
exp_, sum, log_, add_: torch.profiler on an H200, torch 2.11); one op at the dispatcher."""


@dataclass(frozen=True)
class BlockPasses:
    """What the chunked cross-entropy below costs, counted from its code: bytes of memory
    traffic per logit element and kernel launches per block of tokens, in forward and in
    backward. The plan's step time prices these (``solver/pricing/loss_costs.py``); change them
    with the code."""

    forward_bytes: float
    backward_bytes: float
    forward_kernels: int
    backward_kernels: int


def block_passes(logit_bytes: int, smoothing: bool = False) -> BlockPasses:
    """The passes of one block, for logits of ``logit_bytes`` per element.

    Forward: the fp32 copy (none when the logits are fp32: ``.float()`` returns them),
    ``logsumexp`` (a max, ``x - max``, ``exp_``, a sum: read 4 + 8 + 8 + 4 bytes; and five
    per-token kernels: the infinity check's abs, eq and masked fill, the log, the add), the
    lse and the picked logit written into their token vectors, the gather; with label
    smoothing a sum and its write more. Backward: the fp32 copy, ``sub_``, ``exp_`` and
    ``mul_`` in place (8 bytes each), the target weights' negation and ``scatter_add_``,
    with label smoothing an ``addr_`` (and its two token- and class-sized factors), and the
    block written back in the logits' dtype.
    (The kernels are those torch.profiler counted per block on an H200, torch 2.11.)

    >>> block_passes(2)
    BlockPasses(forward_bytes=30, backward_bytes=36, forward_kernels=13, backward_kernels=7)
    """
    cast = logit_bytes != 4
    forward = (logit_bytes + 4 if cast else 0) + 24 + (4 if smoothing else 0)
    backward = (logit_bytes + 4) + 24 + (8 if smoothing else 0) + (4 + logit_bytes)
    return BlockPasses(forward, backward,
                       int(cast) + LOGSUMEXP_KERNELS + 3 + (2 if smoothing else 0),
                       1 + 3 + 2 + (3 if smoothing else 0) + 1)



def chunkable(logits_ndim: int, target_ndim: int, target_is_float: bool) -> bool:
    """Whether a cross-entropy call runs chunked: ``(tokens, classes)`` logits and class
    index targets ``(tokens,)`` (class-probability targets keep torch's op)."""
    return logits_ndim == 2 and target_ndim == 1 and not target_is_float


def _reduction(reduction: str | int) -> str:
    if isinstance(reduction, int):
        reduction = REDUCTIONS[reduction]
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked_cross_entropy: reduction {reduction!r} is not one of "
                         f"{', '.join(REDUCTIONS)}")
    return reduction


def _check_chunkable(logits: torch.Tensor, target: torch.Tensor) -> None:
    if not chunkable(logits.dim(), target.dim(), target.is_floating_point()):
        raise ValueError(f"chunked_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} are not (tokens, classes) and (tokens,) "
                         f"class indices; use torch.nn.functional.cross_entropy")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward keeps one log-sum-exp a token; backward rebuilds each block's softmax.

    With ``group`` the logits are this rank's slice of the classes (rank r of n holds
    classes ``[r V/n, (r+1) V/n)``, Megatron's vocabulary-parallel cross-entropy): each rank
    takes its partial log-sum-exp, target logit and (label smoothing) logit sum, one MAX and
    one SUM all-reduce of token-sized vectors combine them, and backward is local (each
    rank's slice of the softmax needs only the global log-sum-exp)."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, smoothing, group):
        n, local_classes = logits.shape
        world = 1 if group is None else dist.get_world_size(group)
        start = 0 if group is None else dist.get_rank(group) * local_classes
        classes = local_classes * world
        valid = target != ignore_index
        local_target = target - start
        mine = valid & (local_target >= 0) & (local_target < local_classes)
        safe = torch.where(mine, local_target, torch.zeros_like(local_target))
        if weight is None:
            row_weight, class_weight = valid.float(), None
        else:
            class_weight = weight.float()
            row_weight = class_weight[torch.where(valid, target, 0)] * valid
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        picked = torch.zeros(n, dtype=torch.float32, device=logits.device)
        spread = torch.zeros(n, dtype=torch.float32, device=logits.device)
        rows = chunk_rows(local_classes)
        for r0 in range(0, n, rows):
            x = logits[r0:r0 + rows].float()
            lse[r0:r0 + rows] = torch.logsumexp(x, dim=-1)
            picked[r0:r0 + rows] = x.gather(1, safe[r0:r0 + rows, None]).squeeze(1)
            if smoothing:  # sum_c w_c x_c, each class weighted (torch's convention)
                spread[r0:r0 + rows] = x.sum(-1) if class_weight is None else x @ class_weight
            del x
        picked = picked * mine
        if group is not None:
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            parts = torch.stack([torch.exp(lse - top), picked, spread])
            dist.all_reduce(parts, group=group)
            lse = top + torch.log(parts[0])
            picked, spread = parts[1], parts[2]
        total_weight = classes if class_weight is None else class_weight.sum()
        loss = (1 - smoothing) * (lse - picked) * row_weight
        if smoothing:  # -sum_c w_c log p_c / C
            loss = loss + smoothing * (lse * total_weight - spread) / classes * valid
        denominator = row_weight.sum()
        ctx.save_for_backward(logits, safe, valid, mine, row_weight, lse, class_weight,
                              denominator)
        ctx.reduction, ctx.smoothing, ctx.classes = reduction, smoothing, classes
        ctx.total_weight = float(total_weight)
        if reduction == "none":
            return loss
        total = loss.sum()
        return total if reduction == "sum" else total / denominator

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, safe, valid, mine, row_weight, lse, class_weight, denominator = \
            ctx.saved_tensors
        n, local_classes = logits.shape
        eps, classes = ctx.smoothing, ctx.classes
        scale = grad.float() if ctx.reduction == "none" else grad.float().expand(n)
        if ctx.reduction == "mean":
            scale = scale / denominator
        # d/dx_c of (1-eps) w_t (lse - x_t) + eps (lse W - sum_c w_c x_c) / C, W = sum_c w_c:
        # (1-eps) w_t (p_c - [c = t]) + eps (p_c W - w_c) / C
        p_weight = ((1 - eps) * row_weight + eps * valid * ctx.total_weight / classes) * scale
        target_weight = (1 - eps) * row_weight * scale * mine
        out = torch.empty_like(logits)
        rows = chunk_rows(local_classes)
        for r0 in range(0, n, rows):
            sl = slice(r0, r0 + rows)
            # one fp32 block buffer, every step in place
            g = logits[sl].to(torch.float32, copy=True).sub_(lse[sl, None]).exp_()
            g.mul_(p_weight[sl, None]).scatter_add_(1, safe[sl, None], -target_weight[sl, None])
            if eps:
                spread = torch.ones(local_classes, device=g.device) if class_weight is None \
                    else class_weight
                g.addr_(valid[sl] * scale[sl], spread, alpha=-eps / classes)
            out[sl] = g
            del g  # freed before the next block is made: one block alive at a time
        return out, None, None, None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                          weight: torch.Tensor | None = None, ignore_index: int = -100,
                          reduction: str | int = "mean",
                          label_smoothing: float = 0.0) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy(logits, target, ...)`` for ``(tokens, classes)``
    logits and class-index targets, keeping one log-sum-exp a token instead of the
    log-softmax; the loss is fp32. ``reduction`` is a name or aten's 0/1/2."""
    reduction = _reduction(reduction)
    _check_chunkable(logits, target)
    return _ChunkedCrossEntropy.apply(logits, target, weight, int(ignore_index), reduction,
                                      float(label_smoothing), None)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: dist.ProcessGroup, *, ignore_index: int = -100,
                                 reduction: str | int = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """The cross-entropy of logits whose classes are split over ``group`` (this rank holds
    the ``rank``-th equal slice), equal on every rank to the unsplit one; chunked as
    :func:`chunked_cross_entropy`, so neither the whole ``[tokens, vocab]`` logits nor any
    fp32 copy of the local slice exists (Megatron's vocabulary-parallel cross-entropy)."""
    reduction = _reduction(reduction)
    _check_chunkable(logits, target)
    return _ChunkedCrossEntropy.apply(logits, target, None, int(ignore_index), reduction,
                                      float(label_smoothing), group)
