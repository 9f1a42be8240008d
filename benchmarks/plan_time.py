"""How long planning takes: trace (meta device) + solve, for large models and clusters.

    python benchmarks/plan_time.py            # all rows (a few minutes on 2 cores)
    python benchmarks/plan_time.py --quick    # the small row only

Times are measured on this machine; step time and MFU are the plan's modelled predictions.
"""

from __future__ import annotations

import argparse
import resource
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows = ROWS[:1] if args.quick else ROWS
    header = (f"{'model':<12} {'cluster':<17} {'trace s':>8} {'plan s':>7} {'nodes':>6} "
              f"{'decisions':>9}  {'mesh':<14} {'ZeRO':>4} {'step s':>8} {'MFU':>6}")
    print(header + "\n" + "-" * len(header))
    print(f"{'':<12} {'':<17} {'measured':>8} {'measured':>7}{'':>36}{'modelled':>10} {'modelled':>8}")
    for model, cluster in rows:
        traced = trace_model(model, None, None)
        started = time.perf_counter()
        plan = autopar.plan(traced.gm, cluster, global_batch=traced.batch, model_name=model)
        plan_s = time.perf_counter() - started
        mesh = "x".join(f"{a}{n}" for a, n in plan.mesh.items())
        print(f"{model:<12} {cluster:<17} {traced.trace_s:>8.1f} {plan_s:>7.1f} "
              f"{plan.solver['nodes']:>6} {plan.solver['decisions']:>9}  {mesh:<14} "
              f"{plan.training['zero']:>4} {plan.predicted['step_time_s']:>8.2f} "
              f"{plan.predicted['mfu']:>6.1%}", flush=True)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"\npeak memory of this process: {peak_gb:.2f} GB (measured)")


if __name__ == "__main__":
    main()
