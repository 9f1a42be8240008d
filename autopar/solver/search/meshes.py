"""The meshes a search walks, and the settings it tries on each.

:func:`mesh_shapes` enumerates the ``(pp, dp, cp, tp)`` factorizations the pins and mesh
constraints allow; :func:`mesh_skip` says why one of them is not searched at all (before any
problem is built); :func:`mesh_bases` lists the settings one mesh is searched under (ZeRO
stage, recomputation, expert degree, HSDP replicas), which the microbatch search
(:mod:`autopar.solver.search.microbatches`) then sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch.fx as fx

from autopar.analysis.batch_coupling import Coupling, coupling_refusal
from autopar.core.cluster import Cluster
from autopar.core.constraints import Degree, DeviceBudget, SettingView
from autopar.core.errors import AutoparError, NoFeasiblePlanError
from autopar.core.graph_facts import META_KEY, GraphFacts
from autopar.core.knobs import LEANNESS, RECOMPUTE_MODES
from autopar.solver.axes.context import CP_SEARCH_MIN_TOKENS, cp_refusal
from autopar.solver.axes.expert_axis import ep_degrees, ep_refusal
from autopar.solver.axes.hsdp import replicate_degrees
from autopar.solver.model.problem import Problem
from autopar.solver.options import PlanOptions
from autopar.solver.search.candidate import Candidate
from autopar.solver.setting import Setting


def mesh_shapes(cluster: Cluster, options: PlanOptions, n_layers: int,
                seq_len: int | None = None) -> list[tuple[int, int, int, int]]:
    """(pp, dp, cp, tp) factorizations of the world: ``tp`` divides the devices of one node,
    ``pp`` is at most the number of layers (a stage holds at least one). ``cp`` > 1 only
    when pinned, or while each rank keeps :data:`CP_SEARCH_MIN_TOKENS` of a
    ``seq_len``-token sequence."""
    world = cluster.world_size
    shapes = []
    for tp in range(1, cluster.devices_per_node + 1):
        if cluster.devices_per_node % tp or world % tp:
            continue
        for pp in range(1, world // tp + 1):
            if (world // tp) % pp or (pp > 1 and pp > n_layers):
                continue
            for cp in _cp_degrees(world // tp // pp, options, seq_len):
                dp = world // tp // pp // cp
                if options.tp is not None and tp != options.tp:
                    continue
                if options.dp is not None and dp != options.dp:
                    continue
                if options.pp is not None and pp != options.pp:
                    continue
                if not _mesh_allowed(options, pp, dp, cp, tp):
                    continue
                shapes.append((pp, dp, cp, tp))
    # the least model parallelism first (pp, then tp, then cp): where the solve budget ends
    # the search (a large cluster), the meshes data parallelism can train are priced (their
    # layouts are the quickest to solve, and ZeRO makes them fit), not only tp-heavy ones
    return sorted(shapes, key=lambda s: (s[0], s[3], s[2]))


def _mesh_allowed(options: PlanOptions, pp: int, dp: int, cp: int, tp: int) -> bool:
    """Whether the mesh constraints (degrees and device budgets, which see nothing else)
    allow a mesh; the others are checked on each whole setting."""
    view = SettingView(dp=dp, tp=tp, pp=pp, cp=cp)
    return all(c.allows(view) for c in options.constraints
               if isinstance(c, DeviceBudget) or (isinstance(c, Degree) and c.axis != "ep"))


def _cp_degrees(n: int, options: PlanOptions, seq_len: int | None) -> list[int]:
    if options.cp is not None:
        return [options.cp] if n % options.cp == 0 else []
    out = [1]
    cp = 2
    while seq_len and n % cp == 0 and seq_len // cp >= CP_SEARCH_MIN_TOKENS:
        out.append(cp)
        cp *= 2
    return out


def n_layers_of(gm: fx.GraphModule) -> int:
    """Repeated layers in the graph (what pipeline stages are cut from)."""
    return len({n.meta[META_KEY].layer for n in gm.graph.nodes
                if META_KEY in n.meta and n.meta[META_KEY].layer is not None})


def stage_refusal(gm: fx.GraphModule, n_layers: int) -> str:
    """Why a pipeline cannot cut ``gm`` into more stages than its ``n_layers`` layers."""
    if n_layers:
        return (f"each pipeline stage holds whole layers, and the model has {n_layers} layers "
                f"(at most pp={n_layers})")
    shared = sorted({key.split("@")[0].removeprefix("L__self__").lstrip("_") or "<root>"
                     for n in gm.graph.nodes for key in (n.meta.get("nn_module_stack") or {})
                     if "@" in key})
    if shared:
        return (f"the model applies module {shared[0]!r} more than once (its weights shared by "
                "every application, as ALBERT's layers are), and pipeline stages are cut "
                "between layers that own their weights")
    return ("pipeline stages are cut between repeated layers (an nn.ModuleList or "
            "nn.Sequential of alike blocks), and the model has none")


def no_mesh_error(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions,
                  n_layers: int) -> NoFeasiblePlanError:
    """What a search raises when :func:`mesh_shapes` finds no mesh: the pinned pipeline
    is deeper than the layers, or the pinned degrees do not multiply to the devices."""
    if (options.pp or 1) > n_layers:
        return NoFeasiblePlanError(
            f"pp={options.pp}: {stage_refusal(gm, n_layers)}", where="pp",
            fix="plan with pp=1 (tensor or data parallelism split such a model), or build its "
            "layers as an nn.ModuleList of alike blocks")
    pins = {k: getattr(options, k) for k in ("pp", "dp", "cp", "tp")
            if getattr(options, k) is not None}
    pinned = ", ".join(f"{k}={v}" for k, v in pins.items())
    per_node, world = cluster.devices_per_node, cluster.world_size
    tps = [t for t in range(1, per_node + 1) if per_node % t == 0 and world % t == 0]
    free = replace(options, **{k: None for k in ("pp", "dp", "cp", "tp")})
    shapes = [dict(zip(("pp", "dp", "cp", "tp"), m)) for m in mesh_shapes(cluster, free, n_layers)]
    # the meshes with each pin the cluster can take (a tp it cannot take matches none)
    keep = {k: v for k, v in pins.items() if any(m[k] == v for m in shapes)}
    meshes = [tuple(m.values()) for m in shapes if all(m[k] == v for k, v in keep.items())]
    if not meshes:  # pins that are each possible but not together: those with the tp
        meshes = [tuple(m.values()) for m in shapes if m["tp"] == keep.get("tp", m["tp"])]
    valid = "; ".join(f"pp={pp} dp={dp} tp={tp}" + (f" cp={cp}" if cp > 1 else "")
                      for pp, dp, cp, tp in meshes[:8])
    product = "pp x dp x cp x tp" if options.cp else "pp x dp x tp"
    return NoFeasiblePlanError(
        f"no mesh matches {pinned} on {world} devices ({cluster.nodes} node(s) x "
        f"{per_node}) for a model of {n_layers} layers",
        where="/".join(pins) or "pp/dp/tp",
        fix=f"{product} must equal the {world} devices, tp must divide the {per_node} "
        f"devices of a node (tp = {', '.join(map(str, tps))}), and pp must not exceed the "
        f"{n_layers} layers" + (f"; meshes that do: {valid}" if valid else ""),
    )


def check_cp(gm: fx.GraphModule, options: PlanOptions, seq_len: int | None) -> None:
    """A pinned ``cp`` the model cannot run is refused before any search, naming why."""
    why = cp_refusal(gm, options.cp or 1, options.cp_layout, seq_len, options.fuse_attention)
    if why:
        raise AutoparError(
            f"cp={options.cp}: {why}", where="cp",
            fix="pick a cp whose chunks divide the sequence (cp_layout='contiguous' needs cp "
            "chunks, 'zigzag' 2·cp), use the fused-attention form of the model, or cp=1")


def mesh_skip(gm: fx.GraphModule, options: PlanOptions, facts: GraphFacts,
              couplings: list[Coupling], refusals: dict[int, str], global_batch: int,
              mesh: tuple[int, int, int, int]) -> str | None:
    """Why a mesh is not searched (its SKIPPED status), or None. ``refusals`` keeps each
    cp degree's :func:`cp_refusal`, the same for every mesh with that degree."""
    pp, dp, cp, tp = mesh
    if global_batch % dp:
        return f"SKIPPED(global batch {global_batch} not divisible by dp={dp})"
    if cp not in refusals:  # the same for every mesh with this cp
        refusals[cp] = cp_refusal(gm, cp, options.cp_layout, facts.seq_len,
                                  options.fuse_attention)
    coupled = coupling_refusal(couplings, dp, 1)
    if coupled:
        return f"SKIPPED({coupled})"
    refusal = refusals[cp]
    if refusal:
        return f"SKIPPED(cp={cp}: {refusal})"
    return None


