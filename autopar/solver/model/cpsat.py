"""The CP-SAT model: one strategy per decision, minimizing predicted step time under memory.

Variables: ``x[d, s]`` (decision ``d`` takes strategy ``s``). For each value, ``need[q]``
says some consumer needs placement ``q`` of it, and ``move[p, q] >= has[p] + need[q] - 1``
pays the redistribution from the producer's placement ``p`` once per (value, placement) —
the runtime shares one redistributed copy among all consumers. This "marginal" form keeps
the model linear and small: an 80-layer model has the variables of one layer because the
layers share decisions. The objective is the exact :func:`evaluate` step time at the
optimum, in integer nanoseconds.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from autopar.core.constraints import Constraint, DecisionView, LayoutView
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Replicate
from autopar.cost_models.comm import busy_latency, group_collective_time
from autopar.cost_models.data_parallel import OVERLAP_SLOWDOWN
from autopar.cost_models.memory import ddp_buffer_bytes
from autopar.solver.pricing.costs import CostTables, fp8_copy

NS = 1e-7
"""Time unit of the objective: 100 ns. With 1 ns units a 70B step's objective is ~5e9 and
its terms span nine orders of magnitude; CP-SAT then once declared a layout optimal that
another solve beat by 5.6% (measured: one of the 44 solves of Llama-3-70B on 1,024 H100s,
with default presolve). A 1 ms CPU step is still 10,000 units. (Briefly reverted on
2026-11-27: the ties it moved on tiny models landed on tp=2 layouts that exposed runtime
bugs, since fixed; random layouts now train in the tests, :data:`LAYOUT_NOISE_SEED`.)"""
KIB = 1024.0  # memory unit of the constraint
LAYOUT_NOISE_SEED: int | None = None
"""For tests only: when set, each candidate strategy costs a random extra up to
:data:`LAYOUT_NOISE_S` (drawn from this seed), so the solver lands on a random layout among
those the constraints allow. Any cost change can move the solver to such a layout, so each
must train like one device (tests/test_hf_matrix.py, layout ``tp2_random``)."""
LAYOUT_NOISE_S = 1e-3
R = Replicate()


@dataclass(frozen=True)
class SolveResult:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    choice: list[int] | None
    objective_s: float | None
    wall_s: float
    bound_s: float | None = None  # CP-SAT's best bound: no choice can be faster
    time_limit_s: float | None = None

    def stats(self) -> dict:
        """What the plan says about this solve (:func:`solve_stats`)."""
        return solve_stats("layout", self.status, self.objective_s, self.bound_s, self.wall_s,
                           self.time_limit_s, unit="s (modelled)")


def solve_stats(what: str, status: str, objective: float | None, bound: float | None,
                wall_s: float, time_limit_s: float | None, unit: str) -> dict:
    """One CP-SAT solve as the plan reports it: its objective, best bound and relative gap
    ``(objective - bound) / objective``, and whether the choice was proved optimal within
    the model or the solve stopped at its time limit (then the gap says how far from
    optimal it may be, at most)."""
    gap = None
    if objective is not None and bound is not None:
        gap = max(objective - bound, 0.0) / objective if objective > 0 else 0.0
    if status == "OPTIMAL":
        outcome = "proved optimal within the model"
    elif status == "FEASIBLE":
        outcome = (f"stopped at the time limit ({time_limit_s:g} s) with a gap of "
                   f"{100 * (gap or 0.0):.2f}%" if time_limit_s else "stopped before proving "
                   "optimality")
    elif status == "INFEASIBLE":
        outcome = "proved infeasible"
    else:
        outcome = "stopped at the time limit with no solution"
    return {"what": what, "status": status, "objective": objective, "bound": bound,
            "unit": unit, "gap": gap, "wall_s": round(wall_s, 4),
            "time_limit_s": time_limit_s, "outcome": outcome}


def _t(seconds: float) -> int:
    return int(round(seconds / NS))


def _kib(nbytes: float) -> int:
    return int(-(-nbytes // KIB))  # round up: never under-count memory


@dataclass(frozen=True)
class _Skeleton:
    """What a layout model is made of, without its costs: the variables (by proto index)
    and the constraints that tie them. It depends on the problem, the recomputation (which
    values are kept) and the expert degree (which values stay inside an expert region),
    not on dp, pp, ZeRO or the microbatch, which the search varies most: each
    :func:`build` copies it (in C++) and adds the setting's objective and memory."""

    model: cp_model.CpModel
    x: tuple[tuple[int, ...], ...]  # x[d][i]: decision d takes its i-th strategy
    moves: tuple[tuple[tuple, object, object, int], ...]  # (value, p, q, var): redistribute
    backs: tuple[tuple[tuple, object, int], ...]  # (value, p, var): partial-grad all-reduce
    saved: tuple[tuple[tuple, object, int], ...]  # (value, q, var): kept for backward in q


