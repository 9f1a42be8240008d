"""One process of benchmarks/moe.py (run under torchrun).

Plans an MoE GPT (tokens sorted by expert, grouped matmuls) with pinned dp and ep, trains
warm-up steps, then measures the median step time and the peak of live tensor bytes over
one step (torch's MemTracker), and writes them beside the plan's predictions as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import yaml
from torch.distributed._tools.mem_tracker import MemTracker

import autopar
from autopar.models.moe import MoEConfig, MoEGPT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cluster = yaml.safe_load(open(args.cluster))
    cluster.update(nodes=1, devices_per_node=world)
    if "profile" in cluster and not os.path.isabs(cluster["profile"]):
        cluster["profile"] = os.path.join(os.path.dirname(os.path.abspath(args.cluster)),
                                          cluster["profile"])
    model = MoEGPT(MoEConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                             n_head=8, n_embd=args.hidden, experts=args.experts, top_k=2,
                             expert_ffn=args.expert_ffn, routing="sorted"))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    pm = autopar.parallelize(model, cluster, (idx, tgt), dp=args.dp, ep=args.ep, tp=1, pp=1,
                             zero=(0,), recompute=("none",), microbatch=args.batch // args.dp)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    a, k = pm.shard_batch(idx, tgt)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pm.train_step(*a, **k)
        opt.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    tracker = MemTracker()
    tracker.track_external(pm, opt)
    with tracker:
        step()
    device_peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    rank = dist.get_rank()
    experts = pm.plan.explanation.get("experts", {})
    record = {
        "rank": rank, "mesh": pm.plan.mesh,
        "measured_peak_bytes": device_peak["Total"],
        "measured_step_s": statistics.median(times),
        "predicted_peak_bytes": pm.plan.predicted["peak_memory_bytes"],
        "predicted_step_s": pm.plan.predicted["step_time_s"],
        "all_to_all_bytes": experts.get("all_to_all_bytes_per_step", 0),
        "all_to_all_s": experts.get("all_to_all_s", 0.0),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
