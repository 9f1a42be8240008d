"""The plan's word on experts: how many MoE layers, how they are spread, what moving tokens
to them costs (``plan.explanation["experts"]``).

The all-to-all volume is what one rank sends to the other ranks of its ``ep`` group per
step, modelled from the rows each expert region reads (tokens x top-k x hidden): rows out to
the experts' owners and back in forward, the same again in backward (and once more for a
fully recomputed layer), of which ``(ep - 1) / ep`` leave the rank when tokens choose
experts evenly.
"""

from __future__ import annotations

import torch

from autopar.analysis.expert_sites import ExpertRegion, regions_of
from autopar.core.graph_facts import META_KEY
from autopar.cost_models.expert_load import busiest_rank_excess, dropped_fraction
from autopar.solver.pricing.costs import CostTables


def experts_entry(tables: CostTables, candidates: list,
                  chosen_step_s: float | None = None) -> dict:
    """``{"layers", "experts", "ep", "per_rank", "all_to_all_bytes_per_step",
    "all_to_all_s", "why"}`` for a model with expert regions; empty otherwise."""
    gm = tables.problem.gm
    regions = regions_of(gm)
    if not regions:
        return {}
    setting = tables.setting
    ep = setting.ep
    counts = sorted({r.experts for r in regions})
    entry: dict = {"layers": len(regions), "experts": counts[0] if len(counts) == 1 else counts,
                   "ep": ep, "per_rank": [c // ep for c in counts] if len(counts) > 1
                   else counts[0] // ep}
    volume = seconds = 0.0
    if ep > 1:
        problem = tables.problem
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        recomputed = 3 if setting.layer_mode(0) == "full" else 2
        for region in regions:
            first = min(region.matmuls, key=order.__getitem__)
            rows = problem.decision_of.get(region.rows.name)
            d = problem.decisions[problem.decision_of[first.name]]
            if rows is not None:  # one instance's rows (repeated layers share a decision)
                volume += tables.value_bytes((rows, 0)) * 2 * recomputed * (ep - 1) / ep
            f, b = tables.expert_comm(d)
            seconds += f + b
        volume *= setting.microbatches
        seconds *= setting.microbatches
    entry["all_to_all_bytes_per_step"] = round(volume)
    entry["all_to_all_s"] = seconds
    entry["load"] = load_entry(regions, setting.ep, setting.microbatch / tables.traced_batch)
    entry["why"] = _why(ep, setting, candidates, chosen_step_s)
    return entry


def load_entry(regions: list[ExpertRegion], ep: int, scale: float) -> dict:
    """How uneven the experts' load is by chance alone, per microbatch (modelled, a lower
    bound: :mod:`autopar.cost_models.expert_load`): the busiest ep rank's excess over its
    expected tokens, and the (token, choice) pairs a capacity drops. ``scale``: microbatch
    sequences per traced sequence."""
    region = regions[0]  # the layers are alike; the first stands for them
    entry: dict = {"basis": "chance under balanced routing, a lower bound"}
    slots = _slots(region)
    if slots is not None:  # GShard-style capacity slots
        sequences, per_sequence, experts, capacity = slots
        pairs = sequences * per_sequence * scale
        dropped = dropped_fraction(per_sequence, experts, capacity)
        if dropped > 1e-9:
            entry.update(capacity_slots=capacity, dropped_fraction=dropped)
    else:
        pairs = _rows(region.rows) * scale  # sorted (token, choice) pairs
        if region.kind == "loop":  # one expert's expected rows
            pairs *= region.experts
    entry["busiest_rank_excess"] = busiest_rank_excess(pairs * ep, ep)
    return entry


def _rows(node) -> float:
    facts = node.meta.get(META_KEY)
    return float(facts.shapes[0][0]) if facts is not None and facts.shapes else 0.0


def _slots(region: ExpertRegion) -> tuple[int, int, int, int] | None:
    """(sequences, pairs per sequence, experts, slots per expert) of GShard-style capacity
    slots: the dispatch einsum ``bsec,bsm->becm`` that fills them says all four."""
    producer = region.rows
    if region.kind != "dense" or producer.target is not torch.ops.aten.einsum.default:
        return None
    val = producer.args[1][0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim != 4:
        return None
    sequences, pairs, experts, capacity = (int(d) for d in val.shape)
    return sequences, pairs, experts, capacity


def _why(ep: int, setting, candidates: list, chosen_step_s: float | None = None) -> str:
    if ep > 1 and setting.zero == 3:
        edp = setting.dp // ep
        return (f"each of {ep} consecutive data-parallel ranks keeps 1/{ep} of every layer's "
                f"experts, sharded (ZeRO-3) over the {edp} rank(s) holding the same ones: "
                f"each rank gathers and reduces {ep}x fewer expert weights than with the "
                "experts everywhere, paid for by the token all-to-alls (modelled)")
    if ep > 1:
        return (f"each of {ep} consecutive data-parallel ranks keeps 1/{ep} of every layer's "
                "experts: their weights, gradients and optimizer states shrink by "
                f"{ep}x, paid for by the token all-to-alls (modelled)")
    spread = [c for c in candidates if c.get("ep", 1) > 1 and "step_time_s" in c]
    if not spread:
        return ("experts kept whole on every rank: spreading them (ep > 1) needs ZeRO-0, or "
                "ZeRO-3 with the experts' weights in a module of their own, no context "
                "parallelism, and an ep dividing dp and the experts; none of the solved "
                "settings allowed it")
    best = min(spread, key=lambda c: c["step_time_s"])
    said = (f"experts kept whole on every rank: the best setting spreading them "
            f"(ep={best['ep']}, dp={best['dp']}) was predicted at "
            f"{best['step_time_s']:.4g} s per step (modelled)")
    if chosen_step_s is not None and best["step_time_s"] < chosen_step_s:
        # the search handicaps a layout beyond the cost model's validated ground
        return (f"{said}, faster than the chosen {chosen_step_s:.4g} s, but beyond the ground "
                "the cost model was validated on, where it must win by the model's error "
                "there (extrapolation_margin)")
    return f"{said}, slower"
