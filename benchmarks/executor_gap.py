"""autopar's own program vs the same plan run by the best executor the cost model knows.

For each row one plan (Megatron-style: tensor x pipeline x data parallelism, sequence
parallelism, selective recomputation, bf16) is priced twice by the same cost model
(``autopar.solver.search.pinned.estimate_graph``), **modelled**:

- *autopar*: the program autopar emits today (what ``autopar estimate`` prices without the
  executor flags: under ZeRO 1-3 16-bit weights gathered from fp32 masters sharded with the
  optimizer states, at ZeRO-0 one 16-bit copy of each fp32 weight a step,
  ``autopar.ops.step_copies``);
- *best*: the same plan with every executor feature the cost model prices beyond those --
  ``--fuse-elementwise`` (a compiled program's fused elementwise kernels), ``--tp-overlap``
  (tensor-parallel collectives pipelined with their matmuls), ``--p2p-overlap`` (pipeline
  sends beside the compute).

``time x`` = autopar's step / best's (1.00 = no gap); ``memory x`` likewise for the peak per
device. The issue's bar is <= 1.05 in time and <= 1.05 in memory on every row. Rows beyond
the cost model's validated ground (benchmarks/fidelity_*.py) are marked.

    python benchmarks/executor_gap.py              # all rows
    python benchmarks/executor_gap.py --rows 2     # the first two
    python benchmarks/executor_gap.py --by-feature # and what each feature alone gains
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from autopar.cli.load import trace_model
from autopar.core.cluster import load_cluster
from autopar.solver.explain.to_plan import ground_labels
from autopar.solver.search.pinned import PinnedConfig, estimate_graph

# (label, model, cluster, global batch, seq, config): published-style plans (Megatron's
# tensor-parallel layout and sequence parallelism where tp > 1)
ROWS = [
    ("Llama-3-8B, 8 H100", "llama3-8b", "8xH100-80GB", 64, 8192,
     dict(tp=2, pp=1, dp=4, zero=1)),
    ("Llama-3-70B, 64 H100", "llama3-70b", "8x8xH100-80GB", 64, 8192,
     dict(tp=8, pp=4, dp=2, schedule="interleaved", virtual=2)),
    ("Llama-3-70B, 1,024 H100", "llama3-70b", "128x8xH100-80GB", 1024, 8192,
     dict(tp=8, pp=4, dp=32, schedule="interleaved", virtual=2, zero=1)),
    ("Mixtral-8x7B, 64 H100", "mixtral-8x7b", "8x8xH100-80GB", 256, 4096,
     dict(tp=1, pp=4, dp=16, ep=8, layout="auto")),
    ("GPT-175B, 1,024 A100", "gpt3-175b", "128x8xA100-80GB", 1536, 2048,
     dict(tp=8, pp=8, dp=16, schedule="interleaved", virtual=2, zero=1)),
]
BEST = dict(fuse_elementwise=True, tp_overlap=True, p2p_overlap=True)
"""Every executor feature the cost model prices, on top of the same plan."""


def price(model: str, cluster_name: str, batch: int, seq: int, pinned: dict,
          by_feature: bool = False) -> tuple:
    """(autopar's, best's estimates, {feature: its estimate alone} when ``by_feature``)."""
    cluster = load_cluster(cluster_name)
    traced = trace_model(model, batch, seq)
    pinned = {"layout": "megatron", "sp": pinned.get("tp", 1) > 1, **pinned}
    base = PinnedConfig(recompute="selective", precision="bf16", microbatch=1,
                        global_batch=traced.batch, **pinned)
    own = estimate_graph(traced.gm, cluster, base)
    best = estimate_graph(traced.gm, cluster, replace(base, **BEST))
    alone = {name: estimate_graph(traced.gm, cluster, replace(base, **{name: value}))
             for name, value in BEST.items()} if by_feature else {}
    return own, best, alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=len(ROWS))
    parser.add_argument("--by-feature", action="store_true",
                        help="also price each feature alone (what it closes of the gap)")
    args = parser.parse_args()
    print("executor gap (modelled): autopar's program vs the same plan with every executor "
          "feature\n")
    print(f"{'plan':26} {'mesh':26} {'autopar s':>10} {'best s':>9} {'time x':>7} "
          f"{'autopar GiB':>12} {'best GiB':>9} {'memory x':>9}  ground")
    worst_t = worst_m = 0.0
    for label, model, cluster, batch, seq, pinned in ROWS[:args.rows]:
        own, best, alone = price(model, cluster, batch, seq, pinned, args.by_feature)
        a, b = own.prediction, best.prediction
        t, m = a.step_time_s / b.step_time_s, a.peak_memory_bytes / b.peak_memory_bytes
        worst_t, worst_m = max(worst_t, t), max(worst_m, m)
        mesh = " x ".join(f"{k}{v}" for k, v in pinned.items() if k in ("tp", "pp", "dp", "ep"))
        mesh += f", v={pinned['virtual']}" if "virtual" in pinned else ""
        off = [lb.scheme for lb in ground_labels(own.setting, load_cluster(cluster))
               if not lb.validated]
        ground = "validated" if not off else "extrapolated: " + ", ".join(off)
        print(f"{label:26} {mesh:26} {a.step_time_s:10.3f} {b.step_time_s:9.3f} {t:7.2f} "
              f"{a.peak_memory_bytes / 2**30:12.1f} {b.peak_memory_bytes / 2**30:9.1f} "
              f"{m:9.2f}  {ground}")
        for name, e in alone.items():
            p = e.prediction
            print(f"{'  + ' + name:26} {'':26} {'':10} {p.step_time_s:9.3f} "
                  f"{a.step_time_s / p.step_time_s:7.2f} {'':12} "
                  f"{p.peak_memory_bytes / 2**30:9.1f} {a.peak_memory_bytes / p.peak_memory_bytes:9.2f}")
    print(f"\nworst: time {worst_t:.2f}x, memory {worst_m:.2f}x (the bar: 1.05x each)")


if __name__ == "__main__":
    main()
