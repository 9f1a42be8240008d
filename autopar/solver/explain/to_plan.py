"""Turn a search result into a Plan (the JSON other tools read)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch.fx as fx

from autopar.analysis.attention_sites import find_attention_sites
from autopar.analysis.batch_coupling import coupling_exact
from autopar.analysis.expert_sites import regions_of
from autopar.core.cluster import Cluster
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY, graph_facts
from autopar.core.knobs import rank_of_chunk
from autopar.core.placements import Replicate
from autopar.core.plan import SCHEMA_VERSION, Plan, strategy_to_json
from autopar.core.values import value_of
from autopar.cost_models.ground import load_ground
from autopar.solver.axes.context import algorithm_costs, cp_strategies
from autopar.solver.explain.explain_experts import experts_entry
from autopar.solver.explain.explain_tp import explain_tp
from autopar.solver.model.stages import layer_ranges
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables, runs_generated_attention
from autopar.solver.pricing.evaluate import Prediction
from autopar.solver.pricing.precision_costs import precision_assignment
from autopar.solver.search.mesh_search import SearchResult
from autopar.solver.setting import Setting
from autopar.strategies.mutation import check_tied, describe, layer_writes_outside


def make_plan(
    gm: fx.GraphModule,
    result: SearchResult,
    cluster: Cluster,
    options: PlanOptions,
    model_name: str,
) -> Plan:
    """The plan of ``result``'s best candidate: every decision, keyed by fx node name, with
    its predicted figures and the explanation of what was chosen."""
    facts = graph_facts(gm)
    best, problem = result.best, result.problem
    setting, prediction, choice = best.setting, best.prediction, best.choice
    assert prediction is not None and choice is not None

    strategies, params, unruled = _placements(gm, result)
    _check_in_place_writes(gm, problem, choice, setting)
    precision = precision_assignment(problem, options, setting.zero)
    traced = facts.batch_size or 1
    batch = {
        "global": options.global_batch or traced,
        "microbatch": setting.microbatch,
        "microbatches": setting.microbatches,
        "seq": facts.seq_len or 1,
        "traced": traced,
    }
    predicted = predicted_entry(gm, prediction, setting, cluster, options, batch)
    cluster_dict = cluster.to_dict()
    cluster_dict["devices"] = cluster.world_size
    return Plan(
        schema_version=SCHEMA_VERSION,
        model={
            "name": model_name,
            "fingerprint": facts.fingerprint,
            "params": facts.params,
            "trainable_params": facts.trainable_params,
            "tracer": facts.tracer,
        },
        cluster=cluster_dict,
        mesh=setting.plan_mesh,
        batch=batch,
        training=training_entry(setting, options),
        pipeline=pipeline_entry(setting, prediction),
        strategies=strategies,
        params=params,
        predicted=predicted,
        solver=solver_entry(result, len(strategies)),
        layers=layer_rows(gm, _layer_summary(result), setting),
        unruled_ops=dict(sorted(unruled.items())),
        attention=attention_entries(gm, options, cluster),
        explanation=_explanation(gm, result, cluster, options),
        context=context_entry(result, options),
        precision={n: w for n, w in precision.nodes.items() if n in strategies},
        precision_policy=precision.policy(),
        batch_coupled=[c.to_json(coupling_exact(c, setting.dp, setting.microbatches,
                                                options.batch_coupling))
                       for c in result.couplings],
        constraints=[str(c) for c in options.constraints],
    )


def _placements(gm: fx.GraphModule, result: SearchResult
                ) -> tuple[dict[str, dict], dict[str, dict[str, str]], Counter[str]]:
    """Each node's strategy per mesh axis, each parameter's placement (by fully qualified
    name), and how many nodes of each op ran without a sharding rule."""
    best, problem = result.best, result.problem
    setting, choice = best.setting, best.choice
    strategies: dict[str, dict] = {}
    params: dict[str, dict[str, str]] = {}
    unruled: Counter[str] = Counter()
    sequence = (cp_strategies(gm, setting.cp, graph_facts(gm).seq_len) if setting.cp > 1
                else {})
    for d in problem.decisions:
        tp_strategy = d.candidates[choice[d.index]]
        for node in d.nodes:
            strategies[node.name] = {
                "dp": strategy_to_json(result.batch[node.name]),
                "tp": strategy_to_json(tp_strategy),
            }
            if sequence:
                strategies[node.name]["cp"] = strategy_to_json(sequence[node.name])
            if d.unruled:
                unruled[str(node.target)] += 1
            param = node.meta["autopar"].param
            if param is not None:
                params[param.fqn] = {
                    "dp": str(result.batch[node.name].outputs[0]),
                    "tp": str(tp_strategy.outputs[0]),
                }
                if sequence:
                    params[param.fqn]["cp"] = str(sequence[node.name].outputs[0])
    if setting.ep > 1:  # each ep rank keeps a block of every stacked expert weight (an
        # expert written as its own module lives whole on one ep rank: no placement)
        for region in regions_of(gm):
            if region.kind == "loop":
                continue
            for fqn in region.weight_fqns:
                params[fqn]["ep"] = "S(0)"
    return strategies, params, unruled


def predicted_entry(gm: fx.GraphModule, prediction: Prediction, setting: Setting,
                    cluster: Cluster, options: PlanOptions, batch: dict) -> dict:
    """The plan's modelled figures: step time, throughput and MFU, memory (with its phases)
    and the step's parts, and the validated ground each parallel scheme stands on."""
    facts = graph_facts(gm)
    global_batch, seq, traced = batch["global"], batch["seq"], batch["traced"]
    step = prediction.step_time_s
    model_flops = (facts.fwd_flops + facts.bwd_flops) * global_batch / traced
    tflops = model_flops / step / cluster.world_size / 1e12 if step > 0 else 0.0
    peak = cluster.device.peak(options.precision)
    predicted = {
        "label": "modelled",
        "step_time_s": step,
        "peak_memory_bytes": int(prediction.peak_memory_bytes),
        "tflops_per_device": tflops,
        "tokens_per_s": global_batch * seq / step if step > 0 else 0.0,
        "mfu": tflops * 1e12 / peak,
        "model_flops_per_step": model_flops,
        "memory": prediction.memory.to_dict(),
        # bytes at each peak of the step (the largest is "memory"): forward's end, backward's
        # start, the optimizer step
        "memory_phases": {name: int(b) for name, b in prediction.memory_phases.items()},
        "memory_training": prediction.memory_training.to_dict(),
        "memory_capacity_bytes": int(cluster.device.memory_bytes),
        "compute_s": prediction.compute_s,
        "tp_comm_s": prediction.tp_comm_s,
        "dp_comm_s": prediction.dp_comm_s,
        "dp_exposed_s": prediction.dp_exposed_s,
        "bubble_s": prediction.bubble_s,
        "p2p_s": prediction.p2p_s,
        "optimizer_s": prediction.optimizer_s,
    }
    labels = ground_labels(setting, cluster)
    predicted["ground"] = [label.to_dict() for label in labels]
    predicted["ground_margin"] = load_ground().margin(labels, options.extrapolation_margin)
    return predicted


