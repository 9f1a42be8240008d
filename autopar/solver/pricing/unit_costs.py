"""Per-unit costs of one chosen layout: what runs before the layers (unit 0), each repeated
layer, and what runs after them, per microbatch and device (all modelled). The step is
assembled from them (:mod:`autopar.solver.pricing.evaluate`), and pipeline stages are sums of them.

The part that follows from the layout alone (op times, activations, tensor-parallel
communication, cut bytes, the largest tensor) is computed once per layout and
:attr:`CostTables.layout_key` and shared by every setting with that key; only the states,
gradients and expert traffic are computed per setting.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from autopar.analysis.precision import BYTES
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Placement, Replicate, Shard, divisor
from autopar.core.values import tensor_inputs, value_of
from autopar.cost_models.comm import collective_time
from autopar.solver.model.problem import Problem, ValueKey
from autopar.solver.pricing.activation_tables import fp8_copy
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.precision_costs import precision_key
from autopar.solver.pricing.tp_overlap import exposed_s, paired_matmul_s
from autopar.strategies import Strategy

R = Replicate()


def needed_placements(problem: Problem, choice: list[int], key: ValueKey,
                      tables: CostTables | None = None) -> dict[Placement, dict]:
    """Placements the consumers of ``key`` need, each with flags: kept for backward by a
    consumer (under the recomputation in force), read by sharded computation (a partial
    gradient comes back), read only by sharded computation, and copied to fp8 for
    backward by an fp8 linear (``fp8_copy``)."""
    out: dict[Placement, dict] = {}

    def new_flags() -> dict:
        return {"saved": False, "partial_grad": False, "only_sharded": True, "fp8_copy": False}

    for use in problem.values[key].uses:
        if use.consumer < 0:
            flags = out.setdefault(R, new_flags())
            flags["only_sharded"] = False
            continue
        s = problem.decisions[use.consumer].candidates[choice[use.consumer]]
        q = s.inputs[use.slot]
        flags = out.setdefault(q, new_flags())
        flags["saved"] |= tables.keeps(use, key) if tables is not None else use.saves
        flags["fp8_copy"] |= tables is not None and tables.keeps_fp8_copy(use, key)
        sharded = q == R and s.splits_work
        flags["partial_grad"] |= sharded
        flags["only_sharded"] &= sharded
    return out


def chosen(problem: Problem, choice: list[int], index: int) -> Strategy:
    return problem.decisions[index].candidates[choice[index]]


@dataclass
class UnitCosts:
    """Per-microbatch, per-device costs of each *unit* of the graph — what runs before the
    layers (unit 0), each repeated layer in order, and what runs after them (the last unit)
    — under one chosen plan (modelled). Pipeline stages are sums of units."""

    layers: list[int]  # layer index of units 1..L
    unit_of: dict[str, int]  # node name -> unit
    fwd: list[float]
    bwd: list[float]  # including recomputation
    tp_comm: list[float]
    act: list[float]  # kept for backward, under the recomputation in force
    params: list[float]
    grads: list[float]
    opt: list[float]
    grad_bytes: list[float]
    weights: list[float]
    largest: list[float]  # the largest tensor a node makes (local)
    trainable_numel: list[float]
    layer_plain: list[float]  # activations without recomputation (layer units)
    cut_fwd: list[float]  # bytes crossing the cut after unit i, forward
    cut_bwd: list[float]  # ... and their gradients, backward
    # the part of ``weights`` and ``grad_bytes`` that is expert weights held by one ep
    # group's block (ZeRO-3 gathers and reduces them over edp, not dp)
    expert_weights: list[float] = field(default_factory=list)
    expert_grad_bytes: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)  # CPU offload: states in host memory
    # trainable parameter tensors (FSDP2's host work and a DTensor optimizer go per tensor)
    trainable_tensors: list[float] = field(default_factory=list)
    # low-precision copies of fp32 weights (16-bit, an fp8 linear's fp8), kept once for the
    # whole step (autopar.ops.step_copies), not per microbatch in flight
    weight_copies: list[float] = field(default_factory=list)
    weight_casts: list[float] = field(default_factory=list)  # bytes casting them, once a step
    # the largest weight gradient backward makes before summing it into the kept one
    largest_grad: list[float] = field(default_factory=list)

    @property
    def n_units(self) -> int:
        return len(self.fwd)


_UNITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # gm -> _units(gm)


def _units(gm: fx.GraphModule) -> tuple[list[int], dict[str, int]]:
    """Layers in order, and each node's unit: 0 before the first layer node, the layer's
    position, or L + 1 after the layers (computed once per graph: the search evaluates
    many layouts of one graph)."""
    if gm not in _UNITS:
        _UNITS[gm] = _units_of(gm)
    return _UNITS[gm]


def _units_of(gm: fx.GraphModule) -> tuple[list[int], dict[str, int]]:
    layers = sorted({n.meta[META_KEY].layer for n in gm.graph.nodes
                     if META_KEY in n.meta and n.meta[META_KEY].layer is not None})
    position = {layer: i + 1 for i, layer in enumerate(layers)}
    unit_of: dict[str, int] = {}
    seen_layer = False
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        layer = facts.layer if facts is not None else None
        if layer is not None:
            unit_of[node.name] = position[layer]
            seen_layer = seen_layer or node.op != "get_attr"
        else:
            unit_of[node.name] = len(layers) + 1 if seen_layer else 0
    return layers, unit_of


def _unit_counts(nodes: list[fx.Node], unit_of: dict[str, int]) -> list[tuple[int, int]]:
    """(unit, how many of ``nodes`` are in it): a decision's folded nodes share its costs."""
    counts: dict[int, int] = {}
    for node in nodes:
        counts[unit_of[node.name]] = counts.get(unit_of[node.name], 0) + 1
    return list(counts.items())


