"""Pricing one solved tp layout under a setting: every pipeline variant with its balanced
stage cut, the per-layer recomputation mixes, the validated-ground handicap, and the floors
that let the search skip what cannot win.

:mod:`autopar.solver.search.microbatches` walks the settings and
:mod:`autopar.solver.search.layout_solves` solves layouts; this module turns one solved layout
into candidates and keeps the best (step, pp, tp, zero, cp, candidate,
problem, tables, batch) tuple so far.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from autopar.core.cluster import Cluster
from autopar.core.constraints import stage_cuts
from autopar.cost_models.comm import axis_link, busy_latency
from autopar.cost_models.data_parallel import OVERLAP_SLOWDOWN
from autopar.cost_models.ground import load_ground
from autopar.cost_models.pipeline import bubble_fraction, schedule_name
from autopar.solver.model.cpsat import SolveResult
from autopar.solver.model.layer_recompute import choose_layer_modes, compose_units, with_modes
from autopar.solver.model.stages import balance
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables, fp8_copy
from autopar.solver.pricing.evaluate import (
    assemble,
    data_parallel_costs,
    grads_outlive_backward,
    stage_load,
)
from autopar.solver.pricing.unit_costs import UnitCosts, unit_costs
from autopar.solver.search.candidate import Candidate
from autopar.solver.setting import Setting


def try_layout(result: SolveResult | None, tables: CostTables, setting: Setting, variants,
                cluster: Cluster, candidates: list, best, problem, batch, reused: bool = False,
                stand_in: bool = False):
    """Evaluate one solved layout under every pipeline variant of ``setting``, each with its
    balanced cut; (fastest step that fits, or inf when the variants that might fit cannot
    beat the best plan so far, or None when none fits; best so far). ``reused``: solved for
    another setting; ``stand_in``: and the setting has no solve of its own (never pruned by
    its work, which bounds that layout, not the setting)."""
    if result is None or result.choice is None:
        return None, best
    pp = setting.pp
    units = _units(tables, result.choice)
    status = f"{result.status}(layout reused)" if reused else result.status
    wall = 0.0 if reused else result.wall_s
    fastest = None
    work, dp_floor = _work(units), _dp_floor(tables, units, setting)
    for schedule, virtual in variants:
        variant = replace(setting, schedule=schedule, virtual=virtual)
        if not stand_in and _beaten(best, work, variant, cluster, tables.options, dp_floor):
            fastest = math.inf if fastest is None else fastest
            continue
        if pp > 1:
            cut = _layout_cut(tables, result.choice, variant)
            if cut is False:
                continue
            variant = replace(variant, partition=cut)  # None: equal counts (won't fit)
        cand = Candidate(variant, status, choice=result.choice, wall_s=wall,
                         solves=(_layout_stats(result, reused, stand_in),))
        prediction = assemble(tables, units, variant)
        if prediction.peak_memory_bytes > tables.capacity:
            if not reused:  # another setting's layout that does not fit is simply dropped
                cand.prediction = prediction
                cand.status = "REJECTED(evaluated memory above capacity)"
                candidates.append(cand)
            continue
        cand.prediction = prediction
        candidates.append(cand)
        step = prediction.step_time_s
        fastest = step if fastest is None else min(fastest, step)
        # Validated ground first: a layout beyond it must win by the model's error there.
        key = (step * (1 + ground_margin(variant, cluster, tables.options)), pp, setting.tp,
               setting.zero, setting.cp)
        if best is None or key < best[:5]:
            best = (*key, cand, problem, tables, batch)
    return fastest, best


def _layout_stats(result: SolveResult, reused: bool, stand_in: bool = False) -> dict:
    """The layout solve's figures, marked when this candidate reuses it (``stand_in``: in
    place of a solve of its own, for want of solve budget)."""
    if not reused:
        return result.stats()
    return {**result.stats(), "reused": True, **({"stand_in": True} if stand_in else {})}


def _stage_load(units, variant: Setting, cluster: Cluster):
    """What the stage balancer needs of ``units``, sends priced on ``variant``'s pp links."""
    return stage_load(units, axis_link(cluster, variant.mesh, "pp"),
                      busy_latency(cluster, variant.mesh, "pp"))


def _layout_cut(tables: CostTables, choice: list[int], variant: Setting
                ) -> tuple[int, ...] | None | bool:
    """:func:`_cut` of a solved layout's units under ``variant`` (a schedule of ``tables``'
    setting), made once: the uniform and the per-layer pricing of a layout both ask."""
    key = ("cut", tuple(choice), variant.schedule, variant.virtual)
    if key not in tables.units:
        load = _stage_load(_units(tables, choice), variant, tables.cluster)
        tables.units[key] = _cut(load, variant, tables)
    return tables.units[key]


def _cut(load, variant: Setting, tables: CostTables) -> tuple[int, ...] | None | bool:
    """``variant``'s balanced stage cut (None: none fits, equal counts are priced); False
    when the constraints require stage boundaries and no cut with them fits."""
    cuts = stage_cuts(tables.options.constraints)
    cut = balance(load, variant.pp, variant.schedule, variant.virtual, variant.microbatches,
                  tables.capacity, cuts)
    return False if cut is None and cuts else cut


