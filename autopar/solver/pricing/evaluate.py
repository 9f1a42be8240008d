"""Predict step time and memory of one fully chosen plan (all numbers modelled).

This is the ground truth the CP-SAT model linearizes: the same cost tables, with
redistributions and saved tensors counted once per (value, placement) exactly as the
runtime performs and keeps them. Costs are first summed per *unit* (what runs before the
layers, each layer, what runs after them: :mod:`autopar.solver.pricing.unit_costs`), then per
pipeline stage, for the setting's partition of layers into chunks (see
:mod:`autopar.solver.model.stages`), with the data-parallel communication
(:mod:`autopar.solver.pricing.dp_costs`) and the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.core.knobs import rank_of_chunk
from autopar.cost_models.comm import (
    LinkSpec,
    axis_link,
    busy_latency,
    group_collective_time,
)
from autopar.cost_models.compute import compute_share, forward_time, optimizer_step_time
from autopar.cost_models.data_parallel import OVERLAP_SLOWDOWN
from autopar.cost_models.memory import MemoryBreakdown
from autopar.cost_models.offload import host_optimizer_s
from autopar.cost_models.pipeline import bubble_fraction, in_flight, schedule_name
from autopar.solver.model.stages import StageLoad, equal_partition
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.dp_costs import data_parallel_costs
from autopar.solver.pricing.unit_costs import UnitCosts, unit_costs
from autopar.solver.setting import Setting


@dataclass(frozen=True)
class StagePrediction:
    """One pipeline stage, per microbatch unless noted (modelled)."""

    layers: tuple[int, ...]
    forward_s: float
    backward_s: float  # including recomputation
    tp_comm_s: float
    activations_per_microbatch: float
    in_flight: float  # microbatches whose activations the stage holds at its peak
    memory: MemoryBreakdown
    p2p_s: float = 0.0  # sending activations on and gradients back
    phases: dict[str, float] = field(default_factory=dict)  # bytes at each peak (phases())
    # what is alive at the forward/backward peak (the optimizer step's holds no activations)
    training: MemoryBreakdown | None = None

    @property
    def time_per_microbatch_s(self) -> float:
        return self.forward_s + self.backward_s + self.tp_comm_s + self.p2p_s


@dataclass(frozen=True)
class Prediction:
    """Modelled figures of one plan; times per optimizer step unless noted."""

    step_time_s: float
    compute_s: float  # forward + backward (+ recomputation) of all microbatches, slowest stage
    tp_comm_s: float  # tensor-parallel collectives, all microbatches (not overlapped)
    dp_comm_s: float  # data-parallel / ZeRO collectives
    # what data parallelism adds to the step: dp_comm_s not hidden behind backward, plus the
    # gathers' copy-outs and the compute that concurrent collectives slow (so it may exceed
    # dp_comm_s)
    dp_exposed_s: float
    memory: MemoryBreakdown  # of the stage with the highest peak
    bubble_s: float = 0.0
    p2p_s: float = 0.0
    stages: tuple[StagePrediction, ...] = field(default=())
    optimizer_s: float = 0.0  # the optimizer's step over this device's parameters
    # bytes each repeated layer keeps for backward per microbatch, under the recomputation
    # in force (Korthikanti et al.'s per-layer activation memory)
    layer_activations: dict[int, float] = field(default_factory=dict)
    partition: tuple[int, ...] = ()  # layers per pipeline chunk
    bubble_fraction: float = 0.0  # pipeline idle time over the slowest stage's work
    # the fullest stage's bytes at each of the step's peaks (see memory_phases): what a
    # measurement of one phase (forward + backward, or the optimizer step) compares with
    memory_phases: dict[str, float] = field(default_factory=dict)
    # the fullest stage's bytes by kind at its forward/backward peak: where activations are
    # (``memory`` is the step's peak, which may be the optimizer step's, holding none)
    memory_training: MemoryBreakdown | None = None

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total


def stage_load(u: UnitCosts, link: LinkSpec | None = None, busy: float = 0.0) -> StageLoad:
    """What :func:`autopar.solver.model.stages.balance` needs from the unit costs; ``link``
    (the pp axis's) prices the activations and gradients sent at each possible cut, each
    send waiting ``busy`` more for a core (:func:`busy_latency`)."""
    time = [u.fwd[i] + u.bwd[i] + u.tp_comm[i] for i in range(u.n_units)]
    state = [u.params[i] + u.grads[i] + u.opt[i] + u.weight_copies[i]
             for i in range(u.n_units)]
    forward = backward = ()
    if link is not None:  # a cut after layer i is after unit i + 1
        def send(nbytes: float) -> float:
            return nbytes / link.bandwidth_bytes_per_s + link.latency_s + busy if nbytes else 0.0

        forward = tuple(send(u.cut_fwd[i + 1]) for i in range(len(u.layers)))
        backward = tuple(send(u.cut_bwd[i + 1]) for i in range(len(u.layers)))
    return StageLoad(time[0], time[-1], tuple(time[1:-1]), state[0], state[-1],
                     tuple(state[1:-1]), u.act[0], u.act[-1], tuple(u.act[1:-1]),
                     forward, backward)


def loss_for_caller_s(tables: CostTables, setting: Setting) -> float:
    """``train_step`` returns the loss averaged over the data-parallel ranks, on every rank.
    Without a pipeline the scalar is all-reduced from the end of the last forward, beside
    the backward (``runtime.parallel_module._LossMean``): hidden, 0 here. A pipeline knows
    the loss only when its schedule ends: the last stage broadcasts it, then one blocking
    all-reduce over dp. Latency only: a few µs on NCCL, but two of gloo's ~0.5-1.3 ms hops,
    3-5% of a small CPU step."""
    mesh, cluster = setting.mesh, tables.cluster
    if mesh.get("pp", 1) == 1:
        return 0.0
    return sum(group_collective_time(kind, 4, mesh, axis, cluster)
               for kind, axis in (("all_reduce", "dp"), ("broadcast", "pp"))
               if mesh.get(axis, 1) > 1)


def evaluate(tables: CostTables, choice: list[int], setting: Setting | None = None) -> Prediction:
    """The prediction of ``choice`` at ``setting`` (by default the tables' own); pipeline
    chunks follow ``setting.partition``, or equal layer counts."""
    return assemble(tables, unit_costs(tables, choice), setting or tables.setting)


def chunk_bounds(setting: Setting, n_layers: int) -> list[tuple[int, int]]:
    """Units of each pipeline chunk, [first, last]: chunk 0 also runs unit 0 (before the
    layers), the last chunk unit L+1 (after them)."""
    chunks = setting.pp * setting.virtual
    partition = setting.partition or (equal_partition(n_layers, chunks) if setting.pp > 1
                                      else (n_layers,))
    bounds, start = [], 1
    for c, count in enumerate(partition):
        first = 0 if c == 0 else start
        last = start + count - 1 if c < len(partition) - 1 else n_layers + 1
        bounds.append((first, last))
        start += count
    return bounds


def rank_units(setting: Setting, n_layers: int) -> list[list[int]]:
    """The units each pipeline rank runs (one list per rank)."""
    out: list[list[int]] = [[] for _ in range(setting.pp)]
    schedule = schedule_name(setting.schedule)
    for c, (first, last) in enumerate(chunk_bounds(setting, n_layers)):
        out[rank_of_chunk(c, setting.pp, schedule)].extend(range(first, last + 1))
    return out


def recompute_transient(u: UnitCosts, unit: int, mode: str) -> float:
    """What layer ``unit`` makes again at once in backward under ``mode``: a fully
    recomputed layer all it would keep, the ``op`` policy what it drops."""
    if mode == "full":
        return u.layer_plain[unit]
    if mode == "op":
        return u.layer_plain[unit] - u.act[unit]
    return 0.0


def assemble(tables: CostTables, u: UnitCosts, setting: Setting) -> Prediction:
    """Sum units into pipeline stages and compose the step (modelled)."""
    pp, m = setting.pp, setting.microbatches
    schedule = schedule_name(setting.schedule)
    n_layers = len(u.layers)
    partition = setting.partition or (equal_partition(n_layers, pp * setting.virtual)
                                      if pp > 1 else (n_layers,))
    ranks, p2p = _ranks_and_sends(tables, setting, u)
    stage_preds, per_micro = _stage_predictions(tables, setting, u, ranks, p2p)
    slowest = max(range(pp), key=lambda k: per_micro[k])
    sp = stage_preds[slowest]
    bubble = frac = 0.0
    if pp > 1:
        frac = bubble_fraction(schedule, pp, m, setting.virtual, t_f=sp.forward_s,
                               t_b=sp.backward_s / 2, t_w=sp.backward_s / 2)
        bubble = frac * m * per_micro[slowest]
    # Each rank syncs its own stage's gradients (and ZeRO-3 gathers its own weights); the
    # step ends when the last rank has, and has stepped its optimizer.
    dp = [_step_tail(tables, setting, u, units) for units in ranks]
    tail = max(range(pp), key=lambda r: dp[r][0])
    _, dp_comm, dp_exposed, _, optimizer_s = dp[tail]
    step = m * per_micro[slowest] + bubble + dp[tail][0] + loss_for_caller_s(tables, setting)
    peak_stage = max(range(pp), key=lambda r: stage_preds[r].memory.total + dp[r][3])
    mem = stage_preds[peak_stage].memory
    # the stage's buffers at its peak (fp8 weight copies) and data parallelism's
    memory = _with_dp_buffers(mem, dp[peak_stage][3], _rank_sum(u.host, ranks[peak_stage]))
    fullest = max(range(pp), key=lambda r: stage_preds[r].training.total + dp[r][3])
    training = _with_dp_buffers(stage_preds[fullest].training, dp[fullest][3],
                                _rank_sum(u.host, ranks[fullest]))
    return Prediction(
        step_time_s=step,
        compute_s=m * (sp.forward_s + sp.backward_s),
        tp_comm_s=m * sp.tp_comm_s,
        dp_comm_s=dp_comm,
        dp_exposed_s=dp_exposed,
        memory=memory,
        bubble_s=bubble,
        p2p_s=m * p2p[slowest],
        stages=tuple(stage_preds),
        layer_activations={layer: u.act[i + 1] for i, layer in enumerate(u.layers)},
        optimizer_s=optimizer_s,
        partition=tuple(partition),
        bubble_fraction=frac,
        memory_phases={name: b + dp[peak_stage][3]
                       for name, b in stage_preds[peak_stage].phases.items()},
        memory_training=training,
    )


def _with_dp_buffers(mem: MemoryBreakdown, dp_buffers: float, host: float) -> MemoryBreakdown:
    """A stage's breakdown with data parallelism's buffers and the host's bytes added."""
    return MemoryBreakdown(mem.params, mem.grads, mem.optimizer, mem.activations,
                           mem.buffers + dp_buffers, temporaries=mem.temporaries, host=host)


def _rank_sum(values: list[float], units: list[int]) -> float:
    """The sum of a per-unit cost over the units one pipeline rank runs."""
    return sum(values[i] for i in units)


def _ranks_and_sends(tables: CostTables, setting: Setting,
                     u: UnitCosts) -> tuple[list[list[int]], list[float]]:
    """The units each pipeline rank runs, and the seconds per microbatch it spends sending
    activations on and gradients back."""
    pp = setting.pp
    schedule = schedule_name(setting.schedule)
    chunks = pp * setting.virtual
    ranks: list[list[int]] = [[] for _ in range(pp)]
    p2p = [0.0] * pp
    link = axis_link(tables.cluster, setting.mesh, "pp") if pp > 1 else None
    busy = busy_latency(tables.cluster, setting.mesh, "pp")
    for c, (first, last) in enumerate(chunk_bounds(setting, len(u.layers))):
        r = rank_of_chunk(c, pp, schedule)
        ranks[r].extend(range(first, last + 1))
        if link is None:
            continue
        if c < chunks - 1:  # send activations on
            p2p[r] += u.cut_fwd[last] / link.bandwidth_bytes_per_s + link.latency_s + busy
        if c > 0 and u.cut_bwd[first - 1]:  # send gradients back
            p2p[r] += u.cut_bwd[first - 1] / link.bandwidth_bytes_per_s + link.latency_s + busy
    if tables.problem.p2p_overlap:
        # Megatron-Core's interleaved schedule (overlap_p2p_comm) posts each send and receive
        # before the chunk it runs beside: the transfers hide, slowing that chunk's compute
        # as any collective beside a kernel does. autopar's stages block on their receives.
        p2p = [OVERLAP_SLOWDOWN * t for t in p2p]
    return ranks, p2p


def _stage_predictions(tables: CostTables, setting: Setting, u: UnitCosts,
                       ranks: list[list[int]], p2p: list[float],
                       ) -> tuple[list[StagePrediction], list[float]]:
    """Each pipeline rank's stage, and its seconds per microbatch."""
    pp, m = setting.pp, setting.microbatches
    schedule = schedule_name(setting.schedule)
    n_layers = len(u.layers)
    stage_preds = []
    per_micro = []
    for r, units in enumerate(ranks):
        flight = in_flight(schedule, pp, m, r, setting.virtual) if pp > 1 else 1.0
        layer_units = [i for i in units if 0 < i <= n_layers]
        transient = max((recompute_transient(u, i, setting.layer_mode(i - 1))
                         for i in layer_units), default=0.0)
        act = _rank_sum(u.act, units)
        phases = memory_phases(tables, setting, _rank_sum(u.params, units),
                               _rank_sum(u.grads, units), _rank_sum(u.opt, units),
                               act * flight, transient,
                               max((u.largest[i] for i in units), default=0.0),
                               _rank_sum(u.trainable_numel, units),
                               _rank_sum(u.weight_copies, units),
                               max((u.largest_grad[i] for i in units), default=0.0))
        memory = max(phases.values(), key=lambda b: b.total)
        training = max((b for name, b in phases.items() if name != "optimizer_step"),
                       key=lambda b: b.total)
        fwd, bwd = _rank_sum(u.fwd, units), _rank_sum(u.bwd, units)
        comm = _rank_sum(u.tp_comm, units)
        stage_preds.append(StagePrediction(
            tuple(u.layers[i - 1] for i in layer_units), fwd, bwd, comm, act, flight, memory,
            p2p[r], {name: b.total for name, b in phases.items()}, training))
        per_micro.append(fwd + bwd + comm + p2p[r])
    return stage_preds, per_micro


def _step_tail(tables: CostTables, setting: Setting, u: UnitCosts,
               units: list[int]) -> tuple[float, float, float, float, float]:
    """What one pipeline rank's step adds to its microbatches: (the seconds it adds, dp
    communication, its exposed part, dp buffer bytes, the optimizer's step). The seconds
    include the step's one cast of each fp32 weight to 16 bits (``weight_copies="step"``)."""
    n_layers = len(u.layers)
    roots = sum(u.weights[i] for i in units if not 0 < i <= n_layers)
    layer_w = max((u.weights[i] for i in units if 0 < i <= n_layers), default=0.0)
    comm, exposed, buffers = data_parallel_costs(tables, setting, u, units, roots + 2 * layer_w)
    owned = _rank_sum(u.trainable_numel, units) / (setting.shard_group if setting.zero >= 1
                                                   else 1)
    opt_s = (host_optimizer_s(owned, tables.cluster.device) if setting.offload != "none"
             else optimizer_step_time(owned, tables.options.optimizer, tables.cluster.device))
    if setting.zero >= 1 and setting.grad_group > 1:  # FSDP2: the optimizer steps DTensors
        opt_s += (_rank_sum(u.trainable_tensors, units) / compute_share(tables.cluster.device)
                  * tables.cluster.device.sharded_optimizer_s_per_tensor)
    cast_s = forward_time(0.0, _rank_sum(u.weight_casts, units), tables.cluster.device,
                          tables.options.precision)  # 0 when nothing is cast
    return exposed + opt_s + cast_s, comm, exposed, buffers, opt_s


def grads_outlive_backward(setting: Setting) -> bool:
    """Are the kept gradients alive while forward runs? With several microbatches (they
    accumulate) and in DDP's buckets (made once); not otherwise: ``zero_grad()`` drops them
    and one backward makes them, FSDP2's shards as it frees each unit's whole weights
    (measured on CPU: tests/test_precision_runtime.py)."""
    return setting.microbatches > 1 or (setting.zero == 0 and setting.grad_group > 1)


def memory_phases(tables: CostTables, setting: Setting, params: float, grads: float,
                  optimizer: float, activations: float, recompute_transient: float,
                  largest: float, trainable_numel: float,
                  weight_copies: float = 0.0, weight_grad: float = 0.0
                  ) -> dict[str, MemoryBreakdown]:
    """The peaks of a training step, with what is alive at each (the largest is the step's).

    - When forward ends: weights, optimizer states, every kept activation (a training step
      makes no output but the scalar loss whole for its caller: ``comm_ops.outputs_unused``).
    - When backward starts: the same, with the gradient of the loss's input plus one working
      copy (twice the largest activation), and the largest weight gradient backward makes
      before it is summed into the kept one (``weight_grad``); later, a fully
      recomputed layer's activations come back one layer at a time (not at the same time).
    - In both, the low-precision copies of the fp32 weights (``weight_copies``, buffers:
      16-bit working copies, fp8 linears' fp8 copies): one per weight for the whole step,
      gone by the optimizer step.
    - During the optimizer step: weights, gradients, states, and the optimizer's scratch
      (one fp32 tensor per trainable weight: foreach AdamW's intermediate).

    Gradients count before the optimizer step only if they outlive it
    (:func:`grads_outlive_backward`).
    """
    live_grads = grads if grads_outlive_backward(setting) else 0.0
    return {
        "forward_end": MemoryBreakdown(params, live_grads, optimizer, activations, weight_copies),
        "backward_start": MemoryBreakdown(params, live_grads, optimizer, activations,
                                          weight_copies,
                                          temporaries=max(2 * largest, recompute_transient)
                                          + weight_grad),
        "optimizer_step": MemoryBreakdown(
            params, grads, optimizer, 0.0, 0.0,
            temporaries=0.0 if setting.offload != "none"  # the host steps
            else trainable_numel * 4 / (setting.shard_group if setting.zero >= 1 else 1)),
    }