def training_entry(setting: Setting, options: PlanOptions) -> dict:
    """How the plan trains: precision, optimizer, ZeRO stage, recomputation (per layer
    when mixed), the loss and batch statistics, and offloading and HSDP when used."""
    return {
        "precision": options.precision,
        "optimizer": options.optimizer,
        "zero": setting.zero,
        "recompute": setting.recompute,
        **({"recompute_layers": list(setting.layer_recompute)}
           if setting.recompute == "mixed" else {}),
        "chunked_loss": options.chunked_loss,
        **({"compile": True} if options.compile else {}),
        "batch_coupling": options.batch_coupling,
        **({"offload": setting.offload} if setting.offload != "none" else {}),
        **({"dp_replicate": setting.dp_replicate} if setting.dp_replicate > 1 else {}),
    }


def solver_entry(result: SearchResult, nodes: int) -> dict:
    """What the search did: its status and time, the problem's size, every candidate it
    tried, how optimal the chosen layout is proved, and its solve budget."""
    best = result.best
    return {
        "status": best.status,
        "wall_s": result.wall_s,
        "decisions": len(result.problem.decisions),
        "nodes": nodes,
        "candidates": [c.summary() for c in result.candidates],
        **optimality(best.solves),
        **({"interrupted": True} if result.interrupted else {}),
        **({"solves": result.budget.used, "max_solves": result.budget.limit,
            "budget_reached": result.budget.reached} if result.budget else {}),
    }


