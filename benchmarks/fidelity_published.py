"""Predicted vs published: Megatron-LM's GPT runs (Narayanan et al., SC'21, Table 1), then
every measured run in ``benchmarks/data/*.csv`` (torchtitan, the IBM/PyTorch FSDP blog, ...).

Each row of ../shared/anchors/megatron_sc21_table1.csv is evaluated with its published
settings (A100-80GB, its TP/PP/DP, micro and global batch, interleaving, sequence 2048,
vocabulary 51200, fp16, full activation recomputation; the GPT with explicit softmax
attention and 0.1 dropout, as Megatron ran it in 2021) by ``autopar estimate``'s model, and
the predicted TFLOP/s per GPU — hardware FLOPs, counting the recomputed forward as the paper
does — is printed next to the published figure. The other sources follow, each row priced
with its own layout and hardware (``benchmarks/fidelity_sources.py``), with per source the
median and worst throughput error, the memory error where the source gives memory, and
ranking agreement (does the model order the source's rows as the measurements do?).

``--write-ground`` records, per parallel scheme, up to which degree and how well the model
was validated (``cost_models/ground.json``); plans cite it and the planner prefers it.

    python benchmarks/fidelity_published.py                  # everything (~15 minutes)
    python benchmarks/fidelity_published.py --table1-only --rows 3
    python benchmarks/fidelity_published.py --source torchtitan_llama3_h100_202412
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

from autopar.core.cluster import load_cluster
from autopar.core.graph_facts import graph_facts
from autopar.models import resolve_model
from autopar.solver.search.pinned import PinnedConfig, estimate_graph
from autopar.trace import trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "megatron_sc21_table1.csv"
MEGATRON_PRECISION = {"master_weights": "optimizer",
                      "precision_overrides": (("transformer.h", "fp16"),)}
"""Megatron-LM's mixed precision, as it ran: 16-bit parameters in the model (fp32 masters in
the optimizer) and every activation of a layer stored in 16 bits (its fused softmax and
LayerNorm kernels compute in fp32 and write fp16), where autopar's own programs keep fp32
parameters, normalisations and softmax as torch.autocast does."""
SEQ, VOCAB = 2048, 51200


def trace_row(row: dict) -> torch.fx.GraphModule:
    """The row's GPT (explicit softmax attention, 0.1 dropout), traced on meta tensors."""
    layers, hidden, heads = int(row["layers"]), int(row["hidden"]), int(row["heads"])
    global_batch = int(row["global_batch"])
    spec = resolve_model(f"gpt:layers={layers},hidden={hidden},heads={heads},vocab={VOCAB},"
                         f"seq={SEQ},batch={global_batch},math_attention=1,dropout=0.1")
    with torch.device("meta"):
        model = spec.build()
    return trace(model, spec.example_inputs(global_batch, SEQ))


def row_cluster(row: dict):
    """The row's GPUs: A100-80GB, 8 per node."""
    return load_cluster({"nodes": int(row["gpus"]) // 8, "devices_per_node": 8,
                         "device": {"preset": "A100-80GB"}})


