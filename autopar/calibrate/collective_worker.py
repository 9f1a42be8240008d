"""One rank of the collective benchmark; ``autopar calibrate`` launches it with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        autopar/calibrate/collective_worker.py --out points.json --sizes 1024,1048576

It is run as a script, not imported, and uses only torch and the standard library, so each
rank starts in a second instead of importing all of autopar. Every rank times each
collective after a barrier, in batches of back-to-back calls (as nccl-tests does); the
slowest rank's time counts, since a collective ends when its last rank does. Rank 0 writes
``[{"kind", "bytes", "seconds"}, ...]`` to ``--out``; ``bytes`` is the whole tensor (the
all-reduced tensor, the all-gather's output, the reduce-scatter's input, the all-to-all's
input on one rank, the broadcast tensor), the size convention of nccl-tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autopar.runtime.teardown import leave

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _ops(
    nbytes: int, world: int, device: torch.device
) -> tuple[int, dict[str, Callable[[], object]]]:
    """The bytes actually used (fp32, divisible by ``world``) and each collective on them."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel, device=device)
    out = torch.empty(numel, device=device)
    shard = torch.ones(numel // world, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return numel * 4, {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: gather(out, shard),
        "reduce_scatter": lambda: scatter(shard, full),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
        "broadcast": lambda: dist.broadcast(full, 0),
    }


def _time(fn: Callable[[], object], device: torch.device, repeats: int, batch_s: float) -> float:
    """Median over ``repeats`` of the slowest rank's seconds per call."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    sync()
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank must agree on the batch size
    inner = max(1, min(200, math.ceil(batch_s / max(once.item(), 1e-7))))
    samples = torch.zeros(repeats, dtype=torch.float64, device=device)
    for r in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples[r] = (time.perf_counter() - start) / inner
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return statistics.median(samples.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--sizes", required=True, help="comma-separated tensor sizes in bytes")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    points = []
    try:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            used, ops = _ops(nbytes, world, device)
            for kind in args.kinds.split(","):
                seconds = _time(ops[kind], device, args.repeats, args.batch_ms / 1e3)
                points.append({"kind": kind, "bytes": used, "seconds": seconds})
        if dist.get_rank() == 0:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"world_size": world, "backend": dist.get_backend(), "points": points}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()  # not through the interpreter's teardown (autopar.runtime.teardown)


if __name__ == "__main__":
    main()
