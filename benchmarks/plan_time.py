"""How long planning takes: trace (meta device) + solve, for large models and clusters.

    python benchmarks/plan_time.py            # all rows (a few minutes on 2 cores)
    python benchmarks/plan_time.py --quick    # the small row only
    python benchmarks/plan_time.py --repeat 3 --only llama3-70b:128x8xH100-80GB  # median of 3

Times are measured on this machine (wall seconds; "cpu s" is this process's CPU time for
trace + plan, less sensitive to other jobs on a shared machine); step time and MFU are the
plan's modelled predictions. With ``--repeat N`` each row is traced and planned N times and
the median of each time is shown.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import autopar
from autopar.cli.load import trace_model

ROWS = [
    ("gpt-125m", "8xA100-80GB"),
    ("llama3-8b", "8xH100-80GB"),
    ("llama3-70b", "16x8xH100-80GB"),
    ("llama3-70b", "128x8xH100-80GB"),
    ("gpt3-175b", "128x8xA100-80GB"),
]


def _run(model: str, cluster: str) -> tuple[float, float, float, object]:
    """(trace s, plan s, CPU s of both, plan)."""
    cpu = time.process_time()
    traced = trace_model(model, None, None)
    started = time.perf_counter()
    plan = autopar.plan(traced.gm, cluster, global_batch=traced.batch, model_name=model)
    plan_s = time.perf_counter() - started
    return traced.trace_s, plan_s, time.process_time() - cpu, plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; medians are shown")
    ap.add_argument("--only", default=None, help="MODEL:CLUSTER, one row")
    args = ap.parse_args()
    rows = ROWS[:1] if args.quick else ROWS
    if args.only:
        rows = [tuple(args.only.split(":", 1))]
    header = (f"{'model':<12} {'cluster':<17} {'trace s':>8} {'plan s':>7} {'total s':>8} "
              f"{'cpu s':>6} {'nodes':>6} {'decisions':>9}  {'mesh':<14} {'ZeRO':>4} "
              f"{'step s':>8} {'MFU':>6}")
    print(header + "\n" + "-" * len(header))
    print(f"{'':<12} {'':<17} {'measured':>8} {'measured':>7} {'measured':>8} {'measured':>6}"
          f"{'':>34}{'modelled':>10} {'modelled':>8}")
    for model, cluster in rows:
        runs = [_run(model, cluster) for _ in range(max(args.repeat, 1))]
        trace_s, plan_s, cpu_s = (statistics.median(r[i] for r in runs) for i in range(3))
        total_s = statistics.median(r[0] + r[1] for r in runs)
        plan = runs[-1][3]
        mesh = "x".join(f"{a}{n}" for a, n in plan.mesh.items())
        print(f"{model:<12} {cluster:<17} {trace_s:>8.1f} {plan_s:>7.1f} {total_s:>8.1f} "
              f"{cpu_s:>6.1f} {plan.solver['nodes']:>6} {plan.solver['decisions']:>9}  "
              f"{mesh:<14} {plan.training['zero']:>4} {plan.predicted['step_time_s']:>8.2f} "
              f"{plan.predicted['mfu']:>6.1%}", flush=True)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"\npeak memory of this process: {peak_gb:.2f} GB (measured)")


if __name__ == "__main__":
    main()
