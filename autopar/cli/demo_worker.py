"""One process of ``autopar demo`` (started by torchrun): parallelize, train, report.

    python -m torch.distributed.run --nproc-per-node 2 -m autopar.cli.demo_worker --out r.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from autopar.api.parallelize import parallelize
from autopar.cli.demo_data import demo_batches, demo_model
from autopar.runtime.teardown import leave


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cluster", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--record-run", default=None, help="record the steps into this directory")
    ap.add_argument("--plan", default=None, help="run this plan (JSON) instead of planning")
    args = ap.parse_args()

    model = demo_model()
    batches = demo_batches(args.steps)
    world = dist.get_world_size() if dist.is_initialized() else int(
        __import__("os").environ.get("WORLD_SIZE", 1)
    )
    cluster = args.cluster or f"{world}xcpu"
    started = time.perf_counter()
    pm = parallelize(model, cluster, batches[0], plan=args.plan)
    setup_s = time.perf_counter() - started
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    losses, step_s = [], []
    recorder = pm.record_run(args.record_run) if args.record_run else None
    for inputs in batches:
        t = time.perf_counter()
        a, k = pm.shard_batch(*inputs)
        opt.zero_grad()
        losses.append(pm.train_step(*a, **k).item())
        opt.step()
        step_s.append(time.perf_counter() - t)
    if recorder is not None:
        recorder.close()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "step_s": step_s, "setup_s": setup_s,
                       "plan": pm.plan.to_dict()}, f)


if __name__ == "__main__":
    main()
    leave()
