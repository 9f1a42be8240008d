"""Which expert-parallel degrees a setting may use, and refusals of a pinned ``ep``.

Expert parallelism is carved out of data parallelism (as in Megatron-Core and torchtitan):
``ep`` consecutive data-parallel ranks share out each MoE layer's experts, so ``ep``
divides ``dp`` and every layer's expert count. The runtime executes it with ZeRO-0, and with
ZeRO-3 where each layer's expert weights have a module of their own (FSDP2 shards it over
the ranks holding the same experts), with or without pipeline stages, and without context
parallelism yet; the planner offers only what runs.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.analysis.expert_sites import (
    ExpertRegionError,
    expert_module,
    expert_regions,
    regions_of,
)
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY
from autopar.solver.options import PlanOptions


def ep_degrees(gm: fx.GraphModule, options: PlanOptions, dp: int, pp: int, cp: int,
               zero: int, tp: int = 1, devices_per_node: int | None = None) -> list[int]:
    """The ``ep`` values to price for one (mesh, ZeRO stage), where the runtime can execute
    them: 1; the largest ep whose group stays inside a node (``ep`` consecutive dp ranks
    span ``ep x tp`` devices: the all-to-all on the fastest links); and the largest ep
    dividing dp and every layer's experts (the least expert memory). Degrees in between
    trade the same two things and are not priced, which keeps a search over thousands of
    devices as fast as without experts."""
    regions = regions_of(gm)
    runs = (zero == 0 or (zero == 3 and sharded_alone(gm))) and cp == 1
    if options.ep is not None:
        return [options.ep] if options.ep == 1 or (runs and dp % options.ep == 0) else []
    if not regions or not runs:
        return [1]
    counts = {r.experts for r in regions}
    allowed = [e for e in range(2, dp + 1) if dp % e == 0 and all(c % e == 0 for c in counts)]
    if not allowed:
        return [1]
    inside = [e for e in allowed if devices_per_node is None or e * tp <= devices_per_node]
    return sorted({1, allowed[-1], *(inside[-1:])})


def ep_refusal(gm: fx.GraphModule, ep: int, dp: int, cp: int, zero: int) -> str:
    """Why a pinned ``ep`` cannot run with this mesh and ZeRO stage ("" when it can)."""
    if ep == 1:
        return ""
    if cp > 1:
        return f"ep={ep} does not run with context parallelism"
    if dp % ep:
        return f"ep={ep} does not divide dp={dp}"
    if zero not in (0, 3):
        return f"expert parallelism runs with ZeRO-0 or 3, not {zero}"
    if zero == 3 and not sharded_alone(gm):
        return ("ZeRO-3 shards the experts as a module of their own, inside their layer; "
                "these experts run outside the model's layers (or share a module with "
                "other weights): plan with zero=0")
    return ""


def sharded_alone(gm: fx.GraphModule) -> bool:
    """Can ZeRO-3 shard every expert region's weights as a module of their own? They must
    be one module's, and run inside a layer (``outline-experts`` cuts them out of their
    layer's module) unless the model has no layers (then out of the whole graph)."""
    regions = regions_of(gm)
    layered = any(META_KEY in n.meta and n.meta[META_KEY].layer is not None
                  for n in gm.graph.nodes)
    return bool(regions) and all(
        expert_module(gm, r.weight_fqns) is not None
        and (not layered or all(mm.meta[META_KEY].layer is not None for mm in r.matmuls))
        for r in regions)


def check_ep(gm: fx.GraphModule, options: PlanOptions, devices: int) -> None:
    """A pinned ``ep`` the model or cluster cannot run is refused before any search."""
    ep = options.ep
    if ep is None or ep == 1:
        return
    if ep > devices:
        raise AutoparError(f"ep={ep} is more than the {devices} devices", where="ep",
                           fix=f"pick an ep that divides the data-parallel degree (<= {devices})")
    try:
        regions = expert_regions(gm)
    except ExpertRegionError as e:
        raise AutoparError(f"ep={ep}: the experts cannot be spread: {e}", where="ep",
                           fix="write the experts as grouped matmuls over stacked weights "
                           "(torch._grouped_mm, autopar.ops.moe_ops.grouped_mm), or plan with "
                           "ep=1") from e
    if not regions:
        raise AutoparError(f"ep={ep}, but the model has no experts autopar can spread "
                           "(grouped matmuls over stacked weights, einsums over capacity "
                           "slots, or a list of expert modules each picking its tokens)",
                           where="ep", fix="plan with ep=1 (or leave ep to the planner)")
    for region in regions:
        if region.experts % ep:
            raise AutoparError(
                f"ep={ep} does not divide the {region.experts} experts of "
                f"{region.matmuls[0].name} ({', '.join(region.weight_fqns)})", where="ep",
                fix=f"pick an ep that divides {region.experts}")
    if options.dp is not None and options.dp % ep:
        raise AutoparError(f"ep={ep} does not divide dp={options.dp}", where="ep",
                           fix="expert parallelism is carved out of data parallelism: pick "
                           "an ep that divides dp")
