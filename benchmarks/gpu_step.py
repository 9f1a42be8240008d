"""One GPU, real training steps: the plan's predicted step time and peak memory vs measured.

Trains a GPT-2-small-class model (125M parameters: 12 layers, hidden 768, 12 heads, vocab
50304, sequence 1024) through ``autopar.parallelize`` on a ``1xH100-80GB`` cluster (or
``--cluster``): the automatic plan, then pinned alternatives (precision bf16/fp32,
recomputation none/full, generated attention kernels off). Each row gives the plan's
**modelled** step time and peak memory beside the **measured** median step time (CUDA
synchronized wall time over ``--steps`` AdamW steps after warm-up) and
``torch.cuda.max_memory_allocated``, and the ratios; then the ranking question: is the
automatic plan the fastest measured (its regret, ``auto / best - 1``)?

Before the rows it measures the device as ``autopar calibrate`` does (matmul efficiency by
size, attention efficiency), so a wrong prediction can be traced to the device numbers or
to the model of the step.

    python benchmarks/gpu_step.py                 # needs CUDA; about two minutes
    python benchmarks/gpu_step.py --batch 16 --json gpu_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch

import autopar
from autopar.models import GPT, GPTConfig

VARIANTS = {
    "auto": {},
    "bf16, no recompute": {"precision": "bf16", "recompute": ("none",)},
    "bf16, full recompute": {"precision": "bf16", "recompute": ("full",)},
    "fp32, no recompute": {"precision": "fp32", "recompute": ("none",)},
    "auto, SDPA (no generated kernels)": {"fuse_attention": False},
}


def calibrate() -> dict:
    """The device's measured efficiencies (``autopar calibrate``'s device part, quick)."""
    from autopar.calibrate import calibrate_device
    from autopar.cli.calibrate_cmd import format_device

    device = calibrate_device("cuda", quick=True)
    print(format_device(device), flush=True)
    return {"matmul_efficiency_curve": device.matmul_efficiency_curve,
            "attention_efficiency": device.attention_efficiency,
            "kernel_floor_s": device.kernel_floor_s}


def measure(name: str, options: dict, args: argparse.Namespace) -> dict:
    """Plan and train one variant; its predicted and measured figures."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, vocab_size=50304, n_layer=args.layers, n_head=12,
                    n_embd=768, bias=False)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    started = time.perf_counter()
    # the fused AdamW built below, priced as it runs
    pm = autopar.parallelize(model, args.cluster, (idx, tgt), optimizer="adamw_fused", **options)
    plan_s = time.perf_counter() - started
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)
    a, k = pm.shard_batch(idx, tgt)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = pm.train_step(*a, **k)
        opt.step()
        return float(loss)

    losses = [step() for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    opt_times = []
    for _ in range(3):  # the optimizer alone (the step above includes it)
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        opt_times.append(time.perf_counter() - t)
    plan = pm.plan
    tr = plan.training
    return {
        "variant": name, "plan_s": plan_s,
        "precision": tr.get("precision"), "recompute": tr.get("recompute"),
        "microbatch": plan.batch.get("microbatch"), "microbatches": plan.batch.get("microbatches"),
        "fused_attention": sum(1 for site in plan.attention if site.get("fused")),
        "predicted_compute_s": plan.predicted["compute_s"],
        "predicted_optimizer_s": plan.predicted["optimizer_s"],
        "predicted_memory": plan.predicted["memory"],
        "predicted_mfu": plan.predicted["mfu"],
        "measured_mfu": plan.predicted["mfu"] * plan.predicted["step_time_s"]
        / statistics.median(times),
        "measured_optimizer_s": statistics.median(opt_times),
        "predicted_step_s": plan.predicted["step_time_s"],
        "measured_step_s": statistics.median(times),
        "predicted_peak_bytes": plan.predicted["peak_memory_bytes"],
        "measured_peak_bytes": torch.cuda.max_memory_allocated(),
        "first_losses": losses,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="1xH100-80GB")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default=";".join(VARIANTS),
                    help="which variants, names separated by ';' (default: all)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step.py measures a GPU; none is available here", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPT {args.layers} "
          f"layers x 768, batch {args.batch} x seq {args.seq}\n", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "calibration": calibrate(), "rows": []}
    print(f"\n{'variant':<36} {'prec':>5} {'recomp':>7} {'mb':>3} | {'pred ms':>8} "
          f"{'meas ms':>8} {'meas/pred':>9} | {'pred GiB':>8} {'meas GiB':>8} {'meas/pred':>9}")
    for name in args.variants.split(";"):
        torch.cuda.empty_cache()
        try:
            row = measure(name, VARIANTS[name], args)
        except Exception as exc:  # one variant failing must not hide the others' figures
            traceback.print_exc()
            result["rows"].append({"variant": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{name:<36} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        result["rows"].append(row)
        gib = 2**30
        print(f"{name:<36} {row['precision']!s:>5} {str(row['recompute'])[:7]:>7} "
              f"{row['microbatch']!s:>3} | {row['predicted_step_s'] * 1e3:>8.1f} "
              f"{row['measured_step_s'] * 1e3:>8.1f} "
              f"{row['measured_step_s'] / row['predicted_step_s']:>9.2f} | "
              f"{row['predicted_peak_bytes'] / gib:>8.2f} {row['measured_peak_bytes'] / gib:>8.2f} "
              f"{row['measured_peak_bytes'] / row['predicted_peak_bytes']:>9.2f}", flush=True)
    done = [r for r in result["rows"] if "error" not in r]
    auto = next((r for r in done if r["variant"] == "auto"), None)
    if auto and done:
        best = min(done, key=lambda r: r["measured_step_s"])
        pred_best = min(done, key=lambda r: r["predicted_step_s"])
        print(f"\nmeasured fastest: {best['variant']}; predicted fastest: {pred_best['variant']}; "
              f"regret of the automatic plan (measured): "
              f"{auto['measured_step_s'] / best['measured_step_s'] - 1:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
