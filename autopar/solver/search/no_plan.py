"""Why a search found no plan: the error it raises, saying what to change.

Either the pins rule out every mesh (each mesh's :func:`conflict`, with the arithmetic), or
every candidate was skipped (their reasons), or the model fits on no mesh at all: then the
least-memory plan's breakdown (:func:`autopar.solver.search.memory_floors.lowest_memory`)
and the shortfall.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autopar.core.cluster import Cluster
from autopar.core.constraints import memory_cap
from autopar.core.errors import NoFeasiblePlanError
from autopar.core.graph_facts import META_KEY, graph_facts
from autopar.core.units import format_bytes
from autopar.solver.options import PlanOptions
from autopar.solver.search.candidate import Candidate
from autopar.solver.search.memory_floors import lowest_memory
from autopar.solver.search.meshes import mesh_shapes, n_layers_of
from autopar.solver.search.microbatches import pipeline_variants
from autopar.solver.search.pin_conflicts import Conflict, conflict, pinned
from autopar.strategies import has_rule


def no_plan_error(
    gm: fx.GraphModule, cluster: Cluster, options: PlanOptions, candidates: list[Candidate]
) -> NoFeasiblePlanError:
    """No plan: the pins that rule out every mesh, with the arithmetic; else "fits nowhere",
    with the memory breakdown of the least-memory candidate and the shortfall."""
    global_batch = options.global_batch or graph_facts(gm).batch_size or 1
    n_layers = n_layers_of(gm)
    shapes = mesh_shapes(cluster, options, n_layers, graph_facts(gm).seq_len)
    found = [conflict(options, s, global_batch, n_layers, pipeline_variants) for s in shapes]
    if shapes and all(found):
        by_reason: dict[Conflict, list[str]] = {}
        for (pp, dp, cp, tp), c in zip(shapes, found):
            by_reason.setdefault(c, []).append(f"pp={pp} dp={dp} " + (
                f"cp={cp} " if cp > 1 else "") + f"tp={tp}")
        reasons = [f"{c.reason} (mesh {', '.join(meshes[:3])}"
                   + (f" and {len(meshes) - 3} more" if len(meshes) > 3 else "") + ")"
                   for c, meshes in by_reason.items()]
        more = len(reasons) - 2  # a reason per dp reads alike: two, and how many more
        return NoFeasiblePlanError(
            f"no plan satisfies the pins on {cluster.name}: " + "; ".join(reasons[:2])
            + (f"; and alike on {more} more mesh group(s)" if more > 0 else ""),
            where=f"pinned {pinned(options, global_batch)}",
            fix="; ".join(dict.fromkeys(c.fix for c in by_reason)),
        )
    low = lowest_memory(gm, cluster, options)
    capacity = options.capacity(cluster.device.memory_bytes)
    if low is None or low[1].total <= capacity:
        reasons = "; ".join(sorted({c.status for c in candidates})) or "none was tried"
        return NoFeasiblePlanError(
            f"no plan: every candidate was skipped ({reasons})",
            where=f"pinned {pinned(options, global_batch)} on {cluster.name}",
            fix="change the global batch or the pinned degrees (pp x virtual stages need "
            "that many layers; pipelines need at least pp microbatches)"
            + (", or pass batch_coupling='local' (--batch-coupling local) to give each part "
               "of the batch its own statistics, as DDP does" if "whole batch" in reasons
               else ""),
        )
    setting, memory = low
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in memory.to_dict().items() if k != "total")
    return NoFeasiblePlanError(
        f"the model fits on no mesh of {cluster.name}: the least-memory plan needs "
        f"{format_bytes(memory.total)} per device (pp={setting.pp}, dp={setting.dp}, "
        + (f"cp={setting.cp}, " if setting.cp > 1 else "") + f"tp={setting.tp}, ZeRO-{setting.zero}, recompute {setting.recompute}, microbatch "
        f"{setting.microbatch}: {parts}), "
        f"{format_bytes(memory.total - capacity)} more than the {format_bytes(capacity)} usable "
        + (f"(the constraint {memory_cap(options.constraints)})"
           if capacity < cluster.device.memory_bytes * options.memory_fraction else
           f"({options.memory_fraction:.0%} of {format_bytes(cluster.device.memory_bytes)})"),
        where=f"cluster {cluster.name}",
        fix="use more or larger devices"
        + ("" if 3 in options.zero else ", allow ZeRO-3 (zero=(0, 3))")
        + ", or a smaller batch or sequence"
        + _unruled_hint(gm),
    )


def _unruled_hint(gm: fx.GraphModule) -> str:
    """Ops without a sharding rule run whole on every device: say which, they may be why."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem and (
            node.meta.get(META_KEY) is not None and node.meta[META_KEY].shapes
            and not has_rule(node.target)
        ):
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    if not counts:
        return ""
    ops = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
    return (f"; note that {sum(counts.values())} ops have no sharding rule and keep their "
            f"tensors whole on every device ({ops}): register rules for them "
            "(autopar.strategies.register_rule)")
