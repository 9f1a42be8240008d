"""Recomputation per layer: which layers rerun their forward in backward, chosen by CP-SAT.

One mode for every layer wastes time when memory is just short: recomputing a few layers
would fit, recomputing all of them costs a third more compute. Here each repeated layer gets
its own mode among the allowed ones (e.g. ``none`` or ``full``), as a knapsack per pipeline
rank: least recompute time whose kept activations fit beside the rank's model states. A
pipeline rank holds ``in_flight`` microbatches of its own layers (under 1F1B the first rank
holds the most), so the ranks get different mixes.

The per-layer costs come from one tp layout priced under each mode (the unit costs of
:mod:`autopar.solver.pricing.evaluate`); a mixed plan's units are the chosen mode's, layer by layer
(:func:`compose_units`), and the composed plan is evaluated exactly before it is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping

from ortools.sat.python import cp_model

from autopar.cost_models.pipeline import in_flight, schedule_name
from autopar.solver.model.cpsat import solve_stats
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.evaluate import (
    Prediction,
    assemble,
    data_parallel_costs,
    grads_outlive_backward,
    rank_units,
    recompute_transient,
)
from autopar.solver.pricing.unit_costs import UnitCosts
from autopar.solver.setting import Setting

_LIST_FIELDS = tuple(f.name for f in dataclasses.fields(UnitCosts)
                     if f.type in ("list[float]", list))
_SCALE = 1e6  # seconds -> microseconds, bytes -> KiB-ish integers for CP-SAT
_KIB = 1024.0


def compose_units(by_mode: Mapping[str, UnitCosts], modes: tuple[str, ...]) -> UnitCosts:
    """The units of a plan whose ``i``-th layer runs under ``modes[i]`` (units before and
    after the layers are the same under every mode)."""
    first = by_mode[modes[0]]
    out = dataclasses.replace(first, **{name: list(getattr(first, name))
                                        for name in _LIST_FIELDS})
    for i, mode in enumerate(modes):
        src = by_mode[mode]
        for name in _LIST_FIELDS:
            getattr(out, name)[i + 1] = getattr(src, name)[i + 1]
    return out


def choose_layer_modes(tables: CostTables, by_mode: Mapping[str, UnitCosts],
                       setting: Setting, time_limit_s: float = 5.0
                       ) -> tuple[tuple[str, ...], Prediction, dict] | None:
    """The per-layer modes (among ``by_mode``'s) with the fastest step that fits, its
    prediction (every layer may get the same mode: the setting is then uniform) and the
    CP-SAT solve's figures (:func:`autopar.solver.model.cpsat.solve_stats`); None when nothing
    fits."""
    modes = list(by_mode)
    any_units = next(iter(by_mode.values()))
    n_layers = len(any_units.layers)
    if n_layers == 0 or len(modes) < 2:
        return None
    pp = setting.pp
    schedule = schedule_name(setting.schedule)
    ranks = rank_units(setting, n_layers)
    model = cp_model.CpModel()
    pick = [{m: model.NewBoolVar(f"l{i}_{m}") for m in modes} for i in range(n_layers)]
    for choice in pick:
        model.AddExactlyOne(choice.values())
    slowest = model.NewIntVar(0, 1 << 40, "slowest")  # microseconds
    capacity = tables.capacity
    for r, units in enumerate(ranks):
        flight = in_flight(schedule, pp, setting.microbatches, r, setting.virtual) if pp > 1 else 1.0
        layer_units = [i for i in units if 0 < i <= n_layers]
        u0 = any_units
        fixed_time = sum(u0.fwd[i] + u0.bwd[i] + u0.tp_comm[i] for i in units
                         if not 0 < i <= n_layers)
        time_terms, act_terms = [], []
        transient = model.NewIntVar(0, 1 << 40, f"transient{r}")  # KiB
        largest = max((u0.largest[i] for i in units), default=0.0)
        model.Add(transient >= _int(2 * largest / _KIB))
        weight_grad = max((u0.largest_grad[i] for i in units), default=0.0)
        for i in layer_units:
            for m, var in pick[i - 1].items():
                u = by_mode[m]
                time_terms.append(_int((u.fwd[i] + u.bwd[i] + u.tp_comm[i]) * _SCALE) * var)
                act_terms.append(_int(u.act[i] * flight / _KIB) * var)
                model.Add(transient >= _int(recompute_transient(u, i, m) / _KIB)).OnlyEnforceIf(var)
        model.Add(slowest >= _int(fixed_time * _SCALE) + sum(time_terms))
        states = sum(u0.params[i] + u0.opt[i] + u0.weight_copies[i] for i in units)
        grads = sum(u0.grads[i] for i in units)
        buffers = data_parallel_costs(tables, setting, u0, units, 0.0)[2]
        fixed = states + (grads if grads_outlive_backward(setting) else 0.0) + buffers
        act_fixed = sum(u0.act[i] for i in units if not 0 < i <= n_layers) * flight
        room = capacity - fixed - act_fixed - weight_grad
        if room <= 0:
            return None
        model.Add(sum(act_terms) + transient <= _int(room / _KIB))
    # fastest first, then the least recomputation (fewest layers off their cheapest mode)
    cheapest = min(modes, key=lambda m: sum(by_mode[m].bwd))
    model.Minimize(slowest * (n_layers + 1) + sum(
        var for choice in pick for m, var in choice.items() if m != cheapest))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.catch_sigint_signal = False  # Ctrl-C stops the search, not one solve
    started = time.perf_counter()
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    stats = solve_stats("recompute per layer", solver.StatusName(status),
                        solver.ObjectiveValue(), solver.BestObjectiveBound(),
                        time.perf_counter() - started, time_limit_s,
                        unit="slowest stage in µs x (layers + 1) + layers recomputed")
    chosen = tuple(next(m for m, var in choice.items() if solver.Value(var)) for choice in pick)
    prediction = assemble(tables, compose_units(by_mode, chosen), with_modes(setting, chosen))
    if prediction.peak_memory_bytes > capacity:
        return None
    return chosen, prediction, stats


def with_modes(setting: Setting, modes: tuple[str, ...]) -> Setting:
    """``setting`` with one recomputation mode per layer ("mixed"), or uniform when they
    are all the same."""
    if len(set(modes)) == 1:
        return dataclasses.replace(setting, recompute=modes[0], layer_recompute=())
    return dataclasses.replace(setting, recompute="mixed", layer_recompute=modes)


def _int(x: float) -> int:
    return int(math.ceil(x)) if x > 0 else 0
