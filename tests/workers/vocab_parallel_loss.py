"""Vocabulary-parallel cross-entropy on real gloo processes against one device: every
rank's loss equals the unsplit cross-entropy's, and its slice of the logits' gradient the
same slice of the unsplit gradient. Each rank writes ``rank<r>.json`` into
``$AUTOPAR_TEST_OUT``.

    torchrun --nproc-per-node 2 tests/workers/vocab_parallel_loss.py --case '{"reduction": "mean"}'
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import serve_cases  # noqa: E402

import autopar.ops.loss_ops as loss_ops  # noqa: E402

TOL = 1e-5


def run_case(case: dict) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    loss_ops.CHUNK_ELEMENTS = 64  # several blocks of tokens
    g = torch.Generator().manual_seed(0)  # every rank draws the same global tensors
    tokens, vocab = 19, 12 * n
    x = torch.randn(tokens, vocab, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[[1, 7]] = -100
    reduction, smoothing = case["reduction"], case.get("label_smoothing", 0.0)
    upstream = torch.randn(tokens if reduction == "none" else (), generator=g,
                           dtype=torch.float64)
    whole = x.clone().requires_grad_()
    ref = F.cross_entropy(whole, target, reduction=reduction, label_smoothing=smoothing)
    (ref * upstream).sum().backward()
    per = vocab // n
    mine = x[:, rank * per:(rank + 1) * per].float().clone().requires_grad_()
    loss = loss_ops.vocab_parallel_cross_entropy(mine, target, dist.group.WORLD,
                                                 reduction=reduction,
                                                 label_smoothing=smoothing)
    (loss * upstream.float()).sum().backward()
    diffs = {"loss": (loss.double() - ref).abs().max().item(),
             "grad": (mine.grad.double() - whole.grad[:, rank * per:(rank + 1) * per])
             .abs().max().item()}
    return {"case": case, "rank": rank, "diffs": diffs,
            "ok": all(d <= TOL for d in diffs.values())}


if __name__ == "__main__":
    serve_cases(run_case)