def predict(row: dict, gm: torch.fx.GraphModule | None = None,
            program: dict | None = None) -> tuple[float, float, dict]:
    """(predicted hardware TFLOP/s per GPU, seconds spent, details) for one table row, as
    Megatron's program (``MEGATRON_PRECISION``) unless ``program`` gives other precision
    options (``{}``: autopar's own program, autocast's fp32 softmax and normalisations)."""
    started = time.perf_counter()
    layers = int(row["layers"])
    tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
    global_batch, micro = int(row["global_batch"]), int(row["micro_batch"])
    per_virtual = row["layers_per_virtual_stage"].strip()
    virtual = layers // pp // int(per_virtual) if per_virtual else 1
    dp = gpus // (tp * pp)
    gm = gm if gm is not None else trace_row(row)
    cluster = row_cluster(row)
    config = PinnedConfig(
        tp=tp, pp=pp, dp=dp, sp=False, microbatch=micro, global_batch=global_batch,
        recompute="full", precision="fp16", zero=0, optimizer="adam",
        schedule="interleaved" if virtual > 1 else "1f1b", virtual=virtual,
        fuse_attention=False,  # Megatron-LM's 2021 attention: op by op
        chunked_loss=False,  # its vocabulary-parallel loss: whole logits, fp32
        **(MEGATRON_PRECISION if program is None else program),
    )
    est = estimate_graph(gm, cluster, config)
    facts = graph_facts(gm)
    scale = global_batch / (facts.batch_size or 1)
    recomputed = sum(d.facts.fwd_flops * d.count for d in est.problem.decisions
                     if est.tables.recomputed(d) and d.facts.requires_grad)
    hardware = (facts.fwd_flops + facts.bwd_flops + recomputed) * scale
    step = est.prediction.step_time_s
    model_flops = (facts.fwd_flops + facts.bwd_flops) * scale
    details = {"step_s": step, "model_tflops": model_flops / step / gpus / 1e12, "bubble_s": est.prediction.bubble_s,
               "tp_comm_s": est.prediction.tp_comm_s, "dp_exposed_s": est.prediction.dp_exposed_s,
               "peak_gib": est.prediction.peak_memory_bytes / 2**30}
    return hardware / step / gpus / 1e12, time.perf_counter() - started, details


def step_time_error(rate_error: float) -> float:
    """A throughput's relative error (predicted over published, minus 1) as the step time's
    (the validated ground's signed errors: negative is optimistic, a step predicted short).

    >>> round(step_time_error(0.25), 3)   # 25% more throughput: a 20% shorter step
    -0.2
    """
    return 1 / (1 + rate_error) - 1