_LAYOUT = ("fwd", "bwd", "act", "layer_plain", "tp_comm")
"""The per-unit sums of :func:`unit_costs` that follow from the layout alone (the op and
value costs of :attr:`CostTables.layout_key`): shared by every setting of the search with
that key, which differ in dp, pp, the schedule and the ZeRO stage's sharding."""
_STATES = ("tp_comm", "trainable_numel", "params", "grads", "opt", "host", "grad_bytes",
           "weights", "expert_grad_bytes", "expert_weights", "trainable_tensors",
           "weight_copies", "weight_casts")
"""The per-unit sums of :func:`unit_costs` that depend on the setting's sharding and
experts (``tp_comm`` here: the experts' all-to-alls)."""


def unit_costs(tables: CostTables, choice: list[int]) -> UnitCosts:
    problem = tables.problem
    layers, unit_of = _units(problem.gm)
    n = len(layers) + 2
    counts = _unit_counts_matrix(problem, unit_of, n)
    layout = _layout_costs(tables, choice, counts)
    summed = _state_sums(tables, choice, counts)
    per_unit = {name: summed[:, j] for j, name in enumerate(_STATES)}
    per_unit["tp_comm"] = per_unit["tp_comm"] + layout["tp_comm"]
    for name in _LAYOUT[:-1]:
        per_unit[name] = layout[name]
    u = UnitCosts(layers, unit_of, *([0.0] * n for _ in range(14)))
    for name, values in per_unit.items():
        setattr(u, name, values.tolist())
    u.largest, u.largest_grad, u.cut_fwd, u.cut_bwd = (
        list(layout[k]) for k in ("largest", "largest_grad", "cut_fwd", "cut_bwd"))
    setting = tables.setting
    if setting.zero >= 2 and setting.grad_group > 1:
        # FSDP2 reduce-scatters a unit's gradients together: the unit's whole gradients in
        # the parameters' dtype beside their copy in one fp32 input (measured on CPU within
        # 2%: tests/test_precision_runtime.py)
        per = BYTES[tables.precision.params] + 4
        u.largest_grad = [max(g, numel * per) for g, numel in zip(u.largest_grad,
                                                                   u.trainable_numel)]
    return u


