"""The outer search: mesh shapes x ZeRO stage x microbatch size, each solved by CP-SAT.

For every factorization ``world = dp x tp`` with ``tp`` inside a node, every allowed ZeRO
stage and microbatch sizes from the largest down, it builds the cost tables, skips settings
whose memory lower bound already exceeds the device or whose time lower bound cannot beat
the best plan so far, and solves the rest. The fastest feasible setting wins; ties go to the
smaller ``tp`` and ZeRO stage, so the result is deterministic.

The meshes and the settings on each come from :mod:`autopar.solver.search.meshes`, the
microbatch walk of one setting from :mod:`autopar.solver.search.microbatches`, and the error
when nothing fits from :mod:`autopar.solver.search.no_plan`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from autopar.analysis.batch_axis import batch_strategies
from autopar.analysis.batch_coupling import Coupling, batch_couplings, splitting
from autopar.core.cluster import Cluster
from autopar.core.graph_facts import graph_facts
from autopar.solver.axes.context import CP_LONG_CONTEXT
from autopar.solver.axes.expert_axis import check_ep
from autopar.solver.axes.hsdp import check_dp_replicate
from autopar.solver.model.problem import (
    Problem,
    Skeleton,
    build_problem,
    forbid_splitting_batch,
    problem_skeleton,
)
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.elementwise_fusion import fuse_elementwise
from autopar.solver.pricing.fusion import Fusion
from autopar.solver.search.candidate import Candidate
from autopar.solver.search.meshes import (
    check_cp,
    mesh_bases,
    mesh_shapes,
    mesh_skip,
    n_layers_of,
    no_mesh_error,
)
from autopar.solver.search.microbatches import check_microbatch, search_microbatches
from autopar.solver.search.no_plan import no_plan_error
from autopar.solver.search.search_state import SearchState, SolveBudget
from autopar.solver.search.solve_ahead import SolveAhead
from autopar.solver.setting import Setting


@dataclass
class SearchResult:
    best: Candidate
    problem: Problem
    tables: CostTables
    batch: dict  # node name -> dp strategy
    candidates: list[Candidate]
    wall_s: float
    couplings: tuple[Coupling, ...] = ()  # ops coupling the batch (batch_coupling)
    budget: SolveBudget | None = None
    interrupted: bool = False  # stopped by Ctrl-C: the best plan so far


def search(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions,
           adjust: Callable[[Problem], None] | None = None) -> SearchResult:
    """The fastest plan; ``adjust`` may narrow each problem's candidates before solving (the
    plan's explanation solves such alternatives)."""
    started = time.perf_counter()
    facts = graph_facts(gm)
    traced = facts.batch_size or 1
    global_batch = options.global_batch or traced
    n_layers = n_layers_of(gm)
    check_microbatch(traced, options.microbatch)
    check_cp(gm, options, facts.seq_len)
    check_ep(gm, options, cluster.world_size)
    check_dp_replicate(options)
    shapes = mesh_shapes(cluster, options, n_layers, facts.seq_len)
    if not shapes:
        raise no_mesh_error(gm, cluster, options, n_layers)
    best: tuple | None = None  # (step, pp, tp, zero, cp, candidate, problem, tables, batch)
    fusion = Fusion.of(gm) if options.fuse_attention else Fusion()
    batch = batch_strategies(gm, traced)
    found = batch_couplings(gm, batch)
    couplings = splitting(found) if options.batch_coupling == "exact" else []
    state = SearchState(cluster, options, facts, traced, n_layers, couplings, candidates=[],
                        layouts={}, budget=SolveBudget(options.max_solves),
                        ahead=SolveAhead())  # layout solves ahead on a second core
    problem_of = _problem_maker(gm, options, fusion, batch, traced, adjust)
    refusals: dict[int, str] = {}

    def ordered():
        """Meshes without cp first; cp > 1 with them for long contexts (or when pinned), else
        only when nothing fits without it."""
        long = options.cp is not None or (facts.seq_len or 0) >= CP_LONG_CONTEXT
        yield from (s for s in shapes if s[2] == 1 or long)
        if not long and best is None:
            yield from (s for s in shapes if s[2] > 1)

    interrupted = False  # Ctrl-C: the best plan so far, said to be one
    try:
        for pp, dp, cp, tp in ordered():
            skip = mesh_skip(gm, options, facts, couplings, refusals, global_batch,
                             (pp, dp, cp, tp))
            if skip:
                state.candidates.append(Candidate(Setting(dp, tp, 0, 0, 0, pp=pp, cp=cp), skip))
                continue
            local = global_batch // dp
            problem_for = functools.partial(problem_of, tp=tp)
            problem = problem_for(local)[0]
            bases = list(mesh_bases(gm, options, cluster, problem, facts, n_layers,
                                    (pp, dp, cp, tp), state.candidates))
            for i, base in enumerate(bases):
                best = search_microbatches(state, problem_for, local, base, bases[i + 1:], best)
    except KeyboardInterrupt as stop:
        best = getattr(stop, "best", None) or best
        if best is None:
            raise KeyboardInterrupt from None
        interrupted = True
    finally:
        state.ahead.close()
    if best is None:
        error = no_plan_error(gm, cluster, options, state.candidates)
        error.tried = bool(state.candidates)  # (an offloading retry that tried nothing says so)
        raise error
    return SearchResult(best[5], best[6], best[7], best[8], state.candidates,
                        time.perf_counter() - started, tuple(found), state.budget, interrupted)


def _problem_maker(gm: fx.GraphModule, options: PlanOptions, fusion: Fusion, batch: dict,
                   traced: int, adjust: Callable[[Problem], None] | None
                   ) -> Callable[..., tuple[Problem, dict]]:
    """``problem_for(microbatch, tp)``: the tp decisions for one microbatch size, built once
    and shared by every dp and pp (and by the sizes that split the batch alike)."""
    problems: dict[tuple[int, bool], tuple] = {}
    skeleton: list[Skeleton] = []  # built with the first problem, shared by the others

    def problem_for(microbatch: int, tp: int) -> tuple[Problem, dict]:
        """Splitting the batch over tp needs a microbatch that tp divides (problems are
        shared by the sizes that allow it)."""
        splits_batch = options.tp_splits_batch and microbatch % tp == 0
        key = (tp, splits_batch)  # shared by every dp and pp
        if key not in problems:
            if not skeleton:
                skeleton.append(problem_skeleton(gm))
            problem = fuse_elementwise(fusion.apply(build_problem(gm, tp, batch, skeleton[0])),
                                       gm, options.compile)
            if not splits_batch and tp > 1:
                forbid_splitting_batch(problem, traced)
            if adjust is not None:
                adjust(problem)
            problems[key] = (problem, batch)
        return problems[key]

    return problem_for
