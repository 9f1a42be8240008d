"""Which tensor-parallel layouts a search solves, which it reuses, and which it solves ahead.

Every setting the bounds leave gets its own layout solve (:func:`price_layout`), the solves
likely next started on the worker meanwhile (:func:`solve_next`,
:mod:`autopar.solver.search.solve_ahead`). The layouts solved for the same setting on other
(pp, dp) meshes and ZeRO stages (:func:`reusable`) are priced beside it: an evaluation is
far cheaper than a solve, and the evaluator sometimes prices another setting's layout
lower than the solve's own (linear) model ranked it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from autopar.core.knobs import CP_ALGORITHMS
from autopar.solver.axes.context import algorithm_costs, held_to_ground
from autopar.solver.model.cpsat import SolveResult
from autopar.solver.model.cpsat import build as build_layout
from autopar.solver.model.problem import Problem
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.search.candidate import Candidate
from autopar.solver.search.layout_trials import (
    ground_margin,
    lower_bounds,
    mixing,
    try_layout,
    try_mixed,
)
from autopar.solver.search.search_state import SearchState
from autopar.solver.setting import Setting

ProblemFor = Callable[[int], tuple[Problem, dict]]
"""A mesh's problem (and batch strategies) for one microbatch size (see ``mesh_search``)."""

SOLVES_AHEAD = 2
"""Layout solves queued on the worker at a time (:mod:`autopar.solver.search.solve_ahead`)."""


def layout_tables(state: SearchState, problem: Problem, setting: Setting
                  ) -> tuple[CostTables | None, dict]:
    """``setting``'s cost tables, its context-parallel attention algorithm chosen when
    "auto" (the cheapest, held to validated ground: :func:`held_to_ground`); (None, the
    algorithms' costs) when none fits."""
    cluster, options, traced, facts = state.cluster, state.options, state.traced, state.facts
    tables = CostTables(problem, cluster, options, setting, traced, facts.seq_len)
    if setting.cp_algorithm != "auto":
        return tables, {}
    costs = algorithm_costs(tables, _cp_algorithms(options))
    base = lower_bounds(tables)[1] / setting.microbatches  # costs are per microbatch
    margins = {a: ground_margin(replace(setting, cp_algorithm=a), cluster, options)
               for a, cost in costs.items() if not isinstance(cost, str)}
    algorithm = held_to_ground(costs, base, margins)
    if algorithm is None:
        return None, costs
    return CostTables(problem, cluster, options, replace(setting, cp_algorithm=algorithm),
                      traced, facts.seq_len), costs


def _cp_algorithms(options: PlanOptions) -> tuple[str, ...]:
    return (options.cp_algorithm,) if options.cp_algorithm else CP_ALGORITHMS


def solve_key(tables: CostTables, state_scale: float, activation_scale: float) -> tuple:
    """What a layout solve is a function of (:mod:`autopar.solver.search.solve_ahead`)."""
    return (id(tables.problem), tables.setting, state_scale, activation_scale)


def reuse_key(problem: Problem, setting: Setting) -> tuple:
    """What a solved layout is kept under for reuse (see :func:`price_layout`)."""
    return (id(problem), setting.recompute, setting.microbatch, setting.zero,
            setting.grad_group > 1, setting.cp, setting.cp_algorithm)


def reusable(key: tuple, zero: int) -> list[tuple]:
    """Layout keys priced beside a setting's own solve: the same setting's on another
    (pp, dp) mesh, then under the other ZeRO stages (``key[3]`` is the stage), which scale
    memory and data-parallel traffic more than they change which op is split how."""
    return [key] + [(*key[:3], other, *key[4:]) for other in range(4) if other != zero]


def layout_scales(setting: Setting) -> tuple[float, float]:
    """A device's share of the states (``1/pp``) and of the activations (1F1B's first
    stage keeps ``min(microbatches, pp)`` in flight) for a layout solve."""
    pp = setting.pp
    flight = min(setting.microbatches, pp)  # 1F1B's first stage
    return (1 / pp, flight / pp)