def _state_sums(tables: CostTables, choice: list[int], counts: np.ndarray) -> np.ndarray:
    """The per-unit sums of :data:`_STATES` (units x states). Without experts spread they
    follow from the layout and :attr:`CostTables.states_key` alone, not the microbatch or
    the pipeline, so they are computed once per both: the search prices one layout under
    many microbatch sizes and meshes of one ZeRO stage."""
    problem, setting = tables.problem, tables.setting
    key = None
    if setting.ep <= 1:  # the experts' all-to-alls depend on the microbatch
        key = ("state sums", tables.states_key, precision_key(tables.options, setting.zero),
               setting.tp, tuple(choice))
        if key in problem.cache:
            return problem.cache[key]
    rows = np.zeros((len(problem.decisions), len(_STATES)))
    for d in _state_holders(tables):
        s = d.candidates[choice[d.index]]
        st = tables.states(d, s)
        g, w = tables.grad_bytes(d, s), tables.weight_bytes(d, s)
        expert_f, expert_b = tables.expert_comm(d)
        expert = 1.0 if tables.expert_divisor(d) > 1 else 0.0
        numel = tables.trainable_numel(d, s)
        copies = tables.step_copy_bytes(d, s)
        casts = tables.step_cast_bytes(d, s)
        rows[d.index] = (expert_f + expert_b, numel, st.params, st.grads, st.optimizer,
                         st.host_total, g, w, g * expert, w * expert, float(numel > 0),
                         copies, casts)
    summed = counts.T @ rows
    if key is not None:
        problem.cache[key] = summed
    return summed


def _state_holders(tables: CostTables) -> list:
    """The decisions whose :data:`_STATES` can be non-zero: parameters, the fp8 linears
    (their weight copies) and, with experts spread, the ops (their all-to-alls)."""
    problem = tables.problem
    if tables.setting.ep > 1:
        return problem.decisions
    fp8 = tables.fp8_readers
    return [d for d in problem.decisions if d.kind == "param" or d.index in fp8]


def _unit_counts_matrix(problem: Problem, unit_of: dict[str, int], n: int) -> np.ndarray:
    """How many of each decision's folded nodes sit in each unit (decisions x units): its
    costs are added to every unit it sits in, times its nodes there -- one matrix product
    instead of a Python loop per node (fixed per graph)."""
    counts = problem.cache.get("unit_counts")
    if counts is None:
        counts = np.zeros((len(problem.decisions), n))
        for d in problem.decisions:
            for k, c in _unit_counts(d.nodes, unit_of):
                counts[d.index, k] = c
        problem.cache["unit_counts"] = counts
    return counts


def _layout_costs(tables: CostTables, choice: list[int], counts: np.ndarray) -> dict:
    """The per-unit costs that follow from the layout (:data:`_LAYOUT`), the largest
    tensor, the cut bytes and the gathered outputs, computed once per layout and
    :attr:`CostTables.layout_key` (plus what a value's partial gradient and saved weight
    copies depend on: whether weight gradients are deferred, and ep)."""
    s = tables.setting
    key = ("layout_costs", tables.layout_key, s.cp_algorithm, s.ep,
           s.zero == 0 and s.pp == 1, tables.traced_batch, tables.seq_len, tuple(choice))
    cache = tables.problem.cache
    if key not in cache:
        cache[key] = _compute_layout_costs(tables, choice, counts)
    return cache[key]


