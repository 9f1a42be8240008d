"""The outer search: mesh shapes x ZeRO stage x microbatch size, each solved by CP-SAT.

For every factorization ``world = dp x tp`` with ``tp`` inside a node, every allowed ZeRO
stage and microbatch sizes from the largest down, it builds the cost tables, skips settings
whose memory lower bound already exceeds the device or whose time lower bound cannot beat
the best plan so far, and solves the rest. The fastest feasible setting wins; ties go to the
smaller ``tp`` and ZeRO stage, so the result is deterministic.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch.fx as fx

from autopar.cluster import Cluster
from autopar.cost_models.memory import MemoryBreakdown
from autopar.errors import NoFeasiblePlanError
from autopar.graph_facts import META_KEY, graph_facts
from autopar.solver.batch_axis import batch_strategies, propagate_input_dim
from autopar.solver.costs import CostTables, Setting
from autopar.solver.cpsat import solve
from autopar.solver.evaluate import Prediction, evaluate
from autopar.solver.options import PlanOptions
from autopar.solver.problem import Problem, build_problem, forbid_sharding_like
from autopar.units import format_bytes


@dataclass
class Candidate:
    setting: Setting
    status: str  # OPTIMAL / FEASIBLE / INFEASIBLE / PRUNED(...) / SKIPPED(...)
    prediction: Prediction | None = None
    choice: list[int] | None = None
    wall_s: float = 0.0

    def summary(self) -> dict:
        s = self.setting
        out = {
            "dp": s.dp, "tp": s.tp, "zero": s.zero, "microbatch": s.microbatch,
            "microbatches": s.microbatches, "recompute": s.recompute, "status": self.status,
            "wall_s": round(self.wall_s, 4),
        }
        if self.prediction is not None:
            out["step_time_s"] = self.prediction.step_time_s
            out["peak_memory_bytes"] = int(self.prediction.peak_memory_bytes)
        return out


@dataclass
class SearchResult:
    best: Candidate
    problem: Problem
    tables: CostTables
    batch: dict  # node name -> dp strategy
    candidates: list[Candidate]
    wall_s: float


def mesh_shapes(cluster: Cluster, options: PlanOptions) -> list[tuple[int, int]]:
    """(dp, tp) factorizations of the world with tp dividing the devices of one node."""
    world = cluster.world_size
    shapes = []
    for tp in range(1, cluster.devices_per_node + 1):
        if cluster.devices_per_node % tp or world % tp:
            continue
        dp = world // tp
        if options.tp is not None and tp != options.tp:
            continue
        if options.dp is not None and dp != options.dp:
            continue
        shapes.append((dp, tp))
    return shapes


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def search(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions) -> SearchResult:
    started = time.perf_counter()
    facts = graph_facts(gm)
    traced = facts.batch_size or 1
    global_batch = options.global_batch or traced
    shapes = mesh_shapes(cluster, options)
    if not shapes:
        raise NoFeasiblePlanError(
            f"no mesh matches dp={options.dp}, tp={options.tp} on {cluster.world_size} devices "
            f"({cluster.nodes} node(s) x {cluster.devices_per_node})",
            where="dp/tp",
            fix="dp x tp must equal the number of devices, and tp must divide the devices per node",
        )
    candidates: list[Candidate] = []
    best: tuple | None = None  # (step, tp, zero, candidate, problem, tables, batch)

    for dp, tp in shapes:
        if global_batch % dp:
            candidates.append(Candidate(Setting(dp, tp, 0, 0, 0),
                                        f"SKIPPED(global batch {global_batch} not divisible by dp={dp})"))
            continue
        local = global_batch // dp
        batch = batch_strategies(gm, dp, traced)
        problem = build_problem(gm, tp, batch)
        if not options.tp_splits_batch and tp > 1:
            forbid_sharding_like(problem, propagate_input_dim(gm, tp, traced, dim=0))
        for zero in options.zero_stages:
            if dp == 1 and zero > 0:
                continue  # ZeRO shards over data parallelism; nothing to shard
            for recompute in _recompute_modes(options, problem, facts.seq_len):
                best = _search_microbatches(
                    problem, cluster, options, candidates, best, facts, traced, local,
                    dp, tp, zero, recompute, batch,
                )
    if best is None:
        raise no_plan_error(gm, cluster, options, candidates)
    return SearchResult(best[3], best[4], best[5], best[6], candidates,
                        time.perf_counter() - started)


def _recompute_modes(options: PlanOptions, problem: Problem, seq_len: int | None) -> list[str]:
    """The allowed recomputation modes, without "selective" when nothing is quadratic in
    the sequence (flash-style attention already recomputes its scores)."""
    modes = list(options.recompute)
    if "selective" in modes and seq_len:
        quadratic = any(list(s).count(seq_len) >= 2 for d in problem.decisions
                        for s in d.facts.shapes)
        if not quadratic:
            modes.remove("selective")
    return modes


def _search_microbatches(problem, cluster, options, candidates, best, facts, traced, local,
                         dp, tp, zero, recompute, batch):
    """Solve microbatch sizes from the largest down for one (mesh, ZeRO, recompute); return
    the best (step, tp, zero, candidate, problem, tables, batch) so far."""
    previous = None  # step time at the next larger microbatch that fitted
    hint = None
    sizes = [options.microbatch] if options.microbatch else _divisors_desc(local)
    for mb in sizes:
        if local % mb:
            candidates.append(Candidate(Setting(dp, tp, zero, mb, 0, recompute),
                                        f"SKIPPED(microbatch {mb} does not divide {local})"))
            continue
        setting = Setting(dp, tp, zero, mb, local // mb, recompute)
        tables = CostTables(problem, cluster, options, setting, traced, facts.seq_len)
        memory_floor, time_floor = lower_bounds(tables)
        if memory_floor > tables.capacity:
            candidates.append(Candidate(setting, "PRUNED(memory lower bound)"))
            continue
        if best is not None and time_floor >= best[0]:
            candidates.append(Candidate(setting, "PRUNED(time lower bound)"))
            break
        result = solve(tables, options.time_limit_s, hint)
        cand = Candidate(setting, result.status, wall_s=result.wall_s)
        candidates.append(cand)
        if result.choice is None:
            continue
        hint = result.choice
        cand.choice = result.choice
        cand.prediction = evaluate(tables, result.choice)
        if cand.prediction.peak_memory_bytes > tables.capacity:
            cand.status = "REJECTED(evaluated memory above capacity)"
            continue
        key = (cand.prediction.step_time_s, tp, zero)
        if best is None or key < best[:3]:
            best = (*key, cand, problem, tables, batch)
        # Larger microbatches amortize per-microbatch costs, but near the memory limit they
        # force leaner, slower strategies: keep halving while it helps.
        if previous is not None and cand.prediction.step_time_s >= previous:
            break
        previous = cand.prediction.step_time_s
    return best


def lower_bounds(tables: CostTables) -> tuple[float, float]:
    """Memory and step-time floors: each decision at its cheapest, no communication."""
    memory = 0.0
    compute = 0.0
    for d in tables.problem.decisions:
        memory += min(tables.states(d, s).total * d.count + tables.activation_memory(d, s)
                      for s in d.candidates)
        compute += min(sum(tables.compute(d, s)) for s in d.candidates)
    return memory, compute * tables.setting.microbatches


def no_plan_error(
    gm: fx.GraphModule, cluster: Cluster, options: PlanOptions, candidates: list[Candidate]
) -> NoFeasiblePlanError:
    """"Fits nowhere": the memory breakdown of the least-memory candidate and the shortfall."""
    low = lowest_memory(gm, cluster, options)
    if low is None:
        reasons = "; ".join(sorted({c.status for c in candidates}))
        return NoFeasiblePlanError(
            f"no plan: every mesh was skipped ({reasons})",
            where=f"cluster {cluster.name}",
            fix="change the global batch or the pinned degrees",
        )
    setting, memory = low
    capacity = cluster.device.memory_bytes * options.memory_fraction
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in memory.to_dict().items() if k != "total")
    return NoFeasiblePlanError(
        f"the model fits on no mesh of {cluster.name}: the least-memory plan needs "
        f"{format_bytes(memory.total)} per device (dp={setting.dp}, tp={setting.tp}, "
        f"ZeRO-{setting.zero}, microbatch {setting.microbatch}: {parts}), "
        f"{format_bytes(memory.total - capacity)} more than the {format_bytes(capacity)} usable "
        f"({options.memory_fraction:.0%} of {format_bytes(cluster.device.memory_bytes)})",
        where=f"cluster {cluster.name}",
        fix="use more or larger devices"
        + ("" if 3 in options.zero_stages else ", allow ZeRO-3 (zero_stages=(0, 3))")
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
    facts = graph_facts(gm)
    traced = facts.batch_size or 1
    global_batch = options.global_batch or traced
    low = None
    for dp, tp in mesh_shapes(cluster, options):
        if global_batch % dp:
            continue
        zero = max(options.zero_stages) if dp > 1 else 0
        setting = Setting(dp, tp, zero, 1, global_batch // dp)
        problem = build_problem(gm, tp, batch_strategies(gm, dp, traced))
        tables = CostTables(problem, cluster, options, setting, traced, facts.seq_len)
        choice = [
            min(range(len(d.candidates)),
                key=lambda i, d=d: tables.states(d, d.candidates[i]).total * d.count
                + tables.activation_memory(d, d.candidates[i]))
            for d in problem.decisions
        ]
        memory = evaluate(tables, choice).memory
        if low is None or memory.total < low[1].total:
            low = (setting, memory)
    return low
