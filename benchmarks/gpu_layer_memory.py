"""One GPU, a real model's layers at real sizes: modelled vs measured memory and step time.

The 125M GPT of ``gpu_step.py`` is small enough that its steps are host-bound and its
activations a few GiB. What the planner gets wrong at scale (issue 11: torchtitan's Llama 3
8B at sequence 8192 measured far below the modelled memory) sits in full-size layers. This
script trains a Llama-3-8B-shaped model cut to a few layers (hidden 4096, 32 heads, 8 K/V
heads, FFN 14336, vocab 128256, sequence 8192) through ``autopar.parallelize`` on
``1xH100-80GB``, bf16, for each recomputation mode and two depths, and prints per row:

- the modelled and measured step time (CUDA-synchronized median over ``--steps``);
- the state bytes held between steps: modelled parameters + optimizer states against
  ``torch.cuda.memory_allocated()`` before a step (gradients set to None);
- what forward leaves alive for backward (``memory_allocated()`` after a forward, minus
  that base) against the modelled ``forward_end`` phase minus the states;
- what forward + backward add to those states at their peak (the modelled
  ``memory_phases`` forward_end / backward_start) against ``max_memory_allocated()`` over
  ``train_step`` minus the measured base; and the optimizer step's peak, modelled and measured;

and then, per recomputation mode, the same differences between the two depths divided by
the layers between them: **one layer's** activation memory and time, modelled vs measured,
free of the embedding, the head and the loss.

    python benchmarks/gpu_layer_memory.py                       # needs CUDA; ~3 minutes
    python benchmarks/gpu_layer_memory.py --layers 2,4 --recompute none,op,full --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback

import torch

import autopar
from autopar.models import resolve_model
from autopar.runtime.parallel_module import find_loss

LLAMA3_8B_LAYER = ("llama:layers={layers},hidden=4096,heads=32,kv_heads=8,ffn=14336,"
                   "vocab=128256,seq={seq},batch={batch},rope_theta=500000")


def measure(layers: int, recompute: str, args: argparse.Namespace) -> dict:
    spec = resolve_model(args.model.format(layers=layers, seq=args.seq, batch=args.batch))
    torch.manual_seed(0)
    model = spec.build()
    a, k = spec.example_inputs(args.batch, args.seq, "cpu")
    started = time.perf_counter()
    pm = autopar.parallelize(model, args.cluster, (a, k), precision="bf16",
                             recompute=(recompute,))
    plan_s = time.perf_counter() - started
    del model
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}}[args.adamw]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-5, **impl)
    la, lk = pm.shard_batch(*a, **k)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = pm.train_step(*la, **lk)
        opt.step()
        return float(loss)

    losses = [step() for _ in range(2)]
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()  # weights and optimizer states, no gradients
    times, train_peaks, opt_peaks, kept = [], [], [], []
    for i in range(args.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        if i == 0 and pm.plan.batch["microbatches"] == 1:  # once, by hand: what forward keeps
            loss = find_loss(pm(*la, **lk))
            torch.cuda.synchronize()
            kept.append(torch.cuda.memory_allocated() - base)
            loss.backward()
            del loss
        else:
            pm.train_step(*la, **lk)  # forward and backward: the activation peaks
        torch.cuda.synchronize()
        train_peaks.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        opt_peaks.append(torch.cuda.max_memory_allocated())
        times.append(time.perf_counter() - t)
    p = pm.plan.predicted
    mem, phases = p["memory"], p.get("memory_phases", {})
    states = mem["params"] + mem["optimizer"]
    train_pred = max(phases.get("forward_end", 0), phases.get("backward_start", 0))
    row = {
        "layers": layers, "recompute": pm.plan.training["recompute"], "plan_s": plan_s,
        "microbatches": pm.plan.batch["microbatches"], "losses": losses,
        "predicted_step_s": p["step_time_s"], "measured_step_s": statistics.median(times),
        "predicted_memory": mem, "predicted_phases": phases,
        "predicted_states_bytes": states, "measured_states_bytes": base,
        # what forward leaves alive for backward (its output, the loss, is a scalar)
        "predicted_kept_bytes": phases.get("forward_end", 0) - states,
        "measured_kept_bytes": kept[0] if kept else float("nan"),
        # what forward + backward add on top of the states at their peak
        "predicted_train_adds_bytes": train_pred - states,
        "measured_train_adds_bytes": max(train_peaks) - base,
        "predicted_optimizer_peak_bytes": phases.get("optimizer_step", 0),
        "measured_optimizer_peak_bytes": max(opt_peaks),
        "predicted_peak_bytes": p["peak_memory_bytes"],
        "measured_peak_bytes": max(max(train_peaks), max(opt_peaks)),
    }
    return row  # the module and optimizer go with this frame (the caller empties the cache)


def _pair(row: dict, what: str) -> str:
    gib = 2**30
    return f"{row['predicted_' + what] / gib:.2f}/{row['measured_' + what] / gib:.2f}"


def _ratio(row: dict, what: str) -> float:
    pred = row["predicted_" + what]
    return row["measured_" + what] / pred if pred else float("nan")


def per_layer(rows: list[dict]) -> list[dict]:
    """One layer's figures: the difference between the deepest and shallowest row of each
    recomputation mode over the layers between them."""
    out = []
    for mode in dict.fromkeys(r["recompute"] for r in rows):
        same = sorted((r for r in rows if r["recompute"] == mode), key=lambda r: r["layers"])
        if len(same) < 2:
            continue
        lo, hi = same[0], same[-1]
        n = hi["layers"] - lo["layers"]
        out.append({"recompute": mode, "layers_between": n, **{
            f"{kind}_{what}": (hi[f"{kind}_{what}"] - lo[f"{kind}_{what}"]) / n
            for kind in ("predicted", "measured")
            for what in ("step_s", "states_bytes", "kept_bytes", "train_adds_bytes")}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=LLAMA3_8B_LAYER,
                    help="a model spec with {layers}, {seq} and {batch} to fill in")
    ap.add_argument("--cluster", default="1xH100-80GB")
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--recompute", default="none,op,full")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--adamw", choices=("fused", "foreach"), default="fused",
                    help="AdamW's implementation (foreach is torch's default on CUDA)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_layer_memory.py measures a GPU; none is available here", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch} x "
          f"seq {args.seq}; {args.adamw} AdamW; all 'pred' figures modelled, 'meas' measured\n")
    print(f"{'layers':>6} {'recomp':>7} | {'pred ms':>8} {'meas ms':>8} {'ratio':>6} | "
          f"{'states GiB p/m':>15} | {'kept GiB p/m':>14} | {'fwd+bwd adds GiB p/m':>20} "
          f"{'ratio':>6} | {'optimizer peak GiB p/m':>22} | {'peak GiB p/m':>14}", flush=True)
    rows: list[dict] = []
    for mode in args.recompute.split(","):
        for layers in map(int, args.layers.split(",")):
            try:
                r = measure(layers, mode, args)
            except Exception as exc:  # one failing row must not hide the others
                traceback.print_exc()
                rows.append({"layers": layers, "recompute": mode,
                             "error": f"{type(exc).__name__}: {exc}"})
                print(f"{layers:>6} {mode:>7} | failed: {type(exc).__name__}: {str(exc)[:200]}",
                      flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            rows.append(r)
            gc.collect()
            torch.cuda.empty_cache()
            print(f"{layers:>6} {r['recompute']:>7} | {r['predicted_step_s'] * 1e3:>8.1f} "
                  f"{r['measured_step_s'] * 1e3:>8.1f} "
                  f"{r['measured_step_s'] / r['predicted_step_s']:>6.2f} | "
                  f"{_pair(r, 'states_bytes'):>15} | {_pair(r, 'kept_bytes'):>14} | "
                  f"{_pair(r, 'train_adds_bytes'):>20} {_ratio(r, 'train_adds_bytes'):>6.2f} | "
                  f"{_pair(r, 'optimizer_peak_bytes'):>22} | {_pair(r, 'peak_bytes'):>14}",
                  flush=True)
    layer_rows = per_layer([r for r in rows if "error" not in r])
    if layer_rows:
        print("\none layer (difference between depths / layers between them):")
        print(f"{'recomp':>7} | {'pred ms':>8} {'meas ms':>8} {'ratio':>6} | "
              f"{'states GiB p/m':>15} | {'kept GiB p/m':>14} {'ratio':>6} | "
              f"{'fwd+bwd adds GiB p/m':>20} {'ratio':>6}")
        for r in layer_rows:
            print(f"{r['recompute']:>7} | {r['predicted_step_s'] * 1e3:>8.2f} "
                  f"{r['measured_step_s'] * 1e3:>8.2f} "
                  f"{r['measured_step_s'] / r['predicted_step_s']:>6.2f} | "
                  f"{_pair(r, 'states_bytes'):>15} | {_pair(r, 'kept_bytes'):>14} "
                  f"{_ratio(r, 'kept_bytes'):>6.2f} | {_pair(r, 'train_adds_bytes'):>20} "
                  f"{_ratio(r, 'train_adds_bytes'):>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "batch": args.batch, "seq": args.seq, "rows": rows,
                       "per_layer": layer_rows}, f, indent=1)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
