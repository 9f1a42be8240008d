"""autopar's own plans vs Megatron-LM's hand-tuned ones (Narayanan et al., SC'21, Table 1).

For every row of ../shared/anchors/megatron_sc21_table1.csv the same model (GPT, sequence
2048, vocabulary 51200, explicit softmax attention with 0.1 dropout as Megatron ran it), GPU
count (A100-80GB, 8 per node), global batch and precision (fp16, Adam) are given to two
predictions by the same cost model:

- *published*: Megatron's configuration pinned (its TP/PP/DP, microbatch, interleaving, full
  recomputation, no ZeRO) — what ``benchmarks/fidelity_published.py`` checks against the
  measured figures;
- *autopar*: what ``autopar.plan`` chooses with nothing pinned but the batch and the GPU
  count, in three search spaces — Megatron's own (ZeRO-0: every rank keeps whole optimizer
  states, so large models need pipeline stages), the full one (ZeRO-3 allowed) as the planner
  runs by default (preferring the cost model's validated ground), and the full one
  unconstrained (``extrapolation_margin=0``).

autopar's attention fusion is turned off here, so both run the same attention ops. The
programs still differ in precision: Megatron's keeps every activation of a layer in 16 bits
(fp16 softmax), autopar's runs autocast (fp32 softmax and normalisations). So the published
layout is also priced as autopar's own program ("as autopar"), and ``same`` = that / autopar's
plan compares placement alone: below 1 would be a layout the search missed. All are
**modelled** step times; a ratio > 1 means autopar's plan is predicted faster. Throughput is in model FLOPs (recomputation not counted) so plans that
recompute less are not penalized.

    python benchmarks/plan_vs_published.py              # all rows, both search spaces
    python benchmarks/plan_vs_published.py --rows 3 --spaces megatron
"""

from __future__ import annotations

import argparse
import csv
import time

from fidelity_published import ANCHOR, predict, row_cluster, trace_row

import autopar

SPACES = {"megatron": ((0,), None), "full": ((0, 3), None), "unconstrained": ((0, 3), 0.0)}
"""Search space -> (ZeRO stages, extrapolation margin). ``full`` is the default planner,
which stays on the cost model's validated ground unless a plan beyond it wins by the model's
error there; ``unconstrained`` drops that preference (margin 0)."""


def plan_row(row: dict, gm, space: str) -> tuple[autopar.Plan, float]:
    """autopar's plan for the row (only the global batch, precision and optimizer given)."""
    zero_stages, margin = SPACES[space]
    started = time.perf_counter()
    plan = autopar.plan(gm, row_cluster(row), global_batch=int(row["global_batch"]),
                        precision="fp16", optimizer="adam", zero=zero_stages,
                        fuse_attention=False,  # the same attention ops as Megatron's
                        extrapolation_margin=margin, devices=int(row["gpus"]))
    return plan, time.perf_counter() - started


def describe(plan: autopar.Plan) -> str:
    mesh = plan.mesh
    text = f"tp{mesh['tp']} pp{mesh.get('pp', 1)} dp{mesh['dp']} z{plan.training['zero']}"
    if any(not label["validated"] for label in plan.predicted.get("ground", [])):
        text += "*"
    text += f" mb{plan.batch['microbatch']} rc:{plan.training['recompute']}"
    if plan.pipeline:
        pipe = plan.pipeline
        text += f" {pipe['schedule']}" + (f" v{pipe['virtual_stages']}"
                                          if pipe["schedule"] == "interleaved" else "")
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--spaces", default="megatron,full,unconstrained")
    args = ap.parse_args()
    spaces = args.spaces.split(",")
    rows = list(csv.DictReader(ANCHOR.open()))[: args.rows]
    print("Megatron-LM SC'21 Table 1, A100-80GB, fp16: step time (modelled) of the published "
          "configuration vs autopar's plan; ratio = published / autopar (> 1: autopar faster)")
    header = f"{'params':>8} {'published config':<22} {'step s':>7} {'TFLOP/s':>7} {'as autopar':>10}"
    for space in spaces:
        header += f" | {space + ' space: autopar plan':<40} {'step s':>7} {'TFLOP/s':>7} " \
                  f"{'ratio':>6} {'same':>5} {'plan s':>6}"
    print(header)
    ratios: dict[str, list[float]] = {s: [] for s in spaces}
    same_layout: dict[str, list[float]] = {s: [] for s in spaces}
    for row in rows:
        gm = trace_row(row)
        _, _, published = predict(row, gm)
        _, _, as_autopar = predict(row, gm, program={})  # the same layout, autopar's program
        # model FLOPs per second per GPU = published["model_tflops"] x published step / step
        flops = published["model_tflops"] * published["step_s"]
        per_virtual = row["layers_per_virtual_stage"].strip()
        v = int(row["layers"]) // int(row["pp"]) // int(per_virtual) if per_virtual else 1
        config = (f"tp{row['tp']} pp{row['pp']} dp{int(row['gpus']) // int(row['tp']) // int(row['pp'])}"
                  f" mb{row['micro_batch']}" + (f" v{v}" if v > 1 else ""))
        line = (f"{row['params_b']:>7}B {config:<22} {published['step_s']:>7.2f} "
                f"{published['model_tflops']:>7.1f} {as_autopar['step_s']:>10.2f}")
        for space in spaces:
            plan, plan_s = plan_row(row, gm, space)
            step = plan.predicted["step_time_s"]
            ratio = published["step_s"] / step
            ratios[space].append(ratio)
            same_layout[space].append(as_autopar["step_s"] / step)
            line += (f" | {describe(plan):<40} {step:>7.2f} {flops / step:>7.1f} "
                     f"{ratio:>6.2f} {same_layout[space][-1]:>5.2f} {plan_s:>6.1f}")
        print(line, flush=True)
    for space, values in ratios.items():
        worst = min(values)
        same = same_layout[space]
        print(f"{space} space: autopar's plan predicted at least as fast on "
              f"{sum(r >= 1 for r in values)}/{len(values)} rows; lowest ratio {worst:.2f}; "
              f"as fast as the published layout in its own program on "
              f"{sum(r >= 1 - 1e-9 for r in same)}/{len(same)} (lowest {min(same):.2f})")
    print("* a scheme of this plan is beyond the cost model's validated ground (extrapolated)")


if __name__ == "__main__":
    main()