def _skeleton(tables: CostTables) -> _Skeleton:
    """The layout model's skeleton for ``tables`` (built once per problem, recomputation
    and expert degree)."""
    key = ("cpsat skeleton", tables.setting.recompute, tables.setting.ep)
    cache = tables.problem.cache
    if key not in cache:
        cache[key] = _build_skeleton(tables)
    return cache[key]


def _build_skeleton(tables: CostTables) -> _Skeleton:
    problem = tables.problem
    model = cp_model.CpModel()
    x = []
    for d in problem.decisions:
        xs = [model.new_bool_var(f"x{d.index}_{i}") for i in range(len(d.candidates))]
        model.add_exactly_one(xs)
        x.append(xs)
    moves, backs, saved = [], [], []
    for key, info in problem.values.items():
        _value_vars(model, tables, x, key, info, moves, backs, saved)
    return _Skeleton(model, tuple(tuple(v.index for v in xs) for xs in x),
                     tuple((k, p, q, v.index) for k, p, q, v in moves),
                     tuple((k, p, v.index) for k, p, v in backs),
                     tuple((k, q, v.index) for k, q, v in saved))


def _value_vars(model, tables: CostTables, x, key, info, moves: list, backs: list,
                saved_out: list) -> None:
    """Redistribution, partial-gradient and saved-memory variables of one value.

    For each use (edge) ``y[p, q]`` is the joint indicator "the producer gives ``p`` and
    this consumer needs ``q``", pinned by its two marginals (each side takes exactly one
    strategy), which keeps the LP relaxation tight. ``q`` is refined to "R read by sharded
    computation" so the partial-gradient all-reduce has its own joint indicator. A
    redistribution is paid once per (value, p, q) however many consumers share the copy:
    ``move[p, q] >= y_e[p, q]`` for every edge ``e``. Their costs are the setting's
    (:func:`build`); a move that costs nothing there is simply free.
    """
    problem = tables.problem
    producer = problem.decisions[key[0]]
    has: dict = {}
    for i, s in enumerate(producer.candidates):
        has.setdefault(s.outputs[key[1]], []).append(x[key[0]][i])
    move: dict = {}  # (p, q) -> bool var, shared by all edges of this value
    back: dict = {}  # p -> bool var: the replicated copy's gradient must be all-reduced
    saved: dict = {}
    grad = tables.requires_grad(key)
    # the snake_case API: the CamelCase names wrap each call in a deprecation check, a
    # third of this function's time
    new_bool, add, total = model.new_bool_var, model.add, cp_model.LinearExpr.sum
    for use in info.uses:
        if use.consumer < 0:  # the loss a training step returns is whole
            need = {(R, False): [model.new_constant(1)]}
        else:
            need = {}
            keeps = tables.keeps(use, key)
            copy = tables.keeps_fp8_copy(use, key)
            xs = x[use.consumer]
            for i, s in enumerate(problem.decisions[use.consumer].candidates):
                q = s.inputs[use.slot]
                partial = grad and q == R and s.splits_work
                need.setdefault((q, partial), []).append(xs[i])
                if keeps or copy:
                    kept = q if keeps else fp8_copy(q)
                    sv = saved.get(kept)
                    if sv is None:
                        sv = saved[kept] = new_bool("")
                    add(sv >= xs[i])
        if len(has) == 1 and len(need) == 1:
            ((p, _),) = ((k, v) for k, v in has.items())
            ((q, partial),) = need.keys()
            joint = {(p, q, partial): model.new_constant(1)}
        else:
            joint = {(p, q, partial): new_bool("") for p in has for q, partial in need}
            for p, lits in has.items():
                add(total([joint[(p, q, f)] for q, f in need]) == total(lits))
            for (q, f), lits in need.items():
                add(total([joint[(p, q, f)] for p in has]) == total(lits))
        # an in-place write shares this storage, or the value stays inside one expert
        # region (see CostTables.inside_experts): no redistributed copy
        if use.tied or tables.inside_experts(key, use.consumer):
            for (p, q, _), y in joint.items():
                if p != q:
                    add(y == 0)
        for (p, q, partial), y in joint.items():
            if q != p:
                mv = move.get((p, q))
                if mv is None:
                    mv = move[(p, q)] = new_bool("")
                add(mv >= y)
            if partial:
                bk = back.get(p)
                if bk is None:
                    bk = back[p] = new_bool("")
                add(bk >= y)
    moves += [(key, p, q, var) for (p, q), var in move.items()]
    backs += [(key, p, var) for p, var in back.items()]
    saved_out += [(key, q, var) for q, var in saved.items()]