def mixing(options: PlanOptions, setting: Setting) -> bool:
    """Whether to try per-layer modes from this setting's layout: always when they are
    pinned; else when the setting recomputes and keeping everything is also allowed."""
    if options.recompute_layers is not None:
        return len(set(options.recompute_layers)) > 1
    return setting.recompute != "none" and "none" in options.recompute


def _units(tables: CostTables, choice: list[int]):
    """``unit_costs(tables, choice)``, computed once per tables and layout."""
    key = tuple(choice)
    if key not in tables.units:
        tables.units[key] = unit_costs(tables, choice)
    return tables.units[key]


def try_mixed(result: SolveResult | None, tables: CostTables, setting: Setting, variants,
               cluster: Cluster, candidates: list, best, problem, batch):
    """Price ``result``'s layout with a mode per layer: the pinned ones, or "none" or the
    setting's mode chosen per layer by CP-SAT (:mod:`autopar.solver.model.layer_recompute`);
    (fastest step that fits, inf or None as :func:`try_layout` says; best so far)."""
    if result is None or result.choice is None:
        return None, best
    options = tables.options
    pinned = options.recompute_layers
    modes = sorted(set(pinned)) if pinned else ["none", setting.recompute]
    by_mode = {}
    for mode in modes:
        t = tables if mode == setting.recompute else CostTables(
            problem, cluster, options, replace(setting, recompute=mode), tables.traced_batch,
            tables.seq_len)
        by_mode[mode] = _units(t, result.choice)
    pp = setting.pp
    fastest = None
    keep_work = 0.0 if pinned else _work(by_mode["none"])
    dp_floor = 0.0 if pinned else _dp_floor(tables, by_mode["none"], setting)
    keep_all = () if pinned else ("none",) * len(by_mode["none"].layers)
    # the same for every schedule (keeping every layer's activations: the "none" units)
    composed = compose_units(by_mode, pinned) if pinned else by_mode["none"]
    for schedule, virtual in variants:
        variant = replace(setting, schedule=schedule, virtual=virtual)
        if not pinned and _beaten(best, keep_work, variant, cluster, options, dp_floor):
            fastest = math.inf if fastest is None else fastest
            continue  # keeping every activation is the fastest mix
        if pp > 1:
            if pinned:
                cut = _cut(_stage_load(composed, variant, cluster), variant, tables)
            else:  # the uniform layout's cut, as try_layout made it
                cut = _layout_cut(tables, result.choice, variant)
            if cut is False:
                continue
            variant = replace(variant, partition=cut)
        solves = [_layout_stats(result, reused=True)]  # solved for the uniform setting
        if pinned:
            mixed = with_modes(variant, pinned)
            prediction = assemble(tables, composed, mixed)
        else:
            # Keeping every activation is the fastest mix (recomputation only adds work):
            # when it fits it is the answer, and when even it loses to the best plan so far
            # no mix can win; only in between is the per-layer knapsack solved.
            if not keep_all or len(by_mode) < 2:
                continue  # no repeated layers to mix
            kept = assemble(tables, composed, with_modes(variant, keep_all))
            if kept.peak_memory_bytes <= tables.capacity:
                found = (keep_all, kept)
            elif best is not None and kept.step_time_s * (
                    1 + ground_margin(variant, cluster, options)) > best[0]:
                continue
            else:
                found = choose_layer_modes(tables, by_mode, variant)
            if found is None:
                continue
            mixed, prediction = with_modes(variant, found[0]), found[1]
            solves += found[2:]
        cand = Candidate(mixed, f"{result.status}(recompute per layer)", prediction=prediction,
                         choice=result.choice, solves=tuple(solves))
        if prediction.peak_memory_bytes > tables.capacity:
            cand.status = "REJECTED(evaluated memory above capacity)"
            candidates.append(cand)
            continue
        candidates.append(cand)
        step = prediction.step_time_s
        fastest = step if fastest is None else min(fastest, step)
        key = (step * (1 + ground_margin(mixed, cluster, options)), pp, setting.tp,
               setting.zero, setting.cp)
        if best is None or key < best[:5]:
            best = (*key, cand, problem, tables, batch)
    return fastest, best


def least_idle(variants, pp: int, m: int) -> float:
    """The least bubble fraction of ``variants``: exact for GPipe, 1F1B and interleaved,
    0 for the zero-bubble schedules (theirs depends on the stage times)."""
    if pp == 1:
        return 0.0
    return min((bubble_fraction(s, pp, m, v) if schedule_name(s) in ("gpipe", "1f1b", "interleaved")
                else 0.0) for s, v in variants)


def _work(units: UnitCosts) -> float:
    """One microbatch's compute and tensor-parallel time, all stages together."""
    return sum(units.fwd) + sum(units.bwd) + sum(units.tp_comm)


