"""The least memory a plan on each mesh needs: every decision at its least-memory strategy.

No search runs here: each mesh is priced once, at microbatch 1 with the highest allowed ZeRO
stage, so a failed search can say how far the model is from fitting
(:mod:`autopar.solver.search.no_plan`) and the conflict model can tell the hardware's
refusals from the constraints' (:mod:`autopar.solver.search.constraint_core`).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.analysis.batch_axis import batch_strategies
from autopar.core.cluster import Cluster
from autopar.core.graph_facts import graph_facts
from autopar.cost_models.memory import MemoryBreakdown
from autopar.solver.axes.context import cp_refusal
from autopar.solver.model.problem import Problem, build_problem, problem_skeleton
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.elementwise_fusion import fuse_elementwise
from autopar.solver.pricing.evaluate import evaluate
from autopar.solver.pricing.fusion import Fusion
from autopar.solver.search.meshes import mesh_shapes, n_layers_of
from autopar.solver.setting import Setting


def lowest_memory(
    gm: fx.GraphModule, cluster: Cluster, options: PlanOptions
) -> tuple[Setting, MemoryBreakdown] | None:
    """The setting and breakdown of the least-memory plan: each mesh at microbatch 1 with
    the highest allowed ZeRO stage, every decision at its least-memory strategy."""
    floors = mesh_memory_floors(gm, cluster, options)
    return min(floors, key=lambda f: f[1].total) if floors else None


def mesh_memory_floors(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions
                       ) -> list[tuple[Setting, MemoryBreakdown]]:
    """Per mesh, the least memory a plan on it needs (:func:`lowest_memory`'s setting)."""
    facts = graph_facts(gm)
    traced = facts.batch_size or 1
    global_batch = options.global_batch or traced
    floors: list[tuple[Setting, MemoryBreakdown]] = []
    recompute = "full" if "full" in options.recompute else options.recompute[0]
    batch = batch_strategies(gm, traced)
    fusion = Fusion.of(gm) if options.fuse_attention else Fusion()
    problems: dict[int, Problem] = {}  # per tp: the same for every dp and pp
    skeleton = problem_skeleton(gm)
    for pp, dp, cp, tp in mesh_shapes(cluster, options, n_layers_of(gm), facts.seq_len):
        if global_batch % dp or global_batch // dp < pp:
            continue
        if cp_refusal(gm, cp, options.cp_layout, facts.seq_len, options.fuse_attention):
            continue
        zero = max(options.zero) if dp * cp > 1 else 0
        setting = Setting(dp, tp, zero, 1, global_batch // dp, recompute, pp=pp, cp=cp,
                          cp_algorithm="auto" if cp > 1 else "none",  # attention unpriced
                          cp_layout=options.cp_layout)
        if tp not in problems:
            problems[tp] = fuse_elementwise(fusion.apply(build_problem(gm, tp, batch, skeleton)),
                                            gm, options.compile)
        problem = problems[tp]
        tables = CostTables(problem, cluster, options, setting, traced, facts.seq_len)
        choice = [
            min(range(len(d.candidates)),
                key=lambda i, d=d: tables.states(d, d.candidates[i]).total * d.count
                + tables.activation_memory(d, d.candidates[i]))
            for d in problem.decisions
        ]
        floors.append((setting, evaluate(tables, choice).memory))
    return floors