def restrict(model: cp_model.CpModel, tables: CostTables, x: list[list]) -> None:
    """Let each constraint with a layout hook add to the model (``Constraint.restrict``)."""
    hooked = [c for c in tables.options.constraints
              if type(c).restrict is not Constraint.restrict]
    if not hooked:
        return
    decisions = [DecisionView(
        name=d.name, nodes=tuple(n.name for n in d.nodes),
        module_paths=tuple(dict.fromkeys(n.meta[META_KEY].module_path for n in d.nodes)),
        layer=d.facts.layer, op=str(d.nodes[0].target),
        choices=tuple((str(s), lit) for s, lit in zip(d.candidates, lits)),
        replicated=tuple(s.is_replicated for s in d.candidates))
        for d, lits in zip(tables.problem.decisions, x)]
    view = LayoutView(model, tables.setting.view, decisions)
    for constraint in hooked:
        constraint.restrict(view)


@dataclass
class LayoutModel:
    """A built layout model, ready for :func:`run`. Running it touches no autopar object
    (only OR-Tools'), so it may run on another thread while this one goes on
    (:mod:`autopar.solver.search.solve_ahead`); ``stop`` ends a run early from any thread."""

    model: cp_model.CpModel
    x: list[list]
    time_limit_s: float
    build_s: float
    solver: cp_model.CpSolver | None = None

    def stop(self) -> None:
        if self.solver is not None:
            self.solver.StopSearch()


def solve(tables: CostTables, time_limit_s: float, hint: list[int] | None = None,
          **model_options) -> SolveResult:
    """:func:`build` the layout model (``model_options``: its keywords) and :func:`run` it."""
    return run(build(tables, time_limit_s, hint, **model_options))


