"""Predict step time and memory of one fully chosen plan (all numbers modelled).

This is the ground truth the CP-SAT model linearizes: the same cost tables, with
redistributions and saved tensors counted once per (value, placement) exactly as the
runtime performs and keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.comm import collective_time
from autopar.cost_models.memory import MemoryBreakdown
from autopar.placements import Placement, Replicate
from autopar.solver.costs import CostTables, sharded_compute
from autopar.solver.problem import Problem, ValueKey
from autopar.strategies import Strategy

R = Replicate()
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Prediction:
    """Modelled figures of one plan; times per optimizer step unless noted."""

    step_time_s: float
    compute_s: float  # forward + backward of all microbatches
    tp_comm_s: float  # tensor-parallel collectives, all microbatches (not overlapped)
    dp_comm_s: float  # data-parallel / ZeRO collectives
    dp_exposed_s: float  # the part of dp_comm_s not hidden behind backward
    memory: MemoryBreakdown

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total


def needed_placements(problem: Problem, choice: list[int], key: ValueKey) -> dict[Placement, dict]:
    """Placements the consumers of ``key`` need, each with flags: saved by a consumer,
    read by sharded computation that will send back a partial gradient."""
    out: dict[Placement, dict] = {}
    for use in problem.values[key].uses:
        if use.consumer < 0:
            out.setdefault(R, {"saved": False, "partial_grad": False})
            continue
        s = problem.decisions[use.consumer].candidates[choice[use.consumer]]
        q = s.inputs[use.slot]
        flags = out.setdefault(q, {"saved": False, "partial_grad": False})
        flags["saved"] |= use.saves
        flags["partial_grad"] |= q == R and sharded_compute(s)
    return out


def chosen(problem: Problem, choice: list[int], index: int) -> Strategy:
    return problem.decisions[index].candidates[choice[index]]


def evaluate(tables: CostTables, choice: list[int]) -> Prediction:
    problem, setting = tables.problem, tables.setting
    fwd = bwd = act = 0.0
    params = grads = opt = 0.0
    grad_bytes = 0.0
    for d in problem.decisions:
        s = d.candidates[choice[d.index]]
        f, b = tables.compute(d, s)
        fwd, bwd = fwd + f, bwd + b
        act += tables.activation_memory(d, s)
        st = tables.states(d, s)
        params, grads, opt = params + st.params, grads + st.grads, opt + st.optimizer
        grad_bytes += tables.grad_bytes(d, s)

    tp_comm = 0.0
    for key in problem.values:
        src = chosen(problem, choice, key[0]).outputs[key[1]]
        for q, flags in needed_placements(problem, choice, key).items():
            if q != src:
                tp_comm += tables.redistribution(key, src, q)
            if flags["partial_grad"]:
                tp_comm += tables.partial_grad(key, src)
            if flags["saved"]:
                act += tables.saved_bytes(key, q)

    m = setting.microbatches
    dp_comm, dp_exposed, buffers = data_parallel_costs(tables, choice, grad_bytes, fwd, bwd)
    step = m * (fwd + bwd + tp_comm) + dp_exposed
    memory = MemoryBreakdown(params, grads, opt, act, buffers)
    return Prediction(step, m * (fwd + bwd), m * tp_comm, dp_comm, dp_exposed, memory)


def data_parallel_costs(
    tables: CostTables, choice: list[int], grad_bytes: float, fwd: float, bwd: float
) -> tuple[float, float, float]:
    """(dp communication, its exposed part, buffer bytes) for the setting's ZeRO stage.

    Stage 0 (DDP): one all-reduce of the gradients per step, overlapped with the last
    microbatch's backward. Stage 3 (FSDP2): every microbatch all-gathers the weights for
    forward and again for backward and reduce-scatters the gradients, overlapped with that
    microbatch's compute.
    """
    setting = tables.setting
    if setting.dp <= 1:
        return 0.0, 0.0, 0.0
    link, n, m = tables.dp_link, setting.dp, setting.microbatches
    if setting.zero == 0:
        comm = collective_time("all_reduce", grad_bytes, n, link)
        return comm, max(0.0, comm - bwd), 2 * DDP_BUCKET_BYTES
    weights = gathered_weight_bytes(tables, choice)
    per_micro = 2 * collective_time("all_gather", weights.total, n, link) + collective_time(
        "reduce_scatter", grad_bytes, n, link
    )
    exposed = m * max(0.0, per_micro - (fwd + bwd))
    return m * per_micro, exposed, weights.peak


@dataclass(frozen=True)
class GatheredWeights:
    total: float  # bytes of all weights, whole over dp (local over tp)
    peak: float  # bytes gathered at once: the root's weights and two layers (prefetch)


def gathered_weight_bytes(tables: CostTables, choice: list[int]) -> GatheredWeights:
    problem = tables.problem
    total = root = 0.0
    per_layer: dict[int, float] = {}
    for d in problem.decisions:
        if d.kind != "param" or d.facts.param is None:
            continue
        s = d.candidates[choice[d.index]]
        tp_div = tables.setting.tp if not isinstance(s.outputs[0], Replicate) else 1
        one = d.facts.param.numel / tp_div * tables.element_bytes
        total += one * d.count
        if d.facts.layer is None:
            root += one * d.count
        else:
            per_layer[0] = per_layer.get(0, 0.0) + one
    return GatheredWeights(total, root + 2 * max(per_layer.values(), default=0.0))
