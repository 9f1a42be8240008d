"""Where the CPU cost model misses, node by node: modelled vs measured forward and backward.

The demo GPT's multi-process steps are predicted 20-45% short on this machine while one
process at a larger batch is predicted 8-15% long (``fidelity_measured.py``): errors of
opposite sign that cancel at some sizes. This finds them. It traces the model as autopar
does, runs the traced program alone (one process, one thread) under ``torch.profiler``
with every node's forward in a ``record_function`` of its name, and charges each backward
autograd node to the forward node that made it (by autograd's sequence numbers), so each
graph node gets a measured forward and backward (its aten ops' own times, children
included). Next to them: the cost model's forward and backward for that node
(``CostTables.times``, modelled), with a profile from ``autopar calibrate``. Rows are summed
by op (``aten.gelu.default``, ...), at each batch.

    python benchmarks/cpu_node_fidelity.py --profile p.json                # batches 2, 4, 8
    python benchmarks/cpu_node_fidelity.py --profile p.json --batches 8 --model llama

What no node owns (the autograd engine between nodes, gradient accumulation into the
weights, the loss's backward seed) is shown as "unattributed". Measured times include the
profiler's own cost per op (a few µs), so small ops read high: compare ratios between
sizes and ops, not the last percent.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from autopar.calibrate.op_rates import profiled_passes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "workers"))


def model_and_batch(name: str, batch: int):
    """(model, (inputs...)) of the demo GPT or the regret benchmark's HF Llama."""
    if name == "demo":
        from autopar.cli.demo_data import demo_batches, demo_model

        x, y = demo_batches(1)[0]
        return demo_model(), (x[:batch], y[:batch])
    from regret_worker import MODELS

    model, example = MODELS[name]["build"]()
    return model, tuple(t[:batch] for t in example)


def modelled_times(model, example, profile_path: str) -> dict[str, tuple[float, float]]:
    """Node name -> (forward, backward) seconds the cost model gives it (one device)."""
    import autopar
    from autopar.solver.pricing import costs

    recorded: dict[str, tuple[float, float]] = {}
    original = costs.CostTables._compute_times

    def spy(self, d, s):
        f, b, r = original(self, d, s)
        for node in d.nodes:
            recorded[node.name] = (f, b)
        return f, b, r

    costs.CostTables._compute_times = spy
    try:
        cluster = {"name": "this-machine", "nodes": 1, "devices_per_node": 1,
                   "cores_per_node": 1, "device": "cpu", "profile": profile_path}
        autopar.plan(model, cluster, example, dp=1, tp=1, pp=1, zero=0, microbatches=1,
                     recompute="none")
    finally:
        costs.CostTables._compute_times = original
    return recorded


class _Named(torch.fx.Interpreter):
    """Runs the traced program with each node's forward in a profiler range of its name."""

    def run_node(self, n):
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        with record_function(f"node::{n.name}"):
            return super().run_node(n)


def measured_times(gm, example, steps: int) -> tuple[dict[str, list[float]], float, float]:
    """Node name -> [forward, backward] seconds (medians over ``steps``), the unattributed
    seconds and the whole step's (without the profiler)."""
    interp = _Named(gm)

    def step():
        out = interp.run(*example)
        loss = out[-1] if isinstance(out, (tuple, list)) else out
        loss.backward()
        gm.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    per_step: list[tuple[dict[str, list[float]], float]] = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        per_step.append(profiled_passes(prof.events(), "node::"))
    names = set().union(*(s[0] for s in per_step))
    nodes = {n: [statistics.median(s[0].get(n, [0.0, 0.0])[i] for s in per_step)
                 for i in (0, 1)] for n in names}
    return nodes, statistics.median(s[1] for s in per_step), statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="a profile from `autopar calibrate`")
    ap.add_argument("--model", choices=("demo", "llama"), default="demo")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--top", type=int, default=12, help="ops shown per batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autopar.core.graph_facts import META_KEY
    from autopar.trace import trace

    profile_path = str(Path(args.profile).resolve())
    for batch in args.batches:
        model, example = model_and_batch(args.model, batch)
        modelled = modelled_times(model, example, profile_path)
        gm = trace(model, example)
        nodes, unattributed, wall = measured_times(gm, example, args.steps)
        by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
        for node in gm.graph.nodes:
            if node.name not in nodes and node.name not in modelled:
                continue
            facts = node.meta.get(META_KEY)
            target = facts.target if facts is not None else str(node.target)
            row = by_op[target]
            row[0] += 1
            row[1] += modelled.get(node.name, (0.0, 0.0))[0]
            row[2] += modelled.get(node.name, (0.0, 0.0))[1]
            row[3] += nodes.get(node.name, [0.0, 0.0])[0]
            row[4] += nodes.get(node.name, [0.0, 0.0])[1]
        total = [sum(r[k] for r in by_op.values()) for k in (1, 2, 3, 4)]
        print(f"\n{args.model}, batch {batch}: step {wall * 1e3:.1f} ms without the profiler "
              f"(measured); nodes modelled {total[0] * 1e3:.1f} + {total[1] * 1e3:.1f} ms, "
              f"measured {total[2] * 1e3:.1f} + {total[3] * 1e3:.1f} ms (forward + backward), "
              f"unattributed {unattributed * 1e3:.1f} ms")
        print(f"  {'op':<40}{'nodes':>6}{'fwd mod':>9}{'fwd meas':>9}{'bwd mod':>9}"
              f"{'bwd meas':>9}{'ratio':>7}")
        rows = sorted(by_op.items(), key=lambda kv: -(kv[1][3] + kv[1][4]))[:args.top]
        for target, (count, mf, mb, f, b) in rows:
            ratio = (mf + mb) / (f + b) if f + b > 0 else float("nan")
            print(f"  {target[:40]:<40}{count:>6}{mf * 1e3:>9.2f}{f * 1e3:>9.2f}{mb * 1e3:>9.2f}"
                  f"{b * 1e3:>9.2f}{ratio:>7.2f}")


if __name__ == "__main__":
    main()
