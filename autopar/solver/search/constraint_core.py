"""Which constraints conflict, when together they leave no plan.

Every mesh of every device count the planner would try, under every pipeline schedule, is
one candidate. A candidate is ruled out by the hardware when even its least-memory plan
(:func:`autopar.solver.search.memory_floors.mesh_memory_floors`) does not fit the device; otherwise each
constraint (and each pinned degree) either allows it or not, and a memory cap rules it out
when that least memory is above the cap. CP-SAT then picks a candidate under one assumption
literal per constraint: infeasible means they conflict, and
``SufficientAssumptionsForInfeasibility`` gives a set of them that does; dropping members
while the rest stays infeasible makes it the smallest such set.

This is a model of the search, not the search: a conflict it cannot see (a layout
constraint, a partition that fits no stage) leaves the search's own error standing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from ortools.sat.python import cp_model

from autopar.core.cluster import Cluster
from autopar.core.constraints import Constraint, MemoryCap, SettingView
from autopar.core.errors import NoFeasiblePlanError
from autopar.core.knobs import RUNNABLE_SCHEDULES
from autopar.core.units import format_bytes
from autopar.solver.options import PlanOptions
from autopar.solver.search.memory_floors import mesh_memory_floors


@dataclass(frozen=True)
class Rule:
    """A constraint or a pin, as the conflict model uses it."""

    name: str  # as the message names it ("tp<=2", "tp=4 (pinned)")
    allows: Callable[[SettingView, float], bool]  # (candidate, its least memory)


@dataclass(frozen=True)
class Candidate:
    view: SettingView
    memory: float  # bytes its least-memory plan needs per device


def conflicting(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions,
                counts: list[int]) -> NoFeasiblePlanError | None:
    """The error naming the smallest set of constraints (and pins) that leave no plan, or
    None when the model of the search sees none."""
    from autopar.core.cluster.subset import sub_cluster

    rules = _rules(options)
    if not rules:
        return None
    free = dataclasses.replace(options, constraints=(), dp=None, tp=None, pp=None, cp=None)
    candidates: list[Candidate] = []
    for k in counts:
        sub = sub_cluster(cluster, k)
        hardware = sub.device.memory_bytes * options.memory_fraction
        for setting, memory in mesh_memory_floors(gm, sub, free):
            if memory.total > hardware:
                continue  # no constraint is why this one cannot run
            for schedule, virtual in _schedules(setting.pp):
                view = SettingView(dp=setting.dp, tp=setting.tp, pp=setting.pp, cp=setting.cp,
                                   zero=setting.zero, microbatch=setting.microbatch,
                                   microbatches=setting.microbatches, schedule=schedule,
                                   virtual=virtual, recompute=setting.recompute)
                candidates.append(Candidate(view, memory.total))
    if not candidates:
        return None
    core = _core(candidates, rules)
    if not core:
        return None
    names = [rules[i].name for i in core]
    examples = []
    for i in core:
        found = _feasible(candidates, rules, [j for j in core if j != i])
        if found is not None:
            examples.append(f"dropping {rules[i].name} allows e.g. {_describe(found)}")
    together = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + \
        f" and {names[-1]}"
    return NoFeasiblePlanError(
        f"no plan satisfies {together} together on {cluster.name}"
        + (f": {'; '.join(examples)}" if examples else ""),
        where="constraints: " + ", ".join(names),
        fix="relax or drop one of " + ", ".join(names))


def _rules(options: PlanOptions) -> list[Rule]:
    rules = []
    for c in options.constraints:
        if isinstance(c, MemoryCap):
            rules.append(Rule(str(c), lambda v, mem, cap=c.bytes: mem <= cap))
        elif type(c).allows is not Constraint.allows:  # a setting hook
            rules.append(Rule(str(c), lambda v, mem, c=c: c.allows(v)))
    for axis in ("dp", "tp", "pp", "cp"):
        pinned = getattr(options, axis)
        if pinned is not None:
            rules.append(Rule(f"{axis}={pinned} (pinned)",
                              lambda v, mem, a=axis, n=pinned: getattr(v, a) == n))
    return rules


def _schedules(pp: int) -> list[tuple[str | None, int]]:
    if pp == 1:
        return [(None, 1)]
    return [(s, 2 if s in ("interleaved", "zb_v") else 1) for s in RUNNABLE_SCHEDULES]


def _model(candidates: list[Candidate], rules: list[Rule], active: list[int]
           ) -> tuple[cp_model.CpModel, list, list]:
    model = cp_model.CpModel()
    pick = [model.NewBoolVar(f"c{i}") for i in range(len(candidates))]
    assume = [model.NewBoolVar(f"r{j}") for j in range(len(rules))]
    model.AddBoolOr(pick)
    for c, lit in zip(candidates, pick):
        for j, rule in enumerate(rules):
            if not rule.allows(c.view, c.memory):
                model.AddImplication(lit, assume[j].Not())
    model.AddAssumptions([assume[j] for j in active])
    return model, pick, assume


def _solve(model: cp_model.CpModel) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # assumptions need a single worker
    solver.parameters.max_time_in_seconds = 10.0
    return solver, solver.Solve(model)


def _core(candidates: list[Candidate], rules: list[Rule]) -> list[int]:
    """The smallest set of rules (indices) that no candidate satisfies; [] if all can be."""
    model, _, assume = _model(candidates, rules, list(range(len(rules))))
    solver, status = _solve(model)
    if status != cp_model.INFEASIBLE:
        return []
    index = {lit.Index(): j for j, lit in enumerate(assume)}
    core = sorted(index[i] for i in solver.SufficientAssumptionsForInfeasibility()
                  if i in index)
    for j in list(core):  # deletion: keep only the rules the conflict needs
        trial = [k for k in core if k != j]
        if trial and _feasible(candidates, rules, trial) is None:
            core = trial
    return core


def _feasible(candidates: list[Candidate], rules: list[Rule], active: list[int]
              ) -> Candidate | None:
    """A candidate the ``active`` rules all allow (the least memory first), or None."""
    fits = [c for c in candidates if all(rules[j].allows(c.view, c.memory) for j in active)]
    return min(fits, key=lambda c: (c.view.devices, c.memory)) if fits else None


def _describe(c: Candidate) -> str:
    v = c.view
    mesh = " x ".join(f"{a}={getattr(v, a)}" for a in ("pp", "dp", "cp", "tp")
                      if getattr(v, a) > 1)
    where = f"{mesh} on {v.devices} devices" if mesh else "1 device"
    schedule = f" ({v.schedule})" if v.schedule else ""
    return f"{where}{schedule}, least memory {format_bytes(c.memory)} per device (modelled)"

