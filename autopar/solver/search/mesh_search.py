"""The outer search: mesh shapes x ZeRO stage x microbatch size, each solved by CP-SAT.

For every factorization ``world = dp x tp`` with ``tp`` inside a node, every allowed ZeRO
stage and microbatch sizes from the largest down, it builds the cost tables, skips settings
whose memory lower bound already exceeds the device or whose time lower bound cannot beat
the best plan so far, and solves the rest. The fastest feasible setting wins; ties go to the
smaller ``tp`` and ZeRO stage, so the result is deterministic.
"""

from __future__ import annotations

import functools
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.fx as fx

from autopar.analysis.batch_axis import batch_strategies
from autopar.analysis.batch_coupling import (
    Coupling,
    batch_couplings,
    coupling_refusal,
    splitting,
)
from autopar.core import progress
from autopar.core.cluster import Cluster
from autopar.core.constraints import memory_cap
from autopar.core.errors import AutoparError, NoFeasiblePlanError
from autopar.core.graph_facts import META_KEY, graph_facts
from autopar.core.knobs import CP_ALGORITHMS, LEANNESS, RECOMPUTE_MODES, RUNNABLE_SCHEDULES
from autopar.core.units import format_bytes
from autopar.cost_models.memory import MemoryBreakdown
from autopar.solver.axes.context import (
    CP_LONG_CONTEXT,
    CP_SEARCH_MIN_TOKENS,
    algorithm_costs,
    cp_refusal,
    held_to_ground,
)
from autopar.solver.axes.expert_axis import check_ep, ep_degrees, ep_refusal
from autopar.solver.axes.hsdp import check_dp_replicate, replicate_degrees
from autopar.solver.model.cpsat import SolveResult
from autopar.solver.model.cpsat import build as build_layout
from autopar.solver.model.problem import (
    Problem,
    Skeleton,
    build_problem,
    forbid_splitting_batch,
    problem_skeleton,
)
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.evaluate import (
    evaluate,
)
from autopar.solver.pricing.fusion import Fusion
from autopar.solver.search.candidate import Candidate, setting_text
from autopar.solver.search.layout_trials import (
    ground_margin,
    least_idle,
    lower_bounds,
    mixing,
    try_layout,
    try_mixed,
)
from autopar.solver.search.pin_conflicts import Conflict, conflict, pinned
from autopar.solver.search.solve_ahead import SolveAhead
from autopar.solver.setting import Setting


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search, carrying the best (step, ..., batch) tuple found so far."""

    def __init__(self, best: tuple | None):
        super().__init__()
        self.best = best


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


@dataclass
class SolveBudget:
    """CP-SAT solves the search may still run (``PlanOptions.max_solves``). A count, not
    seconds: the same inputs give the same plan on any machine. Once spent, a setting is
    priced only with a layout solved before (``reached`` then tells the plan to say so)."""

    limit: int | None
    used: int = 0
    refused: int = 0  # settings left unsolved for want of budget

    def allows(self) -> bool:
        if self.limit is not None and self.used >= self.limit:
            self.refused += 1
            return False
        self.used += 1
        return True

    @property
    def reached(self) -> bool:
        return self.refused > 0


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
    return sorted(shapes)


def _mesh_allowed(options: PlanOptions, pp: int, dp: int, cp: int, tp: int) -> bool:
    """Whether the mesh constraints (degrees and device budgets, which see nothing else)
    allow a mesh; the others are checked on each whole setting."""
    from autopar.core.constraints import Degree, DeviceBudget, SettingView

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


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


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
    if not shapes and (options.pp or 1) > n_layers:
        raise NoFeasiblePlanError(
            f"pp={options.pp}: {stage_refusal(gm, n_layers)}", where="pp",
            fix="plan with pp=1 (tensor or data parallelism split such a model), or build its "
            "layers as an nn.ModuleList of alike blocks")
    if not shapes:
        cp = f"cp={options.cp}, " if options.cp else ""
        product = "pp x dp x cp x tp" if options.cp else "pp x dp x tp"
        raise NoFeasiblePlanError(
            f"no mesh matches pp={options.pp}, dp={options.dp}, {cp}tp={options.tp} on "
            f"{cluster.world_size} devices ({cluster.nodes} node(s) x "
            f"{cluster.devices_per_node}) for a model of {n_layers} layers",
            where="pp/dp/cp/tp" if options.cp else "pp/dp/tp",
            fix=f"{product} must equal the number of devices, tp must divide the devices "
            "per node, and pp must not exceed the layers",
        )
    candidates: list[Candidate] = []
    best: tuple | None = None  # (step, pp, tp, zero, cp, candidate, problem, tables, batch)
    problems: dict[tuple[int, bool], tuple] = {}
    layouts: dict[tuple, SolveResult] = {}  # see _search_microbatches
    budget = SolveBudget(options.max_solves)
    ahead = SolveAhead()  # layout solves ahead on a second core (solve_ahead)
    fusion = Fusion.of(gm) if options.fuse_attention else Fusion()
    batch = batch_strategies(gm, traced)
    found = batch_couplings(gm, batch)
    couplings = splitting(found) if options.batch_coupling == "exact" else []
    skeleton: list[Skeleton] = []  # built with the first problem, shared by the others
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
            if global_batch % dp:
                candidates.append(Candidate(Setting(dp, tp, 0, 0, 0, pp=pp, cp=cp),
                                            f"SKIPPED(global batch {global_batch} not divisible by dp={dp})"))
                continue
            if cp not in refusals:  # the same for every mesh with this cp
                refusals[cp] = cp_refusal(gm, cp, options.cp_layout, facts.seq_len,
                                          options.fuse_attention)
            coupled = coupling_refusal(couplings, dp, 1)
            if coupled:
                candidates.append(Candidate(Setting(dp, tp, 0, 0, 0, pp=pp, cp=cp),
                                            f"SKIPPED({coupled})"))
                continue
            refusal = refusals[cp]
            if refusal:
                candidates.append(Candidate(Setting(dp, tp, 0, 0, 0, pp=pp, cp=cp),
                                            f"SKIPPED(cp={cp}: {refusal})"))
                continue
            local = global_batch // dp

            def problem_for(microbatch: int, tp: int = tp) -> tuple[Problem, dict]:
                """The tp decisions for one microbatch size: splitting the batch over tp needs
                a microbatch that tp divides (problems are shared by the sizes that allow it)."""
                splits_batch = options.tp_splits_batch and microbatch % tp == 0
                key = (tp, splits_batch)  # shared by every dp and pp
                if key not in problems:
                    if not skeleton:
                        skeleton.append(problem_skeleton(gm))
                    problem = fusion.apply(build_problem(gm, tp, batch, skeleton[0]))
                    if not splits_batch and tp > 1:
                        forbid_splitting_batch(problem, traced)
                    if adjust is not None:
                        adjust(problem)
                    problems[key] = (problem, batch)
                return problems[key]

            problem = problem_for(local)[0]
            bases = list(_mesh_bases(gm, options, cluster, problem, facts, n_layers,
                                     (pp, dp, cp, tp), candidates))
            for i, base in enumerate(bases):
                best = _search_microbatches(
                    problem_for, cluster, options, candidates, best, facts, traced,
                    local, base, n_layers, layouts, couplings, budget, ahead, bases[i + 1:],
                )
    except KeyboardInterrupt as stop:
        best = getattr(stop, "best", None) or best
        if best is None:
            raise KeyboardInterrupt from None
        interrupted = True
    finally:
        ahead.close()
    if best is None:
        error = no_plan_error(gm, cluster, options, candidates)
        error.tried = bool(candidates)  # (an offloading retry that tried nothing says so)
        raise error
    return SearchResult(best[5], best[6], best[7], best[8], candidates,
                        time.perf_counter() - started, tuple(found), budget, interrupted)


def _mesh_bases(gm: fx.GraphModule, options: PlanOptions, cluster: Cluster, problem: Problem,
                facts, n_layers: int, mesh: tuple[int, int, int, int], candidates: list):
    """The settings one mesh is searched under, in order (ZeRO stage, recomputation, expert
    degree, HSDP replicas), without microbatching; what cannot run is added to
    ``candidates`` as skipped."""
    pp, dp, cp, tp = mesh
    # stages 0 and 3 first: ZeRO-1/2 may then reuse their layouts (_reusable)
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
                # HSDP after full sharding: it reuses that layout (_reusable)
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


def check_cp(gm: fx.GraphModule, options: PlanOptions, seq_len: int | None) -> None:
    """A pinned ``cp`` the model cannot run is refused before any search, naming why."""
    why = cp_refusal(gm, options.cp or 1, options.cp_layout, seq_len, options.fuse_attention)
    if why:
        raise AutoparError(
            f"cp={options.cp}: {why}", where="cp",
            fix="pick a cp whose chunks divide the sequence (cp_layout='contiguous' needs cp "
            "chunks, 'zigzag' 2·cp), use the fused-attention form of the model, or cp=1")


def _cp_algorithms(options: PlanOptions) -> tuple[str, ...]:
    return (options.cp_algorithm,) if options.cp_algorithm else CP_ALGORITHMS


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


def check_microbatch(traced: int, microbatch: int | None) -> None:
    """A graph traced on one sequence is priced per sequence: refuse a larger microbatch."""
    if traced <= 1 and microbatch and microbatch > 1:
        raise AutoparError(
            f"microbatch {microbatch} on a graph traced with one sequence: the batch "
            "dimension cannot be told from its other dimensions, so only microbatches of one "
            "are priced", where="microbatch",
            fix="trace with example inputs of two or more sequences (the planner scales them "
            "to any microbatch), or plan with microbatch=1")


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


def _search_microbatches(problem_for, cluster, options, candidates, best, facts, traced, local,
                         base: Setting, n_layers, layouts: dict, couplings,
                         budget: SolveBudget | None, ahead: SolveAhead,
                         upcoming: list[Setting]):
    """Solve microbatch sizes from the largest down for one (mesh, ZeRO, recompute); return
    the best (step, pp, tp, zero, cp, candidate, problem, tables, batch) so far. With pipeline
    stages, each solved layout is tried under every schedule, with its balanced cut."""
    previous = None  # step time at the next larger microbatch that fitted
    pp = base.pp
    sizes = _microbatch_sizes(options, local, traced)
    try:
        for mb in sizes:
            setting = replace(base, microbatch=mb, microbatches=local // mb)
            progress.current().update(f"{cluster.world_size} devices: solving "
                                      f"{setting_text(Candidate(setting, '').summary())}",
                                      _best_text(best))
            if local % mb:
                candidates.append(Candidate(setting, f"SKIPPED(microbatch {mb} does not divide {local})"))
                continue
            m = local // mb
            if base.zero == 1 and m == 1 and 2 in options.zero:
                # one microbatch: stage 1 moves what stage 2 moves and keeps whole gradients
                candidates.append(Candidate(setting, "SKIPPED(ZeRO-1 with one microbatch: "
                                                     "ZeRO-2's communication, more memory)"))
                continue
            coupled = coupling_refusal(list(couplings), base.dp, m)
            if coupled:
                candidates.append(Candidate(setting, f"SKIPPED({coupled})"))
                continue
            # Fewer microbatches than stages only where the batch is coupled (the exact
            # statistic needs one microbatch per rank) or GPipe is pinned: otherwise a pipeline
            # that idles is never worth pricing.
            if pp > 1 and m < pp and not couplings and options.schedule != "gpipe":
                candidates.append(Candidate(setting, f"SKIPPED({m} microbatches cannot fill {pp} stages)"))
                continue
            variants = pipeline_variants(options, pp, m, n_layers)
            if not variants:
                candidates.append(Candidate(setting, "SKIPPED(no pipeline schedule fits)"))
                continue
            if options.constraints:
                views = [replace(setting, schedule=s, virtual=v).view for s, v in variants]
                allowed = [options.allows(view) for view in views]
                if not any(allowed):
                    refused = [c for c in options.constraints
                               if not any(c.allows(view) for view in views)]
                    candidates.append(Candidate(setting, "SKIPPED(constraint " + ", ".join(
                        map(str, refused or options.constraints)) + ")"))
                    continue
                variants = [v for v, ok in zip(variants, allowed) if ok]
            problem, batch = problem_for(mb)
            tables, costs = _layout_tables(problem, cluster, options, setting, traced, facts)
            if tables is None:
                candidates.append(Candidate(setting, "SKIPPED(no cp attention algorithm fits: "
                                            + "; ".join(map(str, costs.values())) + ")"))
                continue
            setting = tables.setting
            flight = min(m, pp)  # 1F1B's first stage
            memory_floor, time_floor = lower_bounds(tables, 1 / pp, flight / pp)
            if memory_floor > tables.capacity:
                candidates.append(Candidate(setting, "PRUNED(memory lower bound)"))
                continue
            if best is not None and mixing(options, setting) and options.recompute_layers is None:
                # a mix recomputes only some layers: its floor is the one that keeps everything
                keep_all = replace(setting, recompute="none")
                time_floor = lower_bounds(CostTables(problem, cluster, options, keep_all, traced,
                                                     facts.seq_len), 1 / pp, flight / pp)[1]
            if best is not None and time_floor / pp * (1 + least_idle(variants, pp, m)) >= best[0]:
                candidates.append(Candidate(setting, "PRUNED(time lower bound)"))
                break
            # The tp layout solved for the same problem, recomputation, microbatch and ZeRO
            # stage on another (pp, dp) mesh is tried first: it rarely changes with them (they
            # scale memory and data-parallel traffic), and evaluating it is far cheaper than a
            # solve. Only when it does not fit is the layout solved for this mesh.
            reuse_key = _reuse_key(problem, setting)
            uniform = options.recompute_layers is None or len(set(options.recompute_layers)) == 1
            fastest = None
            if uniform:
                # and the layouts solved for the other ZeRO stages (_reusable)
                for key in _reusable(reuse_key, setting.zero):
                    fastest, best = try_layout(layouts.get(key), tables, setting, variants,
                                                cluster, candidates, best, problem, batch,
                                                reused=True)
                    if fastest is not None:
                        break
            if fastest is None and (uniform or reuse_key not in layouts):
                if budget is not None and not budget.allows():
                    candidates.append(Candidate(setting, f"SKIPPED(solve budget of {budget.limit} "
                                                "CP-SAT solves spent; no solved layout fits)"))
                    continue
                if ahead.enabled:  # the solves likely next, on the other core
                    later = [(base, sizes[sizes.index(mb) + 1:])] + [(b, sizes) for b in upcoming]
                    _solve_next(ahead, problem_for, cluster, options, traced, facts, local,
                                later, layouts)
                scales = (1 / pp, flight / pp)
                key = _solve_key(tables, *scales)
                build = functools.partial(build_layout, tables, options.time_limit_s,
                                          state_scale=scales[0], activation_scale=scales[1])
                result = ahead.solve(key, build)
                if result.choice is None:
                    candidates.append(Candidate(setting, result.status, wall_s=result.wall_s,
                                                solves=(result.stats(),)))
                    continue
                layouts[reuse_key] = result
                if uniform:
                    fastest, best = try_layout(result, tables, setting, variants, cluster,
                                                candidates, best, problem, batch)
            if mixing(options, setting):
                step, best = try_mixed(layouts.get(reuse_key), tables, setting, variants, cluster,
                                        candidates, best, problem, batch)
                if step is not None:
                    fastest = step if fastest is None else min(fastest, step)
            if fastest is None or fastest == math.inf:
                continue  # nothing fits, or nothing here can beat the best plan so far
            # Larger microbatches amortize per-microbatch costs, but near the memory limit they
            # force leaner, slower strategies (and with pipelines fewer microbatches mean more
            # bubble): keep halving while it helps.
            if previous is not None and fastest >= previous:
                break
            previous = fastest
    except KeyboardInterrupt:  # Ctrl-C: the search keeps the best plan found so far
        raise SearchInterrupted(best) from None
    return best


def _layout_tables(problem: Problem, cluster: Cluster, options: PlanOptions, setting: Setting,
                   traced: int, facts) -> tuple[CostTables | None, dict]:
    """``setting``'s cost tables, its context-parallel attention algorithm chosen when
    "auto" (the cheapest, held to validated ground: :func:`held_to_ground`); (None, the
    algorithms' costs) when none fits."""
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


def _solve_key(tables: CostTables, state_scale: float, activation_scale: float) -> tuple:
    """What a layout solve is a function of (:mod:`autopar.solver.search.solve_ahead`)."""
    return (id(tables.problem), tables.setting, state_scale, activation_scale)


def _reuse_key(problem: Problem, setting: Setting) -> tuple:
    """What a solved layout is kept under for reuse (see ``_search_microbatches``)."""
    return (id(problem), setting.recompute, setting.microbatch, setting.zero,
            setting.grad_group > 1, setting.cp, setting.cp_algorithm)


def _reusable(key: tuple, zero: int) -> list[tuple]:
    """Layout keys worth trying before a solve: this setting's, then the same one's under
    the other ZeRO stages solved (``key[3]`` is the stage): ZeRO-0's and ZeRO-3's for stages
    1 and 2, each other's for 0 and 3. The stage scales memory and data-parallel traffic,
    not which op is split how; a reused layout that does not fit is solved anew (measured:
    the same plans for the five ``benchmarks/plan_time.py`` rows, 70B on 1,024 H100s in
    16.5 s instead of 21.2 s)."""
    keys = [key]
    others = {0: (3,), 1: (0, 3), 2: (0, 3), 3: (0,)}.get(zero, ())
    keys += [(*key[:3], other, *key[4:]) for other in others]
    return keys


SOLVES_AHEAD = 2
"""Layout solves queued on the worker at a time (:mod:`autopar.solver.search.solve_ahead`)."""


def _solve_next(ahead: SolveAhead, problem_for, cluster: Cluster, options: PlanOptions,
                traced: int, facts, local: int, later: list[tuple[Setting, list[int]]],
                layouts: dict) -> None:
    """Start the layout solves ``_search_microbatches`` will likely ask for next, so that
    they run beside the current one: the next smaller microbatch of this setting, then
    each later setting's first, each the first size whose memory floor fits and whose
    layout no solve before can stand in for (``_reusable``)."""
    queued = 0
    for base, sizes in later:
        for mb in sizes:
            if local % mb:
                continue
            setting = replace(base, microbatch=mb, microbatches=local // mb)
            problem = problem_for(mb)[0]
            tables = _layout_tables(problem, cluster, options, setting, traced, facts)[0]
            if tables is None:
                break
            flight = min(setting.microbatches, base.pp)
            scales = (1 / base.pp, flight / base.pp)
            if lower_bounds(tables, *scales)[0] > tables.capacity:
                continue  # pruned there; the next size may fit
            if any(k in layouts for k in _reusable(_reuse_key(problem, tables.setting),
                                                   setting.zero)):
                break  # likely priced with that layout, unsolved
            key = _solve_key(tables, *scales)
            if ahead.wants(key):
                ahead.submit(key, build_layout(tables, options.time_limit_s,
                                               state_scale=scales[0],
                                               activation_scale=scales[1]))
            queued += 1
            break
        if queued >= SOLVES_AHEAD:
            return


def _best_text(best: tuple | None) -> str | None:
    if best is None or best[5].prediction is None:
        return None
    cand = best[5]
    return (f"{cand.prediction.step_time_s * 1e3:.4g} ms per step (modelled), "
            f"{setting_text(cand.summary())}")


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
        return NoFeasiblePlanError(
            f"no plan satisfies the pins on {cluster.name}: " + "; ".join(
                f"{c.reason} (mesh {', '.join(meshes)})" for c, meshes in by_reason.items()),
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
    from autopar.strategies import has_rule

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
            problems[tp] = fusion.apply(build_problem(gm, tp, batch, skeleton))
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