def _beaten(best, work: float, variant: Setting, cluster: Cluster,
            options: PlanOptions, dp_floor: float = 0.0) -> bool:
    """Whether ``variant`` cannot beat the best plan so far whatever its stage cut: its step
    is at least every microbatch's ``work`` (:func:`_work`) spread evenly over the stages
    plus the schedule's bubble (exact for GPipe, 1F1B and interleaved, which idle
    (pp-1)/(v·m) of the work; 0 for the zero-bubble schedules), plus ``dp_floor``
    (:func:`_dp_floor`)."""
    if best is None:
        return False
    pp, m = variant.pp, variant.microbatches
    idle = least_idle([(variant.schedule, variant.virtual)], pp, m)
    floor = m * work / pp * (1 + idle) + dp_floor
    return floor * (1 + ground_margin(variant, cluster, options)) > best[0]


def _dp_floor(tables: CostTables, units: UnitCosts, setting: Setting) -> float:
    """The least data-parallel time a step of ``setting`` adds, whatever its stage cut:
    FSDP's collectives are priced unit by unit (:func:`data_parallel_costs`), so the ranks'
    communication sums to that of all units, and even when all of it hides behind compute
    it slows that compute by ``OVERLAP_SLOWDOWN`` of its time (all of it on gloo, which
    does not overlap). The slowest rank adds at least the mean of that over the ranks.
    DDP's buckets (ZeRO-0) depend on the cut; they get no floor."""
    if setting.zero == 0 or setting.grad_group <= 1:
        return 0.0
    comm = data_parallel_costs(tables, setting, units, list(range(units.n_units)), 0.0,
                               comm_only=True)[0]
    share = 1.0 if tables.cluster.backend == "gloo" else OVERLAP_SLOWDOWN
    return share * comm / setting.pp


def ground_margin(setting: Setting, cluster: Cluster, options: PlanOptions) -> float:
    """The handicap of ``setting`` for being beyond validated ground (see
    :mod:`autopar.cost_models.ground`)."""
    return _margin(tuple(setting.plan_mesh.items()), setting.zero,
                   setting.schedule if setting.pp > 1 else None, cluster.backend,
                   cluster.devices_per_node, options.extrapolation_margin, setting.cp_algorithm)


@functools.lru_cache(maxsize=4096)
def _margin(mesh: tuple, zero: int, schedule: str | None, backend: str,
            devices_per_node: int, margin: float | None, cp_algorithm: str) -> float:
    """:func:`ground_margin` of one (mesh, ZeRO, schedule, cp algorithm): the search asks for
    the same ones thousands of times."""
    ground = load_ground()
    labels = ground.labels(dict(mesh), zero=zero, schedule=schedule, backend=backend,
                           devices_per_node=devices_per_node, cp_algorithm=cp_algorithm)
    return ground.margin(labels, margin)


def lower_bounds(tables: CostTables, state_scale: float = 1.0,
                 activation_scale: float = 1.0) -> tuple[float, float]:
    """Memory and step-time floors of a setting (scaled as the CP-SAT model is): each
    decision at its cheapest, each kept value in its smallest placement, no communication,
    and the memory at the larger of the step's peaks that a floor can price (with one
    microbatch, kept gradients are not alive with the activations). A setting whose memory
    floor is over capacity needs no solve (checked: benchmarks/search_audit.py)."""
    problem, setting = tables.problem, tables.setting
    # Activations and compute depend on the microbatch, recomputation and the context
    # split only (states are on parameters, activations on ops): computed once per tuple.
    # (and the ZeRO stage and dp group: casts and gathers priced as compute depend on them)
    key = ("floors", setting.microbatch, setting.recompute, tables.options.precision,
           setting.cp, setting.cp_algorithm, setting.cp_layout, *tables.states_key)
    if key not in problem.cache:
        activations = compute = 0.0
        for d in problem.decisions:
            if d.kind != "param":
                activations += min(tables.activation_memory(d, s) for s in d.candidates)
                compute += min(sum(tables.compute(d, s)) for s in d.candidates)
        for value, info in problem.values.items():
            for kept, as_saved in ((tables.keeps, lambda q: q),
                                   (tables.keeps_fp8_copy, fp8_copy)):
                placements = {as_saved(s.inputs[use.slot])
                              for use in info.uses if use.consumer >= 0 and kept(use, value)
                              for s in problem.decisions[use.consumer].candidates}
                if placements:
                    activations += (min(tables.saved_bytes(value, q) for q in placements)
                                    * tables.value_count(value))
        problem.cache[key] = (activations, compute)
    activations, compute = problem.cache[key]
    key = ("state floors", *tables.states_key)  # not the microbatch's or the pipeline's
    if key not in problem.cache:
        params = [d for d in problem.decisions if d.kind == "param"]
        problem.cache[key] = (
            sum(min(tables.states(d, s).total for s in d.candidates) * d.count for d in params),
            sum(min(tables.states(d, s).total - tables.states(d, s).grads for s in d.candidates)
                * d.count for d in params))
    states, without_grads = problem.cache[key]
    kept = activations * activation_scale
    if grads_outlive_backward(setting):
        memory = states * state_scale + kept
    else:  # forward and backward hold no kept gradients; the optimizer step no activations
        memory = max(without_grads * state_scale + kept, states * state_scale)
    return memory, compute * setting.microbatches
