"""Llama 3 70B on 16 x 8 H100-80GB planned in fp32, bf16 and fp8: what per-node precision
covers, and what it changes in the predicted step (every figure **modelled**).

For each precision it prints the plan the solver picks, its step time, TFLOP/s per device,
peak memory, the nodes per dtype, and checks the policy on the plan's ``precision`` map:
every normalisation, softmax and cross-entropy node fp32, and the share of matmul nodes
(linears, attention) computing in bf16 or fp8.

    python benchmarks/precision_plans.py                 # llama3-70b, 16x8xH100-80GB
    python benchmarks/precision_plans.py --model llama3-8b --cluster 8xH100-80GB
"""

from __future__ import annotations

import argparse
import time

import autopar
from autopar.analysis.precision import KEPT_FP32, LOWERED_TARGETS, NORM_MODULE_SUFFIXES
from autopar.cli.load import trace_model
from autopar.core.graph_facts import META_KEY

PRECISIONS = ("fp32", "bf16", "fp8")


def coverage(gm, plan) -> dict[str, float]:
    """Shares of the policy's promises the plan keeps (1.0 = all): normalisation (the
    statistics and the normalised value; a norm module's trailing weight multiply applies in
    its input's dtype, as HF's and torchtitan's RMSNorm do), softmax and loss nodes in fp32,
    and matmul nodes (linears, attention) in bf16 or fp8."""
    words = plan.precision
    kept = {n for names in plan.precision_policy.get("kept_fp32", {}).values() for n in names}
    fp32, lowered = [], []
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is None or node.name not in words:
            continue
        if facts.target in KEPT_FP32 or (facts.module_type.endswith(NORM_MODULE_SUFFIXES)
                                         and node.name in kept):
            fp32.append(words[node.name] == "fp32")
        elif facts.target in LOWERED_TARGETS:
            lowered.append(words[node.name] in ("bf16", "fp8"))
    norm_nodes = sum(1 for n in gm.graph.nodes if n.name in words and META_KEY in n.meta
                     and n.meta[META_KEY].module_type.endswith(NORM_MODULE_SUFFIXES))
    return {"normalisation/softmax/loss nodes fp32": sum(fp32) / max(len(fp32), 1),
            "matmul nodes bf16 or fp8": sum(lowered) / max(len(lowered), 1),
            "checked": len(fp32) + len(lowered), "nodes in norm modules": norm_nodes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--cluster", default="16x8xH100-80GB")
    args = ap.parse_args()
    traced = trace_model(args.model, None, None)
    print(f"{args.model} on {args.cluster} (modelled; traced in {traced.trace_s:.1f} s, measured)")
    print(f"{'precision':<10}{'mesh':<22}{'zero':>5}{'recompute':>10}{'step s':>10}"
          f"{'TFLOP/s':>9}{'peak GiB':>10}{'plan s':>8}  nodes per dtype")
    rows = {}
    for precision in PRECISIONS:
        start = time.perf_counter()
        plan = autopar.plan(traced.gm, args.cluster, global_batch=traced.batch,
                            precision=precision, model_name=args.model)
        wall = time.perf_counter() - start
        p = plan.predicted
        counts: dict[str, int] = {}
        for w in plan.precision.values():
            counts[w] = counts.get(w, 0) + 1
        mesh = "x".join(f"{a}{n}" for a, n in plan.mesh.items())
        print(f"{precision:<10}{mesh:<22}{plan.training['zero']:>5}"
              f"{plan.training['recompute']:>10}{p['step_time_s']:>10.2f}"
              f"{p['tflops_per_device']:>9.1f}{p['peak_memory_bytes'] / 2**30:>10.1f}"
              f"{wall:>8.1f}  {counts}")
        rows[precision] = (plan, coverage(traced.gm, plan))
    print()
    for precision, (_, cover) in rows.items():
        print(f"{precision}: " + ", ".join(
            f"{k} {v:.1%}" if isinstance(v, float) else f"{k} {v}" for k, v in cover.items()))
    base = rows["bf16"][0].predicted["step_time_s"]
    print("\nstep time relative to bf16 (modelled): " + ", ".join(
        f"{p} {rows[p][0].predicted['step_time_s'] / base:.2f}x" for p in PRECISIONS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