def mesh_bases(gm: fx.GraphModule, options: PlanOptions, cluster: Cluster, problem: Problem,
               facts: GraphFacts, n_layers: int, mesh: tuple[int, int, int, int],
               candidates: list[Candidate]) -> Iterator[Setting]:
    """The settings one mesh is searched under, in order (ZeRO stage, recomputation, expert
    degree, HSDP replicas), without microbatching; what cannot run is added to
    ``candidates`` as skipped."""
    pp, dp, cp, tp = mesh
    # stages 0 and 3 first: ZeRO-1/2 may then reuse their layouts (layout_solves.reusable)
    offload = options.offload[0] if len(options.offload) == 1 else "none"
    for zero in sorted(options.zero, key=(0, 3, 2, 1).index):
        if dp * cp == 1 and zero > 0:
            continue  # ZeRO shards over data parallelism; nothing to shard
        if offload != "none" and (zero != 3 or dp * cp == 1):
            continue  # FSDP2 offloads ZeRO-3's shards
        for recompute in _recompute_modes(options, problem, facts.seq_len, n_layers):
            degrees = ep_degrees(gm, options, dp, pp, cp, zero, tp, cluster.devices_per_node)
            if not degrees and options.ep:
                candidates.append(Candidate(Setting(dp, tp, zero, 0, 0, pp=pp, cp=cp),
                                            f"SKIPPED({ep_refusal(gm, options.ep, dp, cp, zero)})"))
            for ep in degrees:
                # HSDP after full sharding: it reuses that layout (layout_solves.reusable)
                replicas = replicate_degrees(options, dp, cp, tp, zero, ep, offload,
                                             cluster.devices_per_node)
                if not replicas:
                    candidates.append(Candidate(
                        Setting(dp, tp, zero, 0, 0, pp=pp, cp=cp, ep=ep),
                        f"SKIPPED(dp_replicate={options.dp_replicate} does not run with "
                        f"dp={dp}, ZeRO-{zero}{', ep' if ep > 1 else ''})"))
                for replicate in replicas:
                    yield Setting(dp, tp, zero, 0, 0, recompute, pp=pp, cp=cp,
                                  cp_algorithm="auto" if cp > 1 else "none",
                                  cp_layout=options.cp_layout, ep=ep, offload=offload,
                                  dp_replicate=replicate)


def _recompute_modes(options: PlanOptions, problem: Problem, seq_len: int | None,
                     n_layers: int) -> list[str]:
    """The allowed recomputation modes, without "selective" when no activation autograd
    keeps is quadratic in the sequence (flash-style or fused attention already recomputes
    its scores; a causal mask is not an activation): it would plan the same as "none".
    With ``recompute_layers`` pinned: the leanest of them (the layout is solved under it,
    then each layer gets its pinned mode)."""
    if options.recompute_layers is not None:
        pinned = options.recompute_layers
        if len(pinned) != n_layers:
            raise AutoparError(
                f"recompute_layers gives {len(pinned)} mode(s); the model has {n_layers} "
                "repeated layer(s)", where="recompute_layers",
                fix=f"give one of {', '.join(RECOMPUTE_MODES)} per layer, in running order")
        return [min(pinned, key=LEANNESS.index)]
    modes = list(options.recompute)
    if "selective" in modes and seq_len:
        quadratic = any(list(s).count(seq_len) >= 2 for d in problem.decisions
                        if d.facts.requires_grad and d.name not in problem.fused_attention
                        for s in d.facts.shapes)
        if not quadratic and len(modes) > 1:
            modes.remove("selective")
    return modes
