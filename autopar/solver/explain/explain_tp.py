"""How a plan uses tensor parallelism, and why: the plan's ``explanation["tp"]``.

A pinned ``tp`` reads as Megatron's tensor parallelism: the matmul weights split over the tp
ranks, activations exchanged between them. The solver may still find that splitting the
weights costs more than it saves (small layers, slow links) and keep them whole, so that
every tp rank computes the same thing; or, when allowed, split the batch over tp, which is
data parallelism by another name. Either surprises a user. So the plan states what tp
splits (weights, work, batch), and when a pinned tp shards no weight or splits the batch,
the modelled step time of the alternatives, each solved on the same mesh and options:
the matmul weights forced to be sharded (Megatron), tp not splitting the batch, and tp=1
(the same devices as data parallelism).
"""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx

from autopar.core.cluster import Cluster
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import graph_facts
from autopar.core.placements import Replicate, Shard
from autopar.core.units import format_seconds
from autopar.solver.model.problem import Problem, splits_batch
from autopar.solver.options import PlanOptions
from autopar.solver.search.mesh_search import SearchResult, search

_MATMULS = ("aten.linear", "aten.addmm", "aten.mm", "aten.matmul", "aten.bmm", "aten.embedding")


def tp_usage(problem: Problem, choice: list[int], batch_size: int) -> dict:
    """What the chosen tp strategies split: weights (count, share of their bytes), the
    forward work (share of FLOPs run on split tensors) and, of it, the work split by batch."""
    weights = sharded = 0
    weight_bytes = sharded_bytes = 0.0
    work = split_work = batch_work = 0.0
    for d in problem.decisions:
        s = d.candidates[choice[d.index]]
        split = not all(isinstance(p, Replicate) for p in (*s.inputs, *s.outputs))
        param = d.facts.param
        if d.kind == "param" and param is not None and param.trainable:
            weights += d.count
            weight_bytes += param.numel * d.count
            if split:
                sharded += d.count
                sharded_bytes += param.numel * d.count
        flops = float(d.facts.fwd_flops) * d.count
        work += flops
        if split:
            split_work += flops
            if splits_batch(d, s, batch_size):
                batch_work += flops
    return {
        "weights_sharded": sharded,
        "weights": weights,
        "weight_bytes_sharded": sharded_bytes / weight_bytes if weight_bytes else 0.0,
        "work_split": split_work / work if work else 0.0,
        "batch_split_work": batch_work / work if work else 0.0,
    }


def _shard_matmul_weights(problem: Problem) -> None:
    """Megatron's layout, forced: every matrix weight a matmul or embedding reads is split
    (where it can be; biases and norms stay free)."""
    users = {i: {problem.decisions[u.consumer].facts.target for u in info.uses
                 if u.consumer >= 0} for (i, _), info in problem.values.items()}
    for d in problem.decisions:
        param = d.facts.param
        if d.kind != "param" or param is None or len(param.shape) < 2:
            continue
        if not any(t.startswith(_MATMULS) for t in users.get(d.index, ())):
            continue
        kept = [s for s in d.candidates if isinstance(s.outputs[0], Shard)]
        d.candidates = kept or d.candidates


ALTERNATIVE_TIME_LIMIT_S = 5.0  # per solve: alternatives are for comparison, not to run


def _alternative(what: str, gm: fx.GraphModule, cluster: Cluster, options: PlanOptions,
                 adjust=None) -> dict:
    options = replace(options, time_limit_s=min(options.time_limit_s, ALTERNATIVE_TIME_LIMIT_S))
    try:
        best = search(gm, cluster, options, adjust).best
    except AutoparError as e:
        return {"what": what, "step_time_s": None, "status": e.what}
    assert best.prediction is not None
    return {"what": what, "step_time_s": best.prediction.step_time_s,
            "peak_memory_bytes": int(best.prediction.peak_memory_bytes),
            "mesh": best.setting.mesh, "status": best.status}


def explain_tp(gm: fx.GraphModule, result: SearchResult, cluster: Cluster,
               options: PlanOptions) -> dict:
    """The ``tp`` entry of the plan's explanation ({} when tp is 1)."""
    setting = result.best.setting
    if setting.tp == 1 or result.best.choice is None:
        return {}
    usage = tp_usage(result.problem, result.best.choice, graph_facts(gm).batch_size or 1)
    entry = {"tp": setting.tp, "pinned": options.tp is not None,
             "splits_batch_allowed": bool(options.tp_splits_batch), **usage}
    unexpected = []
    if usage["weights_sharded"] == 0:
        unexpected.append(f"tp={setting.tp} shards no weight")
    if usage["batch_split_work"] > 0:
        unexpected.append(f"tp={setting.tp} splits the batch "
                          f"({usage['batch_split_work']:.0%} of the work)")
    entry["unexpected"] = unexpected
    if not unexpected or options.tp is None:
        entry["why"] = ""
        return entry
    planned = {"what": "as planned", "step_time_s": result.best.prediction.step_time_s,
               "mesh": setting.mesh}
    alternatives = [planned, _alternative(
        "matmul weights sharded (Megatron)", gm, cluster,
        replace(options, tp_splits_batch=False), _shard_matmul_weights)]
    if usage["batch_split_work"] > 0:
        alternatives.append(_alternative("tp not splitting the batch", gm, cluster,
                                         replace(options, tp_splits_batch=False)))
    alternatives.append(_alternative("tp=1 on the same devices", gm, cluster,
                                     replace(options, tp=1, dp=None, tp_splits_batch=None)))
    entry["alternatives"] = alternatives
    entry["why"] = _why(unexpected, alternatives)
    return entry


def _why(unexpected: list[str], alternatives: list[dict]) -> str:
    planned = alternatives[0]["step_time_s"]
    others = []
    for alt in alternatives[1:]:
        t = alt["step_time_s"]
        if t is None:
            others.append(f"{alt['what']}: no plan ({alt['status']})")
        else:
            others.append(f"{alt['what']}: {format_seconds(t)} ({t / planned - 1:+.0%})")
    return (f"{' and '.join(unexpected)}: it is modelled fastest on this mesh at "
            f"{format_seconds(planned)} per step; " + "; ".join(others) + " (modelled)")