def table1(limit: int | None) -> list[dict]:
    """Megatron-LM SC'21 Table 1: print each row, return the compared rows."""
    rows = list(csv.DictReader(ANCHOR.open()))[:limit]
    print("Megatron-LM SC'21 Table 1 on A100-80GB: TFLOP/s per GPU (hardware FLOPs)")
    print(f"{'params':>8} {'tp':>3} {'pp':>3} {'gpus':>5} {'batch':>6} {'mb':>3} {'v':>2} "
          f"{'published':>10} {'predicted':>10} {'error':>7} {'step s':>8} {'bubble s':>9} "
          f"{'mem GiB':>8}")
    print(f"{'':>8} {'':>3} {'':>3} {'':>5} {'':>6} {'':>3} {'':>2} {'measured':>10} "
          f"{'modelled':>10}")
    errors, compared = [], []
    for row in rows:
        predicted, spent, d = predict(row)
        published = float(row["tflops_per_gpu"])
        error = (predicted - published) / published
        errors.append(abs(error))
        per_virtual = row["layers_per_virtual_stage"].strip()
        v = int(row["layers"]) // int(row["pp"]) // int(per_virtual) if per_virtual else 1
        print(f"{row['params_b']:>7}B {row['tp']:>3} {row['pp']:>3} {row['gpus']:>5} "
              f"{row['global_batch']:>6} {row['micro_batch']:>3} {v:>2} {published:>10.1f} "
              f"{predicted:>10.1f} {error:>+7.1%} {d['step_s']:>8.2f} {d['bubble_s']:>9.2f} "
              f"{d['peak_gib']:>8.1f}", flush=True)
        tp, pp = int(row["tp"]), int(row["pp"])
        compared.append({"source": "megatron-sc21-table1", "zero": 0, "devices_per_node": 8,
                         "schedule": "interleaved" if v > 1 else "1f1b", "error": error,
                         "step_time_error": step_time_error(error),
                         "mesh": {"pp": pp, "dp": int(row["gpus"]) // (tp * pp), "tp": tp}})
    print(f"\nabsolute error: median {statistics.median(errors):.1%}, worst {max(errors):.1%} "
          f"over {len(errors)} rows (target: median <= 10%, worst <= 20%)")
    return compared


def sources(names: list[str] | None) -> list[dict]:
    """Every source in benchmarks/data: each row predicted or skipped with its reason, then
    per source the median and worst error, memory error and ranking agreement."""
    from fidelity_sources import RANKING_TIE, predict_row, summarize
    from published_data import load
    from published_data import sources as source_names

    compared, summaries = [], []
    for name in names or source_names():
        outcomes = []
        print(f"\n{name}: published (measured) vs predicted (modelled)")
        print(f"  {'table':<10} {'scheme':<34} {'gpus':>5} {'published':>10} {'predicted':>10} "
              f"{'error':>7} | {'GiB pub':>7} {'GiB pred':>8} {'error':>7}")
        for row in load(name):
            o = predict_row(row)
            outcomes.append(o)
            label = (row.get("scheme") or "")[:34]
            table = (row.get("table_or_figure") or "")[:10]
            if o.skipped:
                print(f"  {table:<10} {label:<34} {str(row.get('gpus') or ''):>5} "
                      f"{o.published:>10.1f}   not predicted: {o.skipped}")
                continue
            mem = (f"{o.published_gib:>7.1f} {o.predicted_gib:>8.1f} {o.memory_error:>+7.1%}"
                   if o.published_gib == o.published_gib else f"{'':>7} {o.predicted_gib:>8.1f}")
            print(f"  {table:<10} {label:<34} {row['gpus']:>5} {o.published:>10.1f} "
                  f"{o.predicted:>10.1f} {o.error:>+7.1%} | {mem}"
                  + (f"   ({'; '.join(o.notes)})" if o.notes else ""), flush=True)
            compared.append({"source": name, "mesh": o.mesh, "zero": o.zero,
                             "schedule": o.schedule, "cp_algorithm": o.cp_algorithm,
                             "error": o.error,
                             "step_time_error": step_time_error(o.error),
                             "devices_per_node": int(float(row.get("devices_per_node") or 8))})
        s = summarize(outcomes)
        summaries.append((name, s))
        print(f"  {name}: {s['predicted']}/{s['rows']} rows predicted; throughput error median "
              f"{s['median']:.1%}, worst {s['worst']:.1%}; memory error median "
              f"{s['memory_median']:.1%}, worst {s['memory_worst']:.1%}; rankings agree "
              f"{s['agree']}/{s['pairs']}"
              + (f" ({s['ties']} pair(s) within {RANKING_TIE:.0%}: a tie, no order)"
                 if s['ties'] else "")
              + f"; runs predicted not to fit: {s['not_fit']}")
    print("\nper source (targets: median <= 10%, worst <= 25%, rankings agree (published "
          f"figures within {RANKING_TIE:.0%} are ties, not counted), no run that "
          "ran predicted not to fit; memory in GiB includes a 10% allocator allowance, "
          "REPORT_FRAGMENTATION, against the sources' reserved memory)")
    print(f"  {'source':<40} {'rows':>5} {'median':>7} {'worst':>7} {'mem med':>8} "
          f"{'mem worst':>9} {'ranking':>8} {'no-fit':>6}")
    for name, s in summaries:
        print(f"  {name:<40} {s['predicted']:>2}/{s['rows']:<2} {s['median']:>7.1%} "
              f"{s['worst']:>7.1%} {s['memory_median']:>8.1%} {s['memory_worst']:>9.1%} "
              f"{s['agree']:>3}/{s['pairs']:<4} {s['not_fit']:>6}")
    return compared


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=None, help="Table 1's first N rows only")
    ap.add_argument("--table1-only", action="store_true")
    ap.add_argument("--source", action="append", help="only this source (repeatable)")
    ap.add_argument("--write-ground", action="store_true",
                    help="record where the model was validated (cost_models/ground.json)")
    args = ap.parse_args()
    compared = [] if args.source else table1(args.rows)
    if not args.table1_only:
        compared += sources(args.source)
    if args.write_ground:
        from autopar.cost_models.ground import evidence_from_rows, write_ground

        print(f"\nwrote {write_ground(evidence_from_rows(compared, 'nccl'))}")


if __name__ == "__main__":
    main()
