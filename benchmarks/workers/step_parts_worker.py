"""One process of benchmarks/cpu_step_parts.py (run under torchrun).

Trains the demo GPT (``autopar.cli.demo_data``) on this process's share of a batch with
AdamW and times each step's forward, backward and optimizer step. ``--sync none``: every
process trains its own replica (what sharing the cores costs, without communication);
``ddp``: DistributedDataParallel over gloo with ``gradient_as_bucket_view`` as autopar's
runtime runs it; ``ddp-one-bucket``: one bucket, all-reduced after backward ends;
``autopar``: ``autopar.parallelize`` with dp pinned to the processes (its ``train_step``,
forward and backward together, is reported as the backward; the forward as 0), so its
runtime's cost over plain DDP shows. Rank 0 writes the slowest rank's medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from autopar.cli.demo_data import demo_batches, demo_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sync", choices=("none", "ddp", "ddp-one-bucket", "autopar", "autopar-zero1",
                                 "autopar-zero2", "autopar-zero3"),
                        default="none")
    parser.add_argument("--batch", type=int, default=4, help="sequences per process")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model: torch.nn.Module = demo_model()
    x, y = demo_batches(1)[0]
    x, y = x.repeat(args.batch, 1)[:args.batch], y.repeat(args.batch, 1)[:args.batch]
    zero = int(args.sync[-1]) if args.sync.startswith("autopar-zero") else 0
    if args.sync.startswith("autopar"):  # the global batch is every process's batch side by side;
        import autopar  # parallelize starts the process group (it traces before it may)

        world = int(os.environ["WORLD_SIZE"])
        gx, gy = x.repeat(world, 1), y.repeat(world, 1)
        model = autopar.parallelize(model, f"{world}xcpu", (gx, gy), dp=world, tp=1, pp=1,
                                    zero=zero, microbatches=1, recompute="none")
        (x, y), _ = model.shard_batch(gx, gy)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if args.sync in ("ddp", "ddp-one-bucket") and dist.get_world_size() > 1:
        if args.sync == "ddp-one-bucket":
            dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 40  # DDP's first bucket is 1 MiB otherwise
        model = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=True,
            bucket_cap_mb=1 << 20 if args.sync == "ddp-one-bucket" else 25)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parts = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        if args.sync.startswith("autopar"):  # forward and backward in one call
            model.train_step(x, y)
            forward = start
        else:
            _, loss = model(x, y)
            forward = time.perf_counter()
            loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        parts.append((forward - start, backward - forward, end - backward, end - start))
    warm = parts[len(parts) // 5:]
    medians = torch.tensor([statistics.median(p[i] for p in warm) for i in range(4)],
                           dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
    if dist.get_rank() == 0:
        names = ("forward_s", "backward_s", "optimizer_s", "step_s")
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"world_size": dist.get_world_size(), "sync": args.sync,
                       "batch": args.batch, **dict(zip(names, medians.tolist()))}, f)
    del model, optimizer  # DDP's reducer first: gloo's shutdown beside it hung 1 launch in 4
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
