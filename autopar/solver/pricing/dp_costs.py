"""What data parallelism adds to one pipeline rank's step: its gradients' all-reduce (DDP)
or FSDP2's gathers and reduce-scatters unit by unit, how much of it the compute hides, and
the buffers it holds (all modelled; the formulas are
:mod:`autopar.cost_models.data_parallel`'s).

:func:`data_parallel_costs` is what :func:`autopar.solver.pricing.evaluate.assemble` and the
layout trials ask.
"""

from __future__ import annotations

from collections import Counter

from autopar.cost_models.comm import busy_latency, group_collective_time
from autopar.cost_models.data_parallel import (
    CommTime,
    Unit,
    bucketed_step,
    fsdp_comm,
    fsdp_copies_s,
    fsdp_host_s,
    fsdp_step,
)
from autopar.cost_models.memory import bucket_sizes, ddp_buffer_bytes
from autopar.cost_models.offload import host_copy_s
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.unit_costs import UnitCosts
from autopar.solver.setting import Setting


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


class _Collectives:
    """The data-parallel collectives of one setting, each call's issue latency included.
    Gradients are summed over dp x cp; ZeRO shards over all of it, or under HSDP over one
    replica group ("dp" of ``shard_mesh``), whose shards are then all-reduced across
    groups."""

    def __init__(self, tables: CostTables, setting: Setting):
        self.tables, self.setting = tables, setting
        self.mesh = setting.shard_mesh
        self.busy = busy_latency(tables.cluster, self.mesh, "dp")  # each call is asynchronous
        self.known: dict[tuple[str, float], float] = {}  # alike layers move alike messages

    def dp(self, kind: str, nbytes: float) -> float:
        found = self.known.get((kind, nbytes))
        if found is None:
            found = self.known[(kind, nbytes)] = self.busy + _collective(
                self.tables, kind, nbytes, self.mesh, "dp",
                "auto" if kind == "all_reduce" else "ring")
        return found

    def replica(self, grad_bytes: float) -> float:
        """HSDP: this rank's gradient shard of ``grad_bytes`` all-reduced across groups."""
        setting = self.setting
        if setting.dp_replicate <= 1 or grad_bytes <= 0:
            return 0.0
        return busy_latency(self.tables.cluster, self.mesh, "dp_replicate") + _collective(
            self.tables, "all_reduce", grad_bytes / setting.shard_group, self.mesh,
            "dp_replicate", "auto")

    def edp(self, kind: str, nbytes: float) -> float:
        """Expert weights' collectives: over edp (x cp)."""
        if nbytes <= 0 or self.setting.ep <= 1:
            return 0.0
        return self.busy + _collective(self.tables, kind, nbytes, self.setting.ep_mesh, "edp",
                                       "ring")

    def host(self, u: UnitCosts, i: int) -> float:
        """Offload: this rank's fp32 shard of unit ``i`` crosses the host link."""
        if self.setting.offload == "none":
            return 0.0
        return host_copy_s(4 * u.trainable_numel[i] / self.setting.shard_group,
                           self.tables.cluster.device)


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
    overlap = tables.cluster.backend != "gloo"
    prices = _Collectives(tables, setting)
    if setting.zero == 0:
        return _ddp_costs(prices, u, units, overlap)
    return _fsdp_costs(prices, u, units, gathered_peak, comm_only, overlap)


def _ddp_costs(prices: _Collectives, u: UnitCosts, units: list[int],
               overlap: bool) -> tuple[float, float, float]:
    """DDP: the gradients all-reduced in buckets beside the last microbatch's backward."""
    grad_bytes = sum(u.grad_bytes[i] for i in units)
    backward = sum(u.bwd[i] + u.tp_comm[i] / 2 for i in units)
    step = bucketed_step([prices.dp("all_reduce", b) + prices.replica(b)
                          for b in bucket_sizes(grad_bytes)], backward, overlap=overlap)
    return step.comm_s, step.exposed_s, ddp_buffer_bytes(grad_bytes,
                                                         gradient_as_bucket_view=True)