def build(
    tables: CostTables,
    time_limit_s: float,
    hint: list[int] | None = None,
    *,
    enforce_memory: bool = True,
    state_scale: float = 1.0,
    activation_scale: float = 1.0,
) -> LayoutModel:
    """The model of the fastest choice of strategies under the device's memory.

    With pipeline stages one device holds part of the model: ``state_scale`` (about
    ``1/pp``) scales weights, gradients and optimizer states, ``activation_scale`` (the
    microbatches the first stage keeps in flight, over ``pp``) the saved activations. The
    exact per-stage memory is checked afterwards by :func:`evaluate`.
    """
    started = time.perf_counter()
    setting = tables.setting
    skeleton = _skeleton(tables)
    model = skeleton.model.clone()
    var = model.get_bool_var_from_proto_index
    m = setting.microbatches

    x = [[var(i) for i in row] for row in skeleton.x]
    terms = _strategy_terms(tables, x, state_scale, activation_scale)
    micro_vars, micro_coefs, saved_vars, saved_coefs = _value_terms(
        tables, skeleton, var, activation_scale)
    restrict(model, tables, x)

    weighted = cp_model.LinearExpr.weighted_sum
    fwd = weighted(terms.flat, terms.fwd)
    bwd = weighted(terms.flat, terms.bwd)
    per_micro = weighted(micro_vars, micro_coefs)
    memory_terms = [weighted(terms.flat + saved_vars, terms.mem + saved_coefs)]
    objective = m * (fwd + bwd + per_micro)
    buffers = 0
    if setting.grad_group > 1:
        exposed, buffers, peak_terms = _data_parallel_terms(model, tables, terms, fwd, bwd,
                                                            state_scale)
        memory_terms.extend(peak_terms)
        for term in exposed:
            objective = objective + term
    if LAYOUT_NOISE_SEED is not None:
        rng = random.Random(LAYOUT_NOISE_SEED)
        objective = objective + sum(rng.randrange(_t(LAYOUT_NOISE_S)) * lit
                                    for xs in x for lit in xs)
    if enforce_memory:
        model.Add(sum(memory_terms) + buffers <= int(tables.capacity // KIB))
    model.Minimize(objective)

    if hint is not None:
        for d, i in enumerate(hint):
            for j, lit in enumerate(x[d]):
                model.AddHint(lit, j == i)

    problem_text = model.Validate()
    if problem_text:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {problem_text}")
    return LayoutModel(model, x, time_limit_s, time.perf_counter() - started)


@dataclass
class _StrategyTerms:
    """Per ``x`` literal (in ``flat``), its forward and backward time and its memory
    coefficients; the literals that move gradient bytes (``grads``: (bytes, literal)) and
    the parameters ZeRO shards (``weights``: (decision, strategy, literal))."""

    flat: list = field(default_factory=list)
    fwd: list[int] = field(default_factory=list)
    bwd: list[int] = field(default_factory=list)
    mem: list[int] = field(default_factory=list)
    grads: list[tuple] = field(default_factory=list)
    weights: list[tuple] = field(default_factory=list)


def _strategy_terms(tables: CostTables, x: list[list], state_scale: float,
                    activation_scale: float) -> _StrategyTerms:
    """Each strategy's terms in the objective and the memory constraint."""
    setting = tables.setting
    terms = _StrategyTerms()
    for d, xs in zip(tables.problem.decisions, x):
        for i, s in enumerate(d.candidates):
            f, b = tables.compute(d, s)
            st = tables.states(d, s)
            terms.flat.append(xs[i])
            terms.fwd.append(_t(f))
            terms.bwd.append(_t(b))
            fp8 = tables.step_copy_bytes(d, s)
            terms.mem.append(_kib(tables.activation_memory(d, s) * activation_scale
                                  + (st.total + fp8) * d.count * state_scale))
            if setting.grad_group > 1:
                g = tables.grad_bytes(d, s) * d.count
                if g:
                    terms.grads.append((g, xs[i]))
                if setting.zero >= 1 and d.kind == "param" and d.facts.param is not None:
                    terms.weights.append((d, s, xs[i]))
    return terms


def _value_terms(tables: CostTables, skeleton: _Skeleton, var, activation_scale: float
                 ) -> tuple[list, list[int], list, list[int]]:
    """The values' terms: redistributions and partial-gradient all-reduces per microbatch
    (variables, coefficients), copies kept for backward in memory (variables, coefficients);
    costs of one instance, times the instances."""
    micro_vars, micro_coefs = [], []
    for key, p, q, index in skeleton.moves:
        cost = _t(tables.redistribution(key, p, q) * tables.value_count(key))
        if cost:
            micro_vars.append(var(index))
            micro_coefs.append(cost)
    for key, p, index in skeleton.backs:
        cost = _t(tables.partial_grad(key, p) * tables.value_count(key))
        if cost:
            micro_vars.append(var(index))
            micro_coefs.append(cost)
    saved_vars = [var(index) for _, _, index in skeleton.saved]
    saved_coefs = [_kib(tables.saved_bytes(key, q) * tables.value_count(key) * activation_scale)
                   for key, q, _ in skeleton.saved]
    return micro_vars, micro_coefs, saved_vars, saved_coefs


def _data_parallel_terms(model: cp_model.CpModel, tables: CostTables, terms: _StrategyTerms,
                         fwd, bwd, state_scale: float) -> tuple[list, int, list]:
    """The data-parallel collectives' terms: what the objective adds (their exposed time,
    then the slowdown of the compute they overlap), DDP's bucket memory in KiB, and
    ZeRO-3's gathered weights at peak (memory terms)."""
    setting = tables.setting
    m = setting.microbatches
    grad_terms, weight_terms = terms.grads, terms.weights
    exposed = model.NewIntVar(0, 2**60, "dp_exposed")

    mesh = setting.shard_mesh  # HSDP: ZeRO within "dp", shards all-reduced across groups

    def bare(kind: str, nbytes: float = 1.0, axis: str = "dp") -> float:
        return group_collective_time(kind, nbytes, mesh, axis, tables.cluster)

    def fixed(kind: str, axis: str = "dp") -> float:
        """A dp collective's latency; each is asynchronous (see busy_latency)."""
        return busy_latency(tables.cluster, mesh, axis) + bare(kind, axis=axis)

    def slope(kind: str, nbytes: float, axis: str = "dp") -> float:
        """The bandwidth part of a dp collective, linear in bytes (latency apart)."""
        return max(bare(kind, nbytes, axis) - bare(kind, axis=axis), 0.0)

    # HSDP: every gradient shard all-reduced across the replica groups once per step
    replicas: list = []
    if setting.dp_replicate > 1:
        replicas = [(fixed("all_reduce", "dp_replicate"), None)] + [
            (slope("all_reduce", g / setting.shard_group, "dp_replicate"), lit)
            for g, lit in grad_terms]

    gloo = tables.cluster.backend == "gloo"
    buffers = 0
    peak_terms = []
    if setting.zero == 0:
        total_grads = sum(g for g, _ in grad_terms)
        buffers = _kib(ddp_buffer_bytes(total_grads, gradient_as_bucket_view=True)
                       * state_scale)
        pieces = [(fixed("all_reduce"), None)] + [
            (slope("all_reduce", g), lit) for g, lit in grad_terms] + replicas
        overlap = 0 if gloo else bwd  # see evaluate
        model.Add(exposed >= _linear(pieces) - overlap)
    else:
        # FSDP2 unit by unit (see evaluate.data_parallel_costs): ZeRO-3 gathers every
        # microbatch, forward and backward; ZeRO-1/2 once per step. ZeRO-3 and 2
        # reduce-scatter every microbatch, ZeRO-1 once.
        gathers = 2 * m if setting.zero == 3 else 1
        reduces = 1 if setting.zero == 1 else m
        pieces = [(reduces * slope("reduce_scatter", g), lit) for g, lit in grad_terms]
        for d, s, lit in weight_terms:
            one = tables.weight_bytes(d, s)
            pieces.append((gathers * slope("all_gather", one * d.count), lit))
            if setting.zero == 3:
                # Gathered weights at peak: the root's, and two layers' (prefetch).
                peak_terms.append(_kib(one * (d.count * state_scale if d.facts.layer is None
                                              else 2)) * lit)
        pieces.append((gathers * fixed("all_gather") + reduces * fixed("reduce_scatter"),
                       None))
        pieces += replicas
        hidden = 0 if gloo else m * (fwd + bwd)
        model.Add(exposed >= _linear(pieces) - hidden)
    added = [exposed]
    if not gloo:
        # the hidden part slows the compute beside it (cost_models.data_parallel
        # OVERLAP_SLOWDOWN); charged on all of it, exposed included, as an upper bound
        # the evaluation of the solved layout then makes exact
        added.append(_linear(pieces, OVERLAP_SLOWDOWN))
    return added, buffers, peak_terms


def _linear(pieces: list, factor: float = 1.0):
    """The integer expression of (seconds, literal or None for a constant) pieces."""
    return sum(_t(factor * sec) * (1 if lit is None else lit) for sec, lit in pieces)


def run(built: LayoutModel) -> SolveResult:
    """Solve a :func:`build` model; its wall time counts the build's."""
    started = time.perf_counter()
    model, x, time_limit_s = built.model, built.x, built.time_limit_s
    solver = built.solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # one worker: the same inputs always give the same plan
    solver.parameters.catch_sigint_signal = False  # Ctrl-C stops the search, not one solve
    solver.parameters.random_seed = 0
    # Full linearization: the joint (y) marginals then give a tight LP bound, which proves
    # optimality in well under a second where the default level searches for minutes.
    solver.parameters.linearization_level = 2
    # One presolve pass, without probing or symmetry detection: the model is a small
    # assignment problem the LP bound closes, and the full presolve was half of each solve
    # (measured on the 44 solves of Llama-3-70B on 1,024 H100s: 18 s in all against 31 s,
    # every optimum the same).
    solver.parameters.max_presolve_iterations = 1
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.symmetry_level = 0
    # Every linear constraint in the LP from the start: 2.7x faster on the 235 layout models
    # of benchmarks/plan_time.py, the same optima (benchmarks/results/plan_time_2026-11-28.md).
    # It breaks ties differently; the layouts it found first (a rotary table split on tp
    # along the sequence cp slices) are run right since (tests/test_equivalence.py cp-4ranks,
    # the nest_cp_tp edit).
    solver.parameters.add_lp_constraints_lazily = False
    status = solver.Solve(model)
    name = solver.StatusName(status)
    wall = built.build_s + time.perf_counter() - started
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(name, None, None, wall, time_limit_s=time_limit_s)
    choice = [next(i for i, lit in enumerate(xs) if solver.Value(lit)) for xs in x]
    return SolveResult(name, choice, solver.ObjectiveValue() * NS, wall,
                       bound_s=solver.BestObjectiveBound() * NS, time_limit_s=time_limit_s)