def context_entry(result: SearchResult, options: PlanOptions) -> dict:
    """The plan's context parallelism: the algorithm, and every algorithm's modelled cost
    at the chosen setting (seconds per step) or why it cannot run."""
    tables, setting = result.tables, result.best.setting
    if setting.cp <= 1:
        return {}
    open_tables = CostTables(tables.problem, tables.cluster, tables.options,
                             replace(setting, cp_algorithm="auto"), tables.traced_batch,
                             tables.seq_len)
    m = setting.microbatches
    algorithms = {
        name: ({"status": "ok", "comm_s": cost * m} if not isinstance(cost, str)
               else {"status": cost})
        for name, cost in algorithm_costs(open_tables).items()}
    chosen_s = algorithms[setting.cp_algorithm].get("comm_s", 0.0)
    others = [f"{name} {entry['comm_s'] * 1e3:.3g} ms" if "comm_s" in entry
              else f"{name}: {entry['status']}" for name, entry in algorithms.items()
              if name != setting.cp_algorithm]
    pinned = options.cp_algorithm is not None
    timed = {name: entry["comm_s"] for name, entry in algorithms.items() if "comm_s" in entry}
    fastest = min(timed, key=timed.get, default=setting.cp_algorithm)
    reason = ("pinned" if pinned else "is the cheapest" if timed.get(fastest) == chosen_s
              else f"runs on validated ground ({fastest}, cheaper, is extrapolated and must win "
                   "by the model's error there)")
    why = (f"{setting.cp_algorithm} {reason}: "
           f"{chosen_s * 1e3:.3g} ms of exposed attention communication per step, all layers "
           "together (modelled)"
           + (f", against {'; '.join(others)}" if others else ""))
    return {"label": "modelled", "cp": setting.cp, "algorithm": setting.cp_algorithm,
            "layout": setting.cp_layout, "pinned": pinned, "algorithms": algorithms,
            "why": why}


def ground_labels(setting: Setting, cluster: Cluster) -> list:
    """Each parallel scheme of the layout: validated (where, how well) or extrapolated."""
    return load_ground().labels(setting.plan_mesh, zero=setting.zero,
                                schedule=setting.schedule if setting.pp > 1 else None,
                                backend=cluster.backend, devices_per_node=cluster.devices_per_node,
                                cp_algorithm=setting.cp_algorithm)


def _explanation(gm: fx.GraphModule, result: SearchResult, cluster: Cluster,
                 options: PlanOptions) -> dict:
    tp = explain_tp(gm, result, cluster, options)
    out = {"tp": tp} if tp else {}
    chosen = result.best.prediction
    experts = experts_entry(result.tables, [c.summary() for c in result.candidates],
                            chosen.step_time_s if chosen is not None else None)
    if experts:
        out["experts"] = experts
    return out


def _check_in_place_writes(gm: fx.GraphModule, problem, choice: list[int],
                           setting: Setting) -> None:
    """Refuse a layout that would redistribute storage an in-place op writes (the solver
    never chooses one; this keeps it so), and recomputation of a layer that writes
    storage made outside it (the recomputed forward would write it again)."""
    crossing = layer_writes_outside(gm.graph) if setting.recompute != "none" else []
    if crossing:
        write, base = crossing[0]
        raise AutoparError(
            f"{setting.recompute} recomputation would run the in-place write "
            f"{describe(write)} a second time: it writes {base.name}, made outside its layer, "
            "so the recomputed layer would read and write what the first pass changed",
            where=f"training.recompute ({len(crossing)} such write(s))",
            fix="plan with recompute='none' (--recompute none)",
        )

    def chosen(node: fx.Node):
        d = problem.decision_of.get(node.name)
        return None if d is None else problem.decisions[d].candidates[choice[d]]

    def have(a: fx.Node):
        producer, index = value_of(a)
        s = chosen(producer)
        return None if s is None else s.outputs[index]

    def need(consumer: fx.Node, slot: int):
        s = chosen(consumer)
        return None if s is None else s.inputs[slot]

    # the ties the search planned with (the graph is the same): found once per graph
    check_tied(gm.graph, have, need, "tp", problem.graph_cache.get("ties"))


def attention_entries(gm: fx.GraphModule, options: PlanOptions,
                      cluster: Cluster) -> list[dict]:
    """The model's attention sites, whether the program fuses each (and why not), and what
    kernel a fused one is priced as."""
    entries = []
    kernel = attention_pricing(cluster, options)
    for site in find_attention_sites(gm):
        facts = site.output.meta.get(META_KEY)
        fused = options.fuse_attention and site.fusable
        entries.append({
            "node": site.name,
            "pattern": site.pattern,
            "layer": facts.layer if facts is not None else None,
            "what": site.describe(),
            "fused": fused,
            "causal": site.causal,
            "reason": "" if fused else (site.reason or "fusion turned off (fuse_attention=False)"),
            **({"kernel": kernel} if fused else {}),
        })
    return entries