def _fsdp_costs(prices: _Collectives, u: UnitCosts, units: list[int], gathered_peak: float,
                comm_only: bool, overlap: bool) -> tuple[float, float, float]:
    """FSDP2 (ZeRO 1-3): each kind of microbatch's collectives on its timeline, counted, and
    the gathers' copy-outs and host work, which no collective hides."""
    setting, device = prices.setting, prices.tables.cluster.device
    m, n_layers, zero3 = setting.microbatches, len(u.layers), setting.zero == 3
    priced: dict[tuple[float, float], tuple[float, float]] = {}  # alike layers, alike copies
    copies = {}
    for i in units:
        sizes = (u.weights[i], u.grad_bytes[i])
        if sizes not in priced:
            priced[sizes] = fsdp_copies_s(*sizes, device)
        copies[i] = priced[sizes]
    # (gathers, reduce-scatters, all-reduces across HSDP groups) of each microbatch, counted
    # (see data_parallel_costs): one fsdp_step per kind of microbatch
    passes = Counter((k == 0 or zero3, setting.zero >= 2 or k == m - 1,
                      k == m - 1 and setting.dp_replicate > 1) for k in range(m))
    comm = exposed = 0.0
    for (gather, reduce, last), times in passes.items():
        if gather or reduce:
            step = _fsdp_microbatch(prices, u, units, copies, (gather, reduce, last),
                                    comm_only, overlap)
            comm += times * step.comm_s
            exposed += times * step.exposed_s
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


def _fsdp_microbatch(prices: _Collectives, u: UnitCosts, units: list[int],
                     copies: dict[int, tuple[float, float]], passes: tuple[bool, bool, bool],
                     comm_only: bool, overlap: bool) -> CommTime:
    """One microbatch's collectives: its gathers (ZeRO-3: again in backward), its
    reduce-scatters; under HSDP only the last all-reduces the shards across replica
    groups (``ParallelModule`` sets FSDP2's ``set_requires_all_reduce``). ``passes``:
    (gathers, reduce-scatters, last)."""
    n_layers = len(u.layers)
    # alike layers make alike units: each is priced once (an 80-layer model has ~3 kinds)
    made: dict[tuple, Unit] = {}
    per_unit = []
    for i in sorted(units):
        key = (u.weights[i], u.expert_weights[i], u.grad_bytes[i], u.expert_grad_bytes[i],
               u.trainable_numel[i], u.fwd[i], u.bwd[i], u.tp_comm[i], 0 < i <= n_layers)
        found = made.get(key)
        if found is None:
            found = made[key] = _fsdp_unit(prices, u, i, copies[i], passes)
        per_unit.append(found)
    if comm_only:
        return CommTime(fsdp_comm(per_unit), 0.0)
    return fsdp_step(per_unit, overlap=overlap)


def _fsdp_unit(prices: _Collectives, u: UnitCosts, i: int, copies: tuple[float, float],
               passes: tuple[bool, bool, bool]) -> Unit:
    """Unit ``i`` in one microbatch: its gathers and reduce-scatters beside its compute."""
    gather, reduce, last = passes
    return Unit(
        gather_s=prices.dp("all_gather", u.weights[i] - u.expert_weights[i])
        + prices.edp("all_gather", u.expert_weights[i]) + prices.host(u, i) if gather else 0.0,
        reduce_s=prices.dp("reduce_scatter", u.grad_bytes[i] - u.expert_grad_bytes[i])
        + prices.edp("reduce_scatter", u.expert_grad_bytes[i]) + prices.host(u, i)
        + (prices.replica(u.grad_bytes[i]) if last else 0.0) + copies[1]
        if reduce else 0.0,
        forward_s=u.fwd[i] + u.tp_comm[i] / 2,
        backward_s=u.bwd[i] + u.tp_comm[i] / 2,
        regather=prices.setting.zero == 3 and 0 < i <= len(u.layers))