def _compute_layout_costs(tables: CostTables, choice: list[int], counts: np.ndarray) -> dict:
    problem = tables.problem
    n_tp = tables.setting.tp
    rows = np.empty((len(problem.decisions), 4))
    out = np.zeros(len(problem.decisions))
    grad_out = np.zeros(len(problem.decisions))  # a weight's gradient before it is summed
    for d in problem.decisions:
        s = d.candidates[choice[d.index]]
        f, b, r = tables.times(d, s)
        # the peak counts the largest tensor twice (a gradient beside it); a cp attention
        # buffer is alive once
        out[d.index] = max(
            tables.transient_output_bytes(d, s) if d.kind == "op" and d.facts.requires_grad
            else 0.0, tables.loss_working_bytes(d, s), tables.context_buffer_bytes(d, s) / 2)
        grad_out[d.index] = tables.weight_grad_transient(d, s) if d.kind == "param" else 0.0
        rows[d.index] = (f, b + r, tables.own_activation(d, s),
                         tables.own_activation(d, s, recompute=False))

    values = np.zeros((len(problem.decisions), 3))  # act, layer_plain, tp_comm per producer
    for key in problem.values:
        src = chosen(problem, choice, key[0]).outputs[key[1]]
        per_instance_comm = 0.0
        per_instance_saved = 0.0
        plain_saved = 0.0  # what the consumers would keep without recomputation
        for q, flags in needed_placements(problem, choice, key).items():
            if flags["saved"]:
                sp = q == R and isinstance(src, Shard) and flags["only_sharded"]
                plain_saved += tables.saved_bytes(key, src if sp else q)
        for q, flags in needed_placements(problem, choice, key, tables).items():
            comm_fwd = comm_bwd = 0.0
            if q != src:  # (split into its passes only where they overlap differently)
                comm_fwd = (tables.redistribution_forward(key, src, q) if problem.tp_overlap
                            else 0.0)
                comm_bwd = tables.redistribution(key, src, q) - comm_fwd
            if flags["partial_grad"]:
                comm_bwd += tables.partial_grad(key, src)
            if flags["saved"]:
                if q == R and isinstance(src, Shard) and flags["only_sharded"]:
                    # Sequence parallelism: the gathered copy is kept as its shard and
                    # gathered again in backward.
                    per_instance_saved += tables.saved_bytes(key, src)
                    comm_bwd += collective_time(
                        "all_gather", tables.value_bytes(key), n_tp, tables.tp_link,
                        backend=tables.cluster.backend)
                else:
                    per_instance_saved += tables.saved_bytes(key, q)
            if problem.tp_overlap and (comm_fwd or comm_bwd):  # hidden behind the matmuls
                matmul_fwd, matmul_bwd = paired_matmul_s(tables, choice, key, src, q)
                comm_fwd = exposed_s(comm_fwd, matmul_fwd, n_tp)
                comm_bwd = exposed_s(comm_bwd, matmul_bwd, n_tp)
            per_instance_comm += comm_fwd + comm_bwd
            if flags["fp8_copy"]:
                per_instance_saved += tables.saved_bytes(key, fp8_copy(q))
        values[key[0]] += (per_instance_saved, plain_saved, per_instance_comm)
    summed = counts.T @ np.hstack([rows, np.zeros((len(rows), 1))])
    summed[:, 2:] += counts.T @ values
    layout = {name: summed[:, j].copy() for j, name in enumerate(_LAYOUT)}
    for name, per in (("largest", out), ("largest_grad", grad_out)):
        layout[name] = np.where(counts > 0, per[:, None], 0.0).max(axis=0, initial=0.0).tolist()
    layout["cut_fwd"], layout["cut_bwd"] = _cuts(tables, choice, counts.shape[1])
    return layout


def _cuts(tables: CostTables, choice: list[int], n_units: int
          ) -> tuple[list[float], list[float]]:
    """Bytes each cut between units would send forward (activations, once per value however
    many later units read it) and backward (their gradients)."""
    problem = tables.problem
    unit_of = _units(problem.gm)[1]
    cache = problem.graph_cache  # per value, the unit spans it crosses (one per graph)
    if "cut_spans" not in cache:
        last_reader: dict[tuple, int] = {}  # which unit reads each value last
        for node in problem.gm.graph.nodes:
            if node.name not in problem.decision_of:
                continue
            k = unit_of[node.name]
            for a in tensor_inputs(node):
                producer, index = value_of(a)
                if producer.op == "get_attr" or producer.name not in problem.decision_of:
                    continue
                key = (problem.decision_of[producer.name], index, producer.name)
                last_reader[key] = max(last_reader.get(key, -1), k)
        keys: dict[tuple[int, int], int] = {}
        spans = [(keys.setdefault((decision, index), len(keys)), unit_of[name], reader)
                 for (decision, index, name), reader in last_reader.items()
                 if reader > unit_of[name]]
        cache["cut_spans"] = (list(keys), np.array([s[0] for s in spans], dtype=int),
                              np.array([s[1] for s in spans], dtype=int),
                              np.array([s[2] for s in spans], dtype=int))
    keys, which, starts, readers = cache["cut_spans"]
    if not keys:
        return [0.0] * n_units, [0.0] * n_units
    tp = tables.setting.tp
    fwd = np.array([tables.value_bytes(k) / divisor(chosen(problem, choice, k[0]).outputs[k[1]], tp)
                    for k in keys])
    bwd = np.where([tables.requires_grad(k) for k in keys], fwd, 0.0)

    def crossing(per_key: np.ndarray) -> list[float]:
        """A value crosses every cut from its unit up to (not including) its last reader's:
        +bytes at the start, -bytes at the reader, summed along the cuts."""
        steps = np.zeros(n_units + 1)
        np.add.at(steps, starts, per_key[which])
        np.add.at(steps, readers, -per_key[which])
        return np.cumsum(steps)[:n_units].tolist()

    return crossing(fwd), crossing(bwd)