def price_layout(state: SearchState, problem_for: ProblemFor, local: int,
                 later: list[tuple[Setting, list[int]]], tables: CostTables,
                 variants: list[tuple[str, int]], batch: dict,
                 best: tuple | None) -> tuple[float | None, tuple | None]:
    """The fastest step of ``tables``' setting under ``variants`` (None when nothing fits,
    inf when nothing here beats ``best``), and the best so far. The setting's own layout is
    solved (the search then holds each setting's CP-SAT optimum, not a stand-in); the layouts
    solved for the same problem, recomputation and microbatch on another (pp, dp) mesh or
    ZeRO stage (:func:`reusable`) are priced beside it, an evaluation each, and win where
    the evaluator prices them lower than the solve's own model did. Only with the solve
    budget spent is a setting priced by reused layouts alone (the plan says so). ``later``
    are the (setting, microbatch sizes) the search walks next, for :func:`solve_next`."""
    options, cluster, candidates = state.options, state.cluster, state.candidates
    setting, problem = tables.setting, tables.problem
    key = reuse_key(problem, setting)
    uniform = options.recompute_layers is None or len(set(options.recompute_layers)) == 1
    before = [state.layouts[k] for k in (reusable(key, setting.zero) if uniform else ())
              if k in state.layouts]
    fastest, result = None, state.layouts.get(key)
    refused = state.budget.refused if state.budget is not None else 0
    if uniform or key not in state.layouts:
        result = _solve(state, problem_for, local, later, tables, bool(before))
        if result is not None:
            state.layouts[key] = result
            if uniform:
                fastest, best = try_layout(result, tables, setting, variants, cluster,
                                            candidates, best, problem, batch)
    if result is None and not before:
        return None, best
    # stand-ins: no solve of its own for want of budget (an infeasible solve is not that)
    stand_in = state.budget is not None and state.budget.refused > refused
    seen = {None if result is None else tuple(result.choice)}
    for other in before:
        if tuple(other.choice) in seen:
            continue  # the same layout: priced already
        seen.add(tuple(other.choice))
        step, best = try_layout(other, tables, setting, variants, cluster, candidates, best,
                                problem, batch, reused=True, stand_in=stand_in)
        if step is not None:
            fastest = step if fastest is None else min(fastest, step)
    if mixing(options, setting):
        step, best = try_mixed(state.layouts.get(key), tables, setting, variants, cluster,
                                candidates, best, problem, batch)
        if step is not None:
            fastest = step if fastest is None else min(fastest, step)
    return fastest, best


def _solve(state: SearchState, problem_for: ProblemFor, local: int,
           later: list[tuple[Setting, list[int]]], tables: CostTables,
           stand_ins: bool = False) -> SolveResult | None:
    """``tables``' layout, solved (on the worker when it took it ahead); None, with the
    candidate added as skipped or failed, when the budget is spent or no layout fits
    (``stand_ins``: layouts solved for other settings will be priced instead)."""
    setting, budget, ahead = tables.setting, state.budget, state.ahead
    if budget is not None and not budget.allows():
        if not stand_ins:
            state.candidates.append(Candidate(
                setting, f"SKIPPED(solve budget of {budget.limit} CP-SAT solves spent; no "
                "layout solved for another setting to price it with)"))
        return None
    if ahead.enabled:  # the solves likely next, on the other core
        solve_next(state, problem_for, local, later)
    scales = layout_scales(setting)
    key = solve_key(tables, *scales)
    build = functools.partial(build_layout, tables, state.options.time_limit_s,
                              state_scale=scales[0], activation_scale=scales[1])
    result = ahead.solve(key, build)
    if result.choice is None:
        state.candidates.append(Candidate(setting, result.status, wall_s=result.wall_s,
                                          solves=(result.stats(),)))
        return None
    return result


def solve_next(state: SearchState, problem_for: ProblemFor, local: int,
               later: list[tuple[Setting, list[int]]]) -> None:
    """Start the layout solves the microbatch search will likely ask for next, so that
    they run beside the current one: the next smaller microbatch of this setting, then
    each later setting's first, each the first size whose memory floor fits and whose
    layout no solve before can stand in for (:func:`reusable`)."""
    queued = 0
    for base, sizes in later:
        for mb in sizes:
            if local % mb:
                continue
            setting = replace(base, microbatch=mb, microbatches=local // mb)
            problem = problem_for(mb)[0]
            tables = layout_tables(state, problem, setting)[0]
            if tables is None:
                break
            scales = layout_scales(setting)
            if lower_bounds(tables, *scales)[0] > tables.capacity:
                continue  # pruned there; the next size may fit
            key = solve_key(tables, *scales)
            if state.ahead.wants(key):
                state.ahead.submit(key, build_layout(tables, state.options.time_limit_s,
                                                     state_scale=scales[0],
                                                     activation_scale=scales[1]))
            queued += 1
            break
        if queued >= SOLVES_AHEAD:
            return
