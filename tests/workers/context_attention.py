"""Context-parallel attention (all-gather K/V or ring) on real gloo processes against one device:
each rank's output, log-sum-exp and dQ/dK/dV for its sequence shard equal the same
positions of the unsharded attention's. Each rank writes ``rank<r>.json`` into
``$AUTOPAR_TEST_OUT``.

    torchrun --nproc-per-node 2 tests/workers/context_attention.py --case '{"causal": true}'
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import serve_cases  # noqa: E402

from autopar.core.placements import Shard  # noqa: E402
from autopar.kernels import attention  # noqa: E402
from autopar.ops.comm_ops import local_slice  # noqa: E402
from autopar.ops.context_ops import (  # noqa: E402
    all_gather_kv_attention,
    ring_kv_attention,
)

TOL = 1e-5


def run_case(case: dict) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    zigzag = case.get("zigzag", False)
    opts = {k: (tuple(v) if k == "window" else v) for k, v in case.items()
            if k in ("causal", "window")}
    g = torch.Generator().manual_seed(0)  # every rank draws the same global tensors
    heads, kv_heads, seq = 4, case.get("kv_heads", 4), 32
    q = torch.randn(2, heads, seq, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, 16, generator=g) for _ in range(2))
    do, dl = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)

    def loss(out, lse):
        return (out * do_part).sum() + (lse * dl_part).sum()

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*ref, return_lse=True, **opts)
    do_part, dl_part = do, dl
    loss(out, lse).backward()

    def mine(x):
        return local_slice(x, Shard(2), cp, rank, zigzag)

    local = [mine(t).detach().clone().requires_grad_() for t in (q, k, v)]
    if case.get("algorithm") == "ring":
        out_l, lse_l = ring_kv_attention(*local, dist.group.WORLD, zigzag=zigzag, **opts)
    else:
        out_l, lse_l = all_gather_kv_attention(*local, zigzag=zigzag, **opts)
    do_part, dl_part = mine(do), mine(dl)
    loss(out_l, lse_l).backward()
    diffs = {name: (a - mine(b)).abs().max().item() for name, a, b in (
        ("out", out_l, out), ("lse", lse_l, lse), ("dq", local[0].grad, ref[0].grad),
        ("dk", local[1].grad, ref[1].grad), ("dv", local[2].grad, ref[2].grad))}
    return {"case": case, "rank": rank, "diffs": diffs,
            "ok": all(d <= TOL for d in diffs.values())}


if __name__ == "__main__":
    serve_cases(run_case)