def attention_pricing(cluster: Cluster, options: PlanOptions) -> str:
    """What a fused attention site is priced as (:meth:`CostTables.attention_speed`)."""
    device = cluster.device
    rate = f"attention efficiency {device.attention_efficiency:g}"
    if not runs_generated_attention(cluster, options):
        return (f"torch SDPA (the generated kernel's CPU fallback), {rate}"
                if cluster.backend == "gloo" else f"the cluster's own attention kernel, {rate}")
    return (f"autopar's generated kernel, {device.generated_attention_forward:g}x (forward) "
            f"and {device.generated_attention_backward:g}x (backward) the speed of the "
            f"device's attention kernel ({rate})")


def pipeline_entry(setting: Setting, prediction: Prediction) -> dict:
    """The pipeline part of a plan: schedule, the cut, and each stage's modelled figures."""
    if setting.pp <= 1:
        return {}
    chunks, first = [], 0
    for c, count in enumerate(prediction.partition):
        chunks.append({"chunk": c, "rank": rank_of_chunk(c, setting.pp, setting.schedule),
                       "layers": [first, first + count - 1]})
        first += count
    stages = []
    for rank, s in enumerate(prediction.stages):
        stages.append({
            "rank": rank,
            "layers": layer_ranges(s.layers),
            "forward_s": s.forward_s,
            "backward_s": s.backward_s,
            "tp_comm_s": s.tp_comm_s,
            "p2p_s": s.p2p_s,
            "time_per_microbatch_s": s.time_per_microbatch_s,
            "in_flight": s.in_flight,
            "memory_bytes": int(s.memory.total),
            "memory": s.memory.to_dict(),
            # bytes at each of the stage's peaks (forward's end, backward's start, optimizer)
            "memory_phases": {name: int(b) for name, b in s.phases.items()},
        })
    return {
        "label": "modelled",
        "schedule": setting.schedule,
        "virtual_stages": setting.virtual,
        "microbatches": setting.microbatches,
        "bubble_fraction": prediction.bubble_fraction,
        "bubble_s": prediction.bubble_s,
        "p2p_s": prediction.p2p_s,
        "chunks": chunks,
        "stages": stages,
    }


def layer_rows(gm: fx.GraphModule, summary: list[dict], setting: Setting) -> list[dict]:
    """``summary``'s rows with each layer's recomputation: one row per run of consecutive
    layers of one block under one mode (``layers`` "first-last"), the code outside the
    layers last (never recomputed)."""
    blocks: dict[int, str] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get("autopar")
        if facts is not None and facts.layer is not None and facts.block is not None:
            blocks.setdefault(facts.layer, facts.block)
    strategies = {row["block"]: row["strategies"] for row in summary}
    rows: list[dict] = []
    for position, layer in enumerate(sorted(blocks)):
        mode, block = setting.layer_mode(position), blocks[layer]
        last = rows[-1] if rows else None
        if last is not None and last["block"] == block and last["recompute"] == mode:
            last["layers"] = f"{last['layers'].split('-')[0]}-{layer}"
            continue
        rows.append({"block": block, "layers": str(layer), "recompute": mode,
                     "strategies": dict(strategies.get(block, {}))})
    outside = strategies.get("<outside layers>")
    if outside:
        rows.append({"block": "<outside layers>", "layers": "-", "recompute": "none",
                     "strategies": dict(outside)})
    return rows


def optimality(solves: tuple[dict, ...]) -> dict:
    """What the plan says about the CP-SAT solves that chose it: each solve's objective,
    bound and gap, and whether all of them were proved optimal within the model."""
    if not solves:
        return {}
    gaps = [s["gap"] for s in solves if s.get("gap") is not None]
    return {"plan_solves": list(solves),
            "proved_optimal": all(s["status"] == "OPTIMAL" for s in solves),
            "gap": max(gaps) if gaps else None}


def _layer_summary(result: SearchResult) -> list[dict]:
    """Per repeated-block kind: the non-replicated tensor-parallel choices of one layer."""
    problem, choice = result.problem, result.best.choice
    rows: dict[tuple, dict] = {}
    for d in problem.decisions:
        facts = d.facts
        s = d.candidates[choice[d.index]]
        if all(isinstance(p, Replicate) for p in (*s.inputs, *s.outputs)):
            continue
        if facts.layer is None:
            key = ("<outside layers>",)
            layers = "-"
        else:
            key = (facts.block,)
            layers_of = sorted(n.meta["autopar"].layer for n in d.nodes)
            layers = f"{layers_of[0]}-{layers_of[-1]}" if len(layers_of) > 1 else str(layers_of[0])
        row = rows.setdefault(key, {"block": key[0], "layers": layers, "strategies": {}})
        label = facts.param.fqn if facts.param else f"{d.name} ({facts.target})"
        row["strategies"][label] = str(s)
    return list(rows.values())
