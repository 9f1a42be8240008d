"""One GPU: fp8 GEMMs against bf16 ones at transformer shapes, measured vs modelled.

autopar prices an fp8 matmul (``torch._scaled_mm``, e4m3 operands, tensorwise scales, bf16
output: what torchao's ``Float8Linear`` and autopar's fp8 runtime run) at the device's fp8
peak times the same matmul efficiency as bf16. No published source gives that efficiency,
and fp8 rows of every fidelity source but one came out optimistic (issue 11). This script
measures it: the linear layers of Llama 3 8B and 70B at 8,192 tokens, forward shapes
(tokens x in -> out) and the two backward ones, each as a bf16 ``mm`` and an fp8
``_scaled_mm``, plus what quantizing one bf16 operand to fp8 costs (amax, scale, cast), and
prints measured TFLOP/s next to :func:`autopar.cost_models.compute.op_time`'s modelled ones.

    python benchmarks/gpu_fp8_gemm.py                  # needs a GPU with fp8 (sm_89+); ~20 s
    python benchmarks/gpu_fp8_gemm.py --device-preset H200 --json fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from attention import cuda_seconds  # benchmarks/attention.py (this script's folder)

from autopar.core.cluster import load_cluster
from autopar.cost_models.compute import op_time
from autopar.ops.fp8_ops import E4M3, quantize

LINEARS = {  # name: (in features, out features)
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B up+gate": (4096, 28672),
    "8B down": (14336, 4096),
    "70B qkv": (8192, 10240), "70B o": (8192, 8192), "70B up+gate": (8192, 57344),
    "70B down": (28672, 8192),
}


def measure(m: int, k: int, n: int, repeats: int) -> dict:
    """One (m x k) @ (k x n) product in bf16 and fp8; the fp8 weight operand is made
    column-major, as ``_scaled_mm`` needs its second operand."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf16_s = cuda_seconds(lambda: a @ w.t(), repeats)
    (qa, sa), (qw, sw) = quantize(a, E4M3), quantize(w, E4M3)  # autopar's runtime cast
    fp8_s = cuda_seconds(lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa.reciprocal(),
                                                  scale_b=sw.reciprocal(),
                                                  out_dtype=torch.bfloat16), repeats)
    cast_s = cuda_seconds(lambda: quantize(a, E4M3), repeats)
    return {"m": m, "k": k, "n": n, "flops": 2.0 * m * n * k, "bf16_s": bf16_s,
            "fp8_s": fp8_s, "quantize_a_s": cast_s}


def modelled(row: dict, device) -> tuple[float, float]:
    """The cost model's seconds for this product in bf16 and fp8 (operands and output)."""
    m, k, n = row["m"], row["k"], row["n"]
    bf16 = op_time(row["flops"], 2 * (m * k + k * n + m * n), device, "bf16", shape=(m, n, k))
    fp8 = op_time(row["flops"], m * k + k * n + 2 * m * n, device, "fp8", shape=(m, n, k))
    return bf16, fp8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device-preset", default="H200",
                    help="the cluster preset whose device the modelled figures use")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("gpu_fp8_gemm.py needs a GPU with fp8 matmuls (sm_89 or later)", file=sys.stderr)
        return 2
    device = load_cluster(args.device_preset).device
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; modelled on the "
          f"{args.device_preset} preset; TFLOP/s = 2mnk / time; 'pred' modelled, 'meas' "
          "measured (CUDA events, median)\n")
    print(f"{'linear':>12} {'pass':>5} {'m x k x n':>20} | {'bf16 p/m':>13} | {'fp8 p/m':>15} | "
          f"{'fp8/bf16 p/m':>12} | {'quantize a ms':>13}", flush=True)
    rows = []
    t = args.tokens
    for name, (fin, fout) in LINEARS.items():
        # forward (tokens x in -> out), input gradient (tokens x out -> in), weight gradient
        # (in x tokens -> out)
        for what, (m, k, n) in (("fwd", (t, fin, fout)), ("dgrad", (t, fout, fin)),
                                ("wgrad", (fin, t, fout))):
            row = {"linear": name, "pass": what, **measure(m, k, n, args.repeats)}
            row["pred_bf16_s"], row["pred_fp8_s"] = modelled(row, device)
            rows.append(row)
            tf = {key: row["flops"] / row[key] / 1e12
                  for key in ("bf16_s", "fp8_s", "pred_bf16_s", "pred_fp8_s")}
            print(f"{name:>12} {what:>5} {f'{m}x{k}x{n}':>20} | "
                  f"{tf['pred_bf16_s']:>5.0f}/{tf['bf16_s']:<6.0f} | "
                  f"{tf['pred_fp8_s']:>6.0f}/{tf['fp8_s']:<7.0f} | "
                  f"{tf['pred_fp8_s'] / tf['pred_bf16_s']:>5.2f}/"
                  f"{tf['fp8_s'] / tf['bf16_s']:<6.2f} | {row['quantize_a_s'] * 1e3:>13.3f}",
                  flush=True)
            torch.cuda.empty_cache()
    speedups = [r["bf16_s"] / r["fp8_s"] for r in rows]
    print(f"\nfp8 over bf16, measured: median {statistics.median(speedups):.2f}x, "
          f"range {min(speedups):.2f}-{max(speedups):.2f}x; modelled "
          f"{statistics.median(r['pred_bf16_s'] / r['pred_fp8_s'] for r in rows):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "preset": args.device_preset, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
