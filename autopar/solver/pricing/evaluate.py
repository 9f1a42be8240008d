"""Predict step time and memory of one fully chosen plan (all numbers modelled).

This is the ground truth the CP-SAT model linearizes: the same cost tables, with
redistributions and saved tensors counted once per (value, placement) exactly as the
runtime performs and keeps them. Costs are first summed per *unit* (what runs before the
layers, each layer, what runs after them: :mod:`autopar.solver.pricing.unit_costs`), then per
pipeline stage, for the setting's partition of layers into chunks (see
:mod:`autopar.solver.model.stages`), with the data-parallel communication and the optimizer step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from autopar.core.knobs import rank_of_chunk
from autopar.cost_models.comm import (
    LinkSpec,
    axis_link,
    busy_latency,
    group_collective_time,
)
from autopar.cost_models.compute import compute_share, optimizer_step_time
from autopar.cost_models.data_parallel import (
    OVERLAP_SLOWDOWN,
    CommTime,
    Unit,
    bucketed_step,
    fsdp_comm,
    fsdp_copies_s,
    fsdp_host_s,
    fsdp_step,
)
from autopar.cost_models.memory import MemoryBreakdown, bucket_sizes, ddp_buffer_bytes
from autopar.cost_models.offload import host_copy_s, host_optimizer_s
from autopar.cost_models.pipeline import bubble_fraction, in_flight, schedule_name
from autopar.solver.model.stages import StageLoad, equal_partition
from autopar.solver.pricing.costs import CostTables
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

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total


def stage_load(u: UnitCosts, link: LinkSpec | None = None, busy: float = 0.0) -> StageLoad:
    """What :func:`autopar.solver.model.stages.balance` needs from the unit costs; ``link``
    (the pp axis's) prices the activations and gradients sent at each possible cut, each
    send waiting ``busy`` more for a core (:func:`busy_latency`)."""
    time = [u.fwd[i] + u.bwd[i] + u.tp_comm[i] for i in range(u.n_units)]
    state = [u.params[i] + u.grads[i] + u.opt[i] + u.fp8_weights[i] for i in range(u.n_units)]
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
    chunks = pp * setting.virtual
    n_layers = len(u.layers)
    partition = setting.partition or (equal_partition(n_layers, chunks) if pp > 1
                                      else (n_layers,))
    bounds = chunk_bounds(setting, n_layers)
    rank_units: list[list[int]] = [[] for _ in range(pp)]
    p2p = [0.0] * pp
    link = axis_link(tables.cluster, setting.mesh, "pp") if pp > 1 else None
    busy = busy_latency(tables.cluster, setting.mesh, "pp")
    for c, (first, last) in enumerate(bounds):
        r = rank_of_chunk(c, pp, schedule)
        rank_units[r].extend(range(first, last + 1))
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

    def total(values: list[float], r: int) -> float:
        return sum(values[i] for i in rank_units[r])

    stage_preds = []
    per_micro = []
    for r in range(pp):
        units = rank_units[r]
        flight = in_flight(schedule, pp, m, r, setting.virtual) if pp > 1 else 1.0
        layer_units = [i for i in units if 0 < i <= n_layers]
        transient = max((recompute_transient(u, i, setting.layer_mode(i - 1))
                         for i in layer_units), default=0.0)
        act = total(u.act, r)
        phases = memory_phases(tables, setting, total(u.params, r), total(u.grads, r),
                               total(u.opt, r), act * flight, transient,
                               max((u.largest[i] for i in units), default=0.0),
                               total(u.trainable_numel, r),
                               total(u.fp8_weights, r))
        memory = max(phases.values(), key=lambda b: b.total)
        fwd, bwd, comm = total(u.fwd, r), total(u.bwd, r), total(u.tp_comm, r)
        stage_preds.append(StagePrediction(
            tuple(u.layers[i - 1] for i in layer_units), fwd, bwd, comm, act, flight, memory,
            p2p[r], {name: b.total for name, b in phases.items()}))
        per_micro.append(fwd + bwd + comm + p2p[r])

    slowest = max(range(pp), key=lambda k: per_micro[k])
    sp = stage_preds[slowest]
    bubble = frac = 0.0
    if pp > 1:
        frac = bubble_fraction(schedule, pp, m, setting.virtual, t_f=sp.forward_s,
                               t_b=sp.backward_s / 2, t_w=sp.backward_s / 2)
        bubble = frac * m * per_micro[slowest]
    # Each rank syncs its own stage's gradients (and ZeRO-3 gathers its own weights); the
    # step ends when the last rank has, and has stepped its optimizer.
    dp = []
    for r in range(pp):
        roots = sum(u.weights[i] for i in rank_units[r] if not 0 < i <= n_layers)
        layer_w = max((u.weights[i] for i in rank_units[r] if 0 < i <= n_layers), default=0.0)
        comm, exposed, buffers = data_parallel_costs(
            tables, setting, u, rank_units[r], roots + 2 * layer_w)
        owned = total(u.trainable_numel, r) / (setting.shard_group if setting.zero >= 1 else 1)
        opt_s = (host_optimizer_s(owned, tables.cluster.device) if setting.offload != "none"
                 else optimizer_step_time(owned, tables.options.optimizer,
                                          tables.cluster.device))
        if setting.zero >= 1 and setting.grad_group > 1:  # FSDP2: the optimizer steps DTensors
            opt_s += (total(u.trainable_tensors, r) / compute_share(tables.cluster.device)
                      * tables.cluster.device.sharded_optimizer_s_per_tensor)
        dp.append((exposed + opt_s, comm, exposed, buffers, opt_s))
    tail = max(range(pp), key=lambda r: dp[r][0])
    _, dp_comm, dp_exposed, _, optimizer_s = dp[tail]
    step = m * per_micro[slowest] + bubble + dp[tail][0] + loss_for_caller_s(tables, setting)
    peak_stage = max(range(pp), key=lambda r: stage_preds[r].memory.total + dp[r][3])
    mem = stage_preds[peak_stage].memory
    # the stage's buffers at its peak (fp8 weight copies) and data parallelism's
    memory = MemoryBreakdown(mem.params, mem.grads, mem.optimizer, mem.activations,
                             mem.buffers + dp[peak_stage][3], temporaries=mem.temporaries,
                             host=total(u.host, peak_stage))
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
    )


def memory_phases(tables: CostTables, setting: Setting, params: float, grads: float,
                  optimizer: float, activations: float, recompute_transient: float,
                  largest: float, trainable_numel: float,
                  fp8_weights: float = 0.0) -> dict[str, MemoryBreakdown]:
    """The peaks of a training step, with what is alive at each (the largest is the step's).

    - When forward ends: weights, optimizer states, every kept activation (a training step
      makes no output but the scalar loss whole for its caller: ``comm_ops.outputs_unused``).
    - When backward starts: the same, with the gradient of the loss's input plus one working
      copy (twice the largest activation); later, a fully
      recomputed layer's activations come back one layer at a time (not at the same time).
    - In both, the fp8 copies of the weights fp8 linears read (``fp8_weights``, buffers):
      one per weight for the whole step, gone by the optimizer step.
    - During the optimizer step: weights, gradients, states, and the optimizer's scratch
      (one fp32 tensor per trainable weight: foreach AdamW's intermediate).

    Gradients count before the optimizer step only if they outlive it (DDP's buckets,
    accumulation over microbatches, ZeRO's sharded gradients).
    """
    grads_alive = setting.microbatches > 1 or setting.grad_group > 1 or setting.zero > 0
    live_grads = grads if grads_alive else 0.0
    return {
        "forward_end": MemoryBreakdown(params, live_grads, optimizer, activations, fp8_weights),
        "backward_start": MemoryBreakdown(params, live_grads, optimizer, activations, fp8_weights,
                                          temporaries=max(2 * largest, recompute_transient)),
        "optimizer_step": MemoryBreakdown(
            params, grads, optimizer, 0.0, 0.0,
            temporaries=0.0 if setting.offload != "none"  # the host steps
            else trainable_numel * 4 / (setting.shard_group if setting.zero >= 1 else 1)),
    }


def _collective(tables: CostTables, kind: str, nbytes: float, mesh: dict[str, int],
                axis: str, algorithm: str) -> float:
    """``group_collective_time``, remembered for the search (the problem's cache): the
    candidates of one search price the same few messages on the same meshes millions of
    times. The entry keeps its cluster, so a cluster built later at the same address is
    never served another's time."""
    key = ("collective", id(tables.cluster), kind, nbytes, tuple(mesh.items()), axis,
           algorithm)
    cache = tables.problem.cache
    hit = cache.get(key)
    if hit is None or hit[0] is not tables.cluster:
        hit = (tables.cluster, group_collective_time(kind, nbytes, mesh, axis, tables.cluster,
                                                     algorithm=algorithm))
        cache[key] = hit
    return hit[1]


def data_parallel_costs(
    tables: CostTables, setting: Setting, u: UnitCosts, units: list[int], gathered_peak: float,
    comm_only: bool = False,
) -> tuple[float, float, float]:
    """(dp communication per step, its exposed part, buffer bytes) of one pipeline rank
    running ``units``, for the setting's ZeRO stage (see :mod:`autopar.cost_models.data_parallel`).

    Stage 0 (DDP): the gradients all-reduced in buckets during the last microbatch's
    backward. Stages 1-3 run FSDP2 (:mod:`autopar.runtime.data_parallel`), unit by unit,
    overlapped with the unit's compute (prefetch one unit ahead): stage 3 gathers each unit's
    weights in every microbatch's forward and again in its backward and reduce-scatters its
    gradients; stages 1 and 2 (``reshard_after_forward=False``) gather each unit once per
    step, in the first forward, and keep the weights whole to the end of the step; stage 2
    reduce-scatters every microbatch's gradients (it keeps only their shards), stage 1 only
    the last one's (it accumulates whole gradients).
    HSDP (``dp_replicate`` > 1): gathers and reduce-scatters run within one replica group,
    and each gradient shard is then all-reduced across the groups, once per step.
    gloo on CPU moves data with the same cores that compute (one thread per process): its
    collectives do not overlap compute there. ``comm_only``: the communication alone is
    priced (the exposed part and the buffers are 0), without the timeline.
    """
    if setting.grad_group <= 1:
        return 0.0, 0.0, 0.0
    m = setting.microbatches
    overlap = tables.cluster.backend != "gloo"

    # gradients are summed over dp x cp; ZeRO shards over all of it, or under HSDP over one
    # replica group ("dp" of shard_mesh), whose shards are then all-reduced across groups
    mesh = setting.shard_mesh
    busy = busy_latency(tables.cluster, mesh, "dp")  # each call is asynchronous

    known: dict[tuple[str, float], float] = {}  # alike layers move alike messages

    def dp_time(kind: str, nbytes: float) -> float:
        found = known.get((kind, nbytes))
        if found is None:
            found = known[(kind, nbytes)] = busy + _collective(
                tables, kind, nbytes, mesh, "dp", "auto" if kind == "all_reduce" else "ring")
        return found

    def replica_time(grad_bytes: float) -> float:
        """HSDP: this rank's gradient shard of ``grad_bytes`` all-reduced across groups."""
        if setting.dp_replicate <= 1 or grad_bytes <= 0:
            return 0.0
        return busy_latency(tables.cluster, mesh, "dp_replicate") + _collective(
            tables, "all_reduce", grad_bytes / setting.shard_group, mesh, "dp_replicate",
            "auto")

    if setting.zero == 0:
        grad_bytes = sum(u.grad_bytes[i] for i in units)
        backward = sum(u.bwd[i] + u.tp_comm[i] / 2 for i in units)
        step = bucketed_step([dp_time("all_reduce", b) + replica_time(b)
                              for b in bucket_sizes(grad_bytes)], backward, overlap=overlap)
        return step.comm_s, step.exposed_s, ddp_buffer_bytes(grad_bytes,
                                                             gradient_as_bucket_view=True)

    def edp_time(kind: str, nbytes: float) -> float:  # expert weights: over edp (x cp)
        if nbytes <= 0 or setting.ep <= 1:
            return 0.0
        return busy + _collective(tables, kind, nbytes, setting.ep_mesh, "edp", "ring")

    def host_s(i: int) -> float:  # offload: this rank's fp32 shard crosses the host link
        if setting.offload == "none":
            return 0.0
        return host_copy_s(4 * u.trainable_numel[i] / setting.shard_group,
                           tables.cluster.device)

    n_layers = len(u.layers)
    device = tables.cluster.device
    priced: dict[tuple[float, float], tuple[float, float]] = {}  # alike layers, alike copies
    copies = {}
    for i in units:
        sizes = (u.weights[i], u.grad_bytes[i])
        if sizes not in priced:
            priced[sizes] = fsdp_copies_s(*sizes, device)
        copies[i] = priced[sizes]

    zero3 = setting.zero == 3

    def microbatch(gather: bool, reduce: bool, last: bool) -> CommTime:
        """One microbatch's collectives: its gathers (ZeRO-3: again in backward), its
        reduce-scatters; under HSDP only the last all-reduces the shards across replica
        groups (``ParallelModule`` sets FSDP2's ``set_requires_all_reduce``)."""
        def unit(i: int) -> Unit:
            return Unit(
                gather_s=dp_time("all_gather", u.weights[i] - u.expert_weights[i])
                + edp_time("all_gather", u.expert_weights[i]) + host_s(i) if gather else 0.0,
                reduce_s=dp_time("reduce_scatter", u.grad_bytes[i] - u.expert_grad_bytes[i])
                + edp_time("reduce_scatter", u.expert_grad_bytes[i]) + host_s(i)
                + (replica_time(u.grad_bytes[i]) if last else 0.0) + copies[i][1]
                if reduce else 0.0,
                forward_s=u.fwd[i] + u.tp_comm[i] / 2,
                backward_s=u.bwd[i] + u.tp_comm[i] / 2, regather=zero3 and 0 < i <= n_layers)

        # alike layers make alike units: each is priced once (an 80-layer model has ~3 kinds)
        made: dict[tuple, Unit] = {}
        per_unit = []
        for i in sorted(units):
            key = (u.weights[i], u.expert_weights[i], u.grad_bytes[i], u.expert_grad_bytes[i],
                   u.trainable_numel[i], u.fwd[i], u.bwd[i], u.tp_comm[i], 0 < i <= n_layers)
            found = made.get(key)
            if found is None:
                found = made[key] = unit(i)
            per_unit.append(found)
        if comm_only:
            return CommTime(fsdp_comm(per_unit), 0.0)
        return fsdp_step(per_unit, overlap=overlap)

    # (gathers, reduce-scatters, all-reduces across HSDP groups) of each microbatch, counted
    # (see the docstring): one fsdp_step per kind of microbatch
    passes = Counter((k == 0 or zero3, setting.zero >= 2 or k == m - 1,
                      k == m - 1 and setting.dp_replicate > 1) for k in range(m))
    comm = exposed = 0.0
    for (gather, reduce, last), times in passes.items():
        if gather or reduce:
            priced = microbatch(gather, reduce, last)
            comm += times * priced.comm_s
            exposed += times * priced.exposed_s
    if comm_only:
        return comm, 0.0, 0.0
    # the gathers' copy-outs run on the compute stream: every gather's is on the step's path
    gathers = sum(times for (gather, _, _), times in passes.items() if gather)
    times_gathered = {i: 2 if zero3 and 0 < i <= n_layers else 1 for i in units}  # per microbatch
    copy_out = gathers * sum(copies[i][0] * times_gathered[i] for i in units)
    # and FSDP2's host work around each gather and reduce-scatter (0 on GPUs)
    reduces = sum(times for (_, reduce, _), times in passes.items() if reduce)
    host_work = sum(fsdp_host_s(u.trainable_tensors[i], device) * (gathers * times_gathered[i] + reduces)
                    for i in units)
    return comm, exposed + copy_out + host_work, gathered_peak if zero3 else 0.0
