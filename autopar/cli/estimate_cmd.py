"""``autopar estimate``: memory and step time of one pinned configuration (the calculator).

    autopar estimate llama3-8b --cluster 8xH100-80GB --tp 1 --pp 1 --dp 8 --zero 0 --precision bf16

Prints its assumptions first, then the per-device memory breakdown against capacity and
the step time with its parts; every number is modelled. ``--json`` writes the same
``predicted.*`` fields a plan has, plus the breakdowns.

Exit status: 0 when the configuration fits in device memory, 3 (``EXIT_DOES_NOT_FIT``) when
it does not (the report is printed and written all the same), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autopar.analysis.precision import params_are_masters, params_word
from autopar.api.planning import resolve_precision
from autopar.cli.arguments import EXIT_DOES_NOT_FIT
from autopar.cli.load import TracedModel, trace_model
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import graph_facts
from autopar.core.plan_summary import memory_kinds
from autopar.core.units import format_bytes, format_count, format_seconds
from autopar.cost_models.memory import lora_params, model_state_bytes
from autopar.solver.model.stages import layer_ranges
from autopar.solver.search.pinned import Estimate, PinnedConfig, estimate_graph


def adapter_shapes(traced: TracedModel) -> list[tuple[int, int]]:
    """(out, in) of every 2-D weight a LoRA adapter would attach to (the matmul weights)."""
    shapes = []
    for node in traced.gm.graph.nodes:
        facts = node.meta.get("autopar")
        if facts is not None and facts.param is not None and len(facts.param.shape) == 2:
            users = {str(u.target) for u in node.users}
            if any(("linear" in u or "addmm" in u or "mm" in u) for u in users):
                shapes.append(facts.param.shape)
    return shapes


def checked_adapter_shapes(traced: TracedModel, rank: int) -> list[tuple[int, int]]:
    """The weights LoRA adapters of ``rank`` attach to; a rank no smaller than a weight's
    dimensions is a full-rank "adapter", which saves nothing and is surely a typo."""
    shapes = adapter_shapes(traced)
    if not shapes:
        raise AutoparError("the model has no matmul weights to attach LoRA adapters to",
                           where="--lora-rank", fix="drop --lora-rank")
    smallest = min(min(shape) for shape in shapes)
    if rank >= smallest:
        raise AutoparError(
            f"LoRA rank {rank} is not below the smallest adapted weight dimension ({smallest})",
            where="--lora-rank", fix=f"use a rank below {smallest} (LoRA ranks are typically 8-64)")
    return shapes


def report(est: Estimate, traced: TracedModel, cluster_name: str, lora: dict | None) -> dict:
    p, c, setting = est.prediction, est.config, est.setting
    cluster = est.tables.cluster
    facts = graph_facts(traced.gm)
    g = c.global_batch or traced.batch
    scale = g / (facts.batch_size or 1)
    model_flops = (facts.fwd_flops + facts.bwd_flops) * scale
    recompute_flops = sum(
        d.facts.fwd_flops * d.count for d in est.problem.decisions
        if est.tables.recomputed(d) and d.facts.requires_grad
    ) * scale
    world = cluster.world_size
    memory, training = p.memory.to_dict(), p.memory_training.to_dict()
    if lora:
        for kinds in (memory, training):
            kinds["optimizer"] += int(lora["optimizer_bytes"])
            kinds["params"] += int(lora["param_bytes"])
            kinds["grads"] += int(lora["grad_bytes"])
            kinds["total"] += int(lora["state_bytes"])
    peak = cluster.device.peak(c.precision)
    step = p.step_time_s
    return {
        "label": "modelled",
        "assumptions": {
            "model": traced.spec.name, "cluster": cluster_name, "devices": world,
            "global_batch": g, "seq": traced.seq, "microbatch": c.microbatch,
            "microbatches": setting.microbatches, "tp": c.tp, "pp": c.pp, "dp": c.dp,
            "cp": c.cp, "ep": c.ep, "dp_replicate": c.dp_replicate,
            "cp_algorithm": setting.cp_algorithm if c.cp > 1 else None,
            "cp_layout": c.cp_layout if c.cp > 1 else None, "sp": c.sp, "recompute": est.setting.recompute,
            "recompute_layers": list(est.setting.layer_recompute) or None, "precision": c.precision,
            "zero": c.zero, "optimizer": c.optimizer, "schedule": c.schedule,
            "virtual_stages": c.virtual, "lora_rank": lora["rank"] if lora else None,
            "chunked_loss": c.chunked_loss, "fuse_elementwise": c.fuse_elementwise,
            "tp_overlap": c.tp_overlap, "p2p_overlap": c.p2p_overlap,
        },
        "predicted": {
            "step_time_s": step,
            "peak_memory_bytes": memory["total"],
            "tflops_per_device": model_flops / step / world / 1e12,
            "hardware_tflops_per_device": (model_flops + recompute_flops) / step / world / 1e12,
            "tokens_per_s": g * traced.seq / step,
            "mfu": model_flops / step / world / peak,
            "fits": memory["total"] <= cluster.device.memory_bytes,
            "memory_capacity_bytes": int(cluster.device.memory_bytes),
            "memory": memory,
            "memory_training": training,
            "time": {
                "compute_s": p.compute_s, "tp_comm_s": p.tp_comm_s, "bubble_s": p.bubble_s,
                "p2p_s": p.p2p_s, "dp_comm_s": p.dp_comm_s, "dp_exposed_s": p.dp_exposed_s,
            },
            "stages": [
                {"layers": layer_ranges(s.layers),
                 "forward_s": s.forward_s, "backward_s": s.backward_s,
                 "in_flight": s.in_flight, "memory": s.memory.to_dict()}
                for s in p.stages
            ],
        },
    }


def format_report(r: dict) -> str:
    a, p = r["assumptions"], r["predicted"]
    m, t = p["memory"], p["time"]
    cap = p["memory_capacity_bytes"]
    lines = [
        f"autopar estimate: {a['model']} on {a['cluster']} ({a['devices']} devices) — all "
        "numbers modelled",
        f"assuming  global batch {a['global_batch']} x seq {a['seq']}, microbatch "
        f"{a['microbatch']} x {a['microbatches']}, tp={a['tp']} pp={a['pp']} dp={a['dp']} "
        f"cp={a['cp']}{' +sp' if a['sp'] else ''}"
        + (f" ep={a['ep']}" if a.get("ep", 1) > 1 else "")
        + (f" (HSDP: {a['dp_replicate']} replica groups)" if a.get("dp_replicate", 1) > 1
           else "")
        + (f" ({a['cp_algorithm']} attention, {a['cp_layout']})" if a["cp_algorithm"] else ""),
        f"          {a['precision']}, {a['optimizer']}, ZeRO-{a['zero']}, recompute {a['recompute']}, "
        f"schedule {a['schedule']}" + (f" (v={a['virtual_stages']})" if a['virtual_stages'] > 1
                                       else "")
        + (f", LoRA rank {a['lora_rank']}" if a["lora_rank"] else "")
        + ("" if a["chunked_loss"] else ", torch's cross-entropy (--no-chunked-loss)")
        + (", elementwise ops fused (--fuse-elementwise)" if a.get("fuse_elementwise") else "")
        + (", tp collectives pipelined with the matmuls (--tp-overlap)" if a.get("tp_overlap")
           else "")
        + (", pipeline sends beside the compute (--p2p-overlap)" if a.get("p2p_overlap")
           else ""),
        "",
        "memory per device (the fullest stage)",
    ]
    lines += memory_kinds(m, p.get("memory_training"), gb=True)
    verdict = "fits" if p["fits"] else f"does NOT fit: {format_bytes(m['total'] - cap)} over"
    lines.append(f"  {'total':<12} {format_bytes(m['total']):>12} of {format_bytes(cap)} — {verdict}")
    if len(p["stages"]) > 1:
        lines += ["", "pipeline stages"]
        for i, s in enumerate(p["stages"]):
            lines.append(f"  stage {i:<2} layers {s['layers']:<8} fwd {format_seconds(s['forward_s'])}"
                         f"  bwd {format_seconds(s['backward_s'])}  in flight {s['in_flight']:.1f}"
                         f"  memory {format_bytes(s['memory']['total'])}")
    lines += [
        "",
        "step time",
        f"  total        {format_seconds(p['step_time_s'])}",
        f"  compute      {format_seconds(t['compute_s'])}   tp comm {format_seconds(t['tp_comm_s'])}"
        f"   bubble {format_seconds(t['bubble_s'])}   p2p {format_seconds(t['p2p_s'])}"
        f"   dp comm {format_seconds(t['dp_comm_s'])}, adds {format_seconds(t['dp_exposed_s'])}"
        " to the step",
        f"  throughput   {p['tokens_per_s']:,.0f} tokens/s; {p['tflops_per_device']:.1f} TFLOP/s per "
        f"device (model), {p['hardware_tflops_per_device']:.1f} (hardware, with recompute); "
        f"MFU {p['mfu']:.1%}",
    ]
    return "\n".join(lines)


def run_estimate(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster)
    zero, recompute = (_one(args, "zero"), _one(args, "recompute"))
    traced = trace_model(args.model, args.global_batch, args.seq, frozen=bool(args.lora_rank))
    dp = args.dp or max(cluster.world_size // (args.tp * args.pp * args.cp), 1)
    config = PinnedConfig(
        tp=args.tp, pp=args.pp, dp=dp, cp=args.cp, ep=args.ep, dp_replicate=args.dp_replicate,
        cp_algorithm=args.cp_algorithm,
        cp_layout=args.cp_layout, sp=args.sp, microbatch=args.microbatch,
        global_batch=traced.batch, recompute=recompute,
        recompute_layers=tuple(args.recompute_layers or ()),
        precision=resolve_precision(args.precision, cluster), zero=zero,
        master_weights=args.master_weights,
        optimizer=args.optimizer, schedule=args.schedule, virtual=args.virtual_stages,
        fuse_attention=args.fuse_attention, chunked_loss=args.chunked_loss, layout=getattr(args, "layout", "auto"),
        fuse_elementwise=args.fuse_elementwise, tp_overlap=args.tp_overlap,
        p2p_overlap=args.p2p_overlap,
    )
    est = estimate_graph(traced.gm, cluster, config)
    lora = None
    if args.lora_rank:
        n = sum(lora_params(out, inp, args.lora_rank)
                for out, inp in checked_adapter_shapes(traced, args.lora_rank))
        word = params_word(config.precision, config.zero, config.master_weights)
        s = model_state_bytes(n / args.tp, trainable=True, precision=config.precision,
                              optimizer=config.optimizer, zero_stage=config.zero, dp=dp,
                              fp32_params=params_are_masters(word, config.zero),
                              fp32_grads=True)
        lora = {"rank": args.lora_rank, "params": n, "state_bytes": s.total,
                "param_bytes": s.params, "grad_bytes": s.grads, "optimizer_bytes": s.optimizer}
    result = report(est, traced, cluster.name, lora)
    if traced.note:
        print(f"note: {traced.note}\n")
    print(format_report(result))
    if lora:
        print(f"\nLoRA adapters: {format_count(lora['params'])} trainable parameters "
              f"(base weights frozen)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nestimate written to {args.json}")
    return 0 if result["predicted"]["fits"] else EXIT_DOES_NOT_FIT


def _one(args: argparse.Namespace, flag: str) -> Any:
    """The single value of a flag ``plan`` may give several of: an estimate is of one
    configuration."""
    values = getattr(args, flag)
    if len(values) > 1:
        raise AutoparError(
            f"estimate evaluates one configuration, but --{flag} gives {len(values)}: "
            f"{','.join(map(str, values))}", where=f"--{flag}",
            fix="give one value (run estimate once per value, or let `autopar plan` choose)")
    return values[0]
