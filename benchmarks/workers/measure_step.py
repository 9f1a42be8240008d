"""One process of benchmarks/fidelity_measured.py (run under torchrun).

Plans a GPT with pinned dp/tp/recompute, trains warm-up steps, then measures the peak of live
tensor bytes over one full step (forward, backward, optimizer) with torch's MemTracker and
the median step time, and writes them next to the plan's predictions as JSON.
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
from autopar.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--cp-algorithm", default=None)
    ap.add_argument("--recompute", default="none",
                    help="a mode, or one per layer, comma-separated (recompute per layer)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--offload", default="none", help="none or optimizer+params (ZeRO-3)")
    ap.add_argument("--lora", choices=("none", "lora", "qlora"), default="none",
                    help="LoRA adapters (rank 8) on the attention and MLP input linears")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--no-chunked-loss", dest="chunked_loss", action="store_false")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cluster = yaml.safe_load(open(args.cluster))
    cluster.update(nodes=1, devices_per_node=world)  # (the benchmark writes one per size)
    if "profile" in cluster and not os.path.isabs(cluster["profile"]):
        cluster["profile"] = os.path.join(os.path.dirname(os.path.abspath(args.cluster)),
                                          cluster["profile"])
    model = GPT(GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                          n_head=8, n_embd=args.hidden))
    if args.lora != "none":
        from autopar.models.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(rank=8, alpha=16, targets=("c_attn", "c_fc"),
                                     quantize="nf4" if args.lora == "qlora" else None))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    cp = {"cp": args.cp, "cp_algorithm": args.cp_algorithm} if args.cp > 1 else {}
    modes = args.recompute.split(",")
    per_layer = {"recompute_layers": tuple(modes)} if len(modes) > 1 else {}
    pm = autopar.parallelize(model, cluster, (idx, tgt), dp=args.dp, tp=args.tp,
                             zero=(args.zero,), recompute=(modes[0],),
                             precision=args.precision, offload=args.offload, **per_layer,
                             microbatch=args.batch // args.dp // args.microbatches,
                             tp_splits_batch=False,
                             chunked_loss=args.chunked_loss, **cp)
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
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    tracker = MemTracker()
    tracker.track_external(pm, opt)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    device_peak = next(iter(peak.values()))
    rank = dist.get_rank() if dist.is_initialized() else 0
    record = {
        "rank": rank, "mesh": pm.plan.mesh, "recompute": pm.plan.training["recompute"],
        "precision": pm.plan.training["precision"],
        "cp_algorithm": pm.plan.context.get("algorithm"),
        "measured_peak_bytes": device_peak["Total"],
        "measured_by_kind": {str(kind).split(".")[-1]: v for kind, v in device_peak.items()},
        "measured_step_s": statistics.median(times),
        # offloaded states sit in host memory, which on a CPU is where everything is
        "predicted_peak_bytes": pm.plan.predicted["peak_memory_bytes"]
        + (pm.plan.predicted["memory"].get("host", 0) if pm.mesh_context.device.type == "cpu"
           else 0),
        "predicted_memory": pm.plan.predicted["memory"],
        "predicted_step_s": pm.plan.predicted["step_time_s"],
        "tp_sharded": sum(1 for ax in pm.plan.params.values() if ax.get("tp", "R") != "R"),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
