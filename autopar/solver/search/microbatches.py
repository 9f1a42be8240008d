"""The microbatch search of one setting: sizes from the largest down, each priced or pruned.

For one (mesh, ZeRO stage, recomputation, expert degree) setting it walks the microbatch
sizes, skips those that cannot run (:func:`_microbatch_skip`), prunes those whose memory or
time lower bound rules them out (:func:`_pruned`), and prices the rest with a reused or
solved layout (:func:`autopar.solver.search.layout_solves.price_layout`), halving while
the step gets faster.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.analysis.batch_coupling import coupling_refusal
from autopar.core import progress
from autopar.core.errors import AutoparError
from autopar.core.knobs import RUNNABLE_SCHEDULES
from autopar.core.plan_summary import setting_text
from autopar.core.units import format_seconds
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.search.candidate import Candidate
from autopar.solver.search.layout_solves import (
    ProblemFor,
    layout_scales,
    layout_tables,
    price_layout,
)
from autopar.solver.search.layout_trials import least_idle, lower_bounds, mixing
from autopar.solver.search.search_state import SearchState
from autopar.solver.setting import Setting

TIME_PRUNED = "PRUNED(time lower bound)"
"""A size whose compute floor (with its pipeline's least bubble) is no faster than the best
plan so far."""


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search, carrying the best (step, ..., batch) tuple found so far."""

    def __init__(self, best: tuple | None):
        super().__init__()
        self.best = best


def check_microbatch(traced: int, microbatch: int | None) -> None:
    """A graph traced on one sequence is priced per sequence: refuse a larger microbatch."""
    if traced <= 1 and microbatch and microbatch > 1:
        raise AutoparError(
            f"microbatch {microbatch} on a graph traced with one sequence: the batch "
            "dimension cannot be told from its other dimensions, so only microbatches of one "
            "are priced", where="microbatch",
            fix="trace with example inputs of two or more sequences (the planner scales them "
            "to any microbatch), or plan with microbatch=1")


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _microbatch_sizes(options: PlanOptions, local: int, traced: int) -> list[int]:
    """Microbatch sizes to solve, largest first. A graph traced on one sequence has no batch
    dimension the cost model can scale (``batch_strategies``): its costs are those of one
    sequence, so only microbatches of one are priced truly (a larger one would cost the same
    as one and look free)."""
    if traced <= 1:
        return [1] if options.microbatch in (None, 1) and (
            not options.microbatches or options.microbatches == local) else []
    if options.microbatch:
        return [options.microbatch]
    if options.microbatches:
        return [local // options.microbatches] if local % options.microbatches == 0 else []
    return _divisors_desc(local)


def pipeline_variants(options: PlanOptions, pp: int, m: int, n_layers: int
                      ) -> list[tuple[str, int]]:
    """(schedule, chunks per rank) to try for ``pp`` stages and ``m`` microbatches."""
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for schedule in [options.schedule] if options.schedule else list(RUNNABLE_SCHEDULES):
        if m < pp and schedule != "gpipe":
            continue  # only GPipe runs fewer microbatches than stages (each in turn)
        if schedule == "interleaved":
            # torch's interleaved schedule runs microbatches in rounds of pp
            vs = [options.virtual_stages] if options.virtual_stages else range(2, 9)
            out += [(schedule, v) for v in vs
                    if v > 1 and n_layers >= pp * v and m % pp == 0]
        elif schedule == "zb_v":
            if n_layers >= 2 * pp:
                out.append((schedule, 2))
        elif options.virtual_stages in (None, 1):
            out.append((schedule, 1))
    return out


def search_microbatches(state: SearchState, problem_for: ProblemFor, local: int,
                        base: Setting, upcoming: list[Setting],
                        best: tuple | None) -> tuple | None:
    """Solve microbatch sizes from the largest down for one (mesh, ZeRO, recompute); return
    the best (step, pp, tp, zero, cp, candidate, problem, tables, batch) so far. With pipeline
    stages, each solved layout is tried under every schedule, with its balanced cut.
    ``upcoming`` are the settings of this mesh searched after ``base`` (solved ahead)."""
    options, candidates = state.options, state.candidates
    sizes = _microbatch_sizes(options, local, state.traced)
    try:
        for mb in sizes:
            setting = replace(base, microbatch=mb, microbatches=local // mb)
            _say_solving(state, setting, best)
            skip, variants = _microbatch_skip(state, setting, local)
            if skip:
                candidates.append(Candidate(setting, skip))
                continue
            problem, batch = problem_for(mb)
            tables, costs = layout_tables(state, problem, setting)
            if tables is None:
                candidates.append(Candidate(setting, "SKIPPED(no cp attention algorithm fits: "
                                            + "; ".join(map(str, costs.values())) + ")"))
                continue
            setting = tables.setting
            pruned, smaller_too = _pruned(state, tables, variants, best)
            if pruned:
                candidates.append(Candidate(setting, pruned))
                if smaller_too:
                    break
                continue
            later = ([(base, sizes[sizes.index(mb) + 1:])] + [(b, sizes) for b in upcoming]
                     if state.ahead.enabled else [])
            best = price_layout(state, problem_for, local, later, tables, variants, batch,
                                best)[1]
            # No stop at the first size that is slower than the last: a smaller one may fit
            # a faster layout, or fill a pipeline better. Only the time floor ends the walk.
    except KeyboardInterrupt:  # Ctrl-C: the search keeps the best plan found so far
        raise SearchInterrupted(best) from None
    return best


def _microbatch_skip(state: SearchState, setting: Setting, local: int
                     ) -> tuple[str | None, list[tuple[str, int]]]:
    """Why ``setting``'s microbatch size is not priced (its SKIPPED status), or None with
    the pipeline (schedule, chunks) variants the constraints allow it under."""
    options, couplings = state.options, state.couplings
    mb, pp = setting.microbatch, setting.pp
    if local % mb:
        return f"SKIPPED(microbatch {mb} does not divide {local})", []
    m = local // mb
    coupled = coupling_refusal(list(couplings), setting.dp, m)
    if coupled:
        return f"SKIPPED({coupled})", []
    # Fewer microbatches than stages only where the batch is coupled (the exact
    # statistic needs one microbatch per rank) or GPipe is pinned: otherwise a pipeline
    # that idles is never worth pricing.
    if pp > 1 and m < pp and not couplings and options.schedule != "gpipe":
        return f"SKIPPED({m} microbatches cannot fill {pp} stages)", []
    variants = pipeline_variants(options, pp, m, state.n_layers)
    if not variants:
        return "SKIPPED(no pipeline schedule fits)", []
    if options.constraints:
        views = [replace(setting, schedule=s, virtual=v).view for s, v in variants]
        allowed = [options.allows(view) for view in views]
        if not any(allowed):
            refused = [c for c in options.constraints
                       if not any(c.allows(view) for view in views)]
            return "SKIPPED(constraint " + ", ".join(
                map(str, refused or options.constraints)) + ")", []
        variants = [v for v, ok in zip(variants, allowed) if ok]
    return None, variants


def _pruned(state: SearchState, tables: CostTables, variants: list[tuple[str, int]],
            best: tuple | None) -> tuple[str | None, bool]:
    """Why ``tables``' setting cannot fit or cannot beat ``best`` by its lower bounds (its
    PRUNED status, or None), and whether no smaller microbatch of the setting can beat it
    either: the compute floor (more, smaller microbatches never do less work) is itself
    no faster, bubble aside (more microbatches idle less)."""
    options, setting = state.options, tables.setting
    pp, m = setting.pp, setting.microbatches
    scales = layout_scales(setting)
    memory_floor, time_floor = lower_bounds(tables, *scales)
    if memory_floor > tables.capacity:
        return "PRUNED(memory lower bound)", False
    if best is not None and mixing(options, setting) and options.recompute_layers is None:
        # a mix recomputes only some layers: its floor is the one that keeps everything
        keep_all = replace(setting, recompute="none")
        time_floor = lower_bounds(CostTables(tables.problem, state.cluster, options, keep_all,
                                             state.traced, state.facts.seq_len), *scales)[1]
    if best is not None and time_floor / pp * (1 + least_idle(variants, pp, m)) >= best[0]:
        return TIME_PRUNED, time_floor / pp >= best[0]
    return None, False


def _say_solving(state: SearchState, setting: Setting, best: tuple | None) -> None:
    """Tell the progress display which setting is being solved, and the best plan so far."""
    progress.current().update(f"{state.cluster.world_size} devices: solving "
                              f"{setting_text(Candidate(setting, '').summary())}",
                              _best_text(best))


def _best_text(best: tuple | None) -> str | None:
    if best is None or best[5].prediction is None:
        return None
    cand = best[5]
    return (f"{format_seconds(cand.prediction.step_time_s)} per step (modelled), "
            f"{setting_text(cand.summary())}")
