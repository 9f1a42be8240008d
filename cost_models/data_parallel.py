"""Data-parallel communication per step: DDP's bucketed all-reduce and FSDP2's per-unit
all-gathers and reduce-scatters, with the overlap each really gets (modelled).

Why per unit: a fully sharded (ZeRO-3) step is not one big all-gather. FSDP2 gathers each
``fully_shard`` unit (one transformer block, plus the root's own weights) separately before
its forward, again before its backward (``reshard_after_forward=True``), and reduce-scatters
its gradients after its backward. Every call pays a collective latency that grows with the
group (a ring has ``n - 1`` steps), so at dp = 256 and above the many small calls, not the
bytes, set the time; and overlap is bounded by the prefetch depth: the gather of unit
``i + 1`` can only hide behind unit ``i``'s compute (FSDP2 issues one all-gather ahead in
forward and, by default, one in backward -- ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` raise it). A unit whose compute is shorter than its
collectives leaves the difference exposed, however much compute the step has in total.

The recomputation forward of a checkpointed block re-uses the weights its backward gathered
(FSDP2 unshards in the pre-backward hook, and the checkpoint reruns the forward inside the
backward), so full recomputation adds no gathers under FSDP2; DeepSpeed ZeRO-3 is different
(it fetches again) and is not modelled here.

DDP (ZeRO 0) reduces the gradients in buckets of ``bucket_cap_mb`` as backward produces
them; each bucket is one collective with its own latency, and the last bucket (the first
layers' gradients) is ready only when backward ends, so it is never hidden. ZeRO 1/2 run
on FSDP2 too (``reshard_after_forward=False``, :mod:`autopar.runtime.data_parallel`), so
they are priced as FSDP2 units, gathered once per step and never regathered: a call per
unit, not per bucket (the demo GPT's five units make ten calls a step where two 25 MiB
buckets would make three, and on gloo each call costs ~1.5 ms whatever its size).

Overlap is not free: a collective kernel running beside compute takes SMs and memory
bandwidth from it. Lee et al., "Characterizing Compute-Communication Overlap in
GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114, 2025, abstract) measured
GPT and Llama training on 4 A100, H100, MI250 and MI210: compute overlapped with
communication ran **18.9% slower on average** (40% at most) than alone. So the hidden
part of the communication still costs ``OVERLAP_SLOWDOWN`` of its time
(:func:`with_contention`).

>>> units = [Unit(gather_s=1.0, reduce_s=1.0, forward_s=2.0, backward_s=4.0)] * 3
>>> round(fsdp_step(units, contention=0.0).exposed_s, 3)   # first gathers, last reduce
3.0
>>> round(fsdp_step(units).exposed_s, 3)   # the 6 s it hides slow compute by 18.9%
4.134
>>> round(fsdp_step(units, overlap=False).exposed_s, 3)   # gloo: nothing overlaps
9.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.core.cluster import DeviceSpec
from autopar.cost_models.compute import compute_share, op_time

OVERLAP_SLOWDOWN = 0.189
"""How much slower compute runs while a collective runs beside it (Lee et al. 2025, the
average over A100, H100, MI250, MI210; see the module docstring)."""


def fsdp_copies_s(gathered_bytes: float, grad_bytes: float,
                  device: DeviceSpec) -> tuple[float, float]:
    """(copy-out of one all-gather, copy-in of one reduce-scatter) of an FSDP2 unit, seconds.

    FSDP2 gathers a unit's shards into one flat buffer, then copies it out into the
    parameters' own tensors (``split_with_sizes_copy`` in ``foreach_all_gather_copy_out``, on
    the compute stream when the gather is waited for): ``gathered_bytes`` read and written.
    Before reducing, it copies the unsharded gradients into one buffer in the reduce dtype
    (``_chunk_cat`` in ``foreach_reduce``, on the reduce-scatter stream): the gradients read in
    the parameter dtype (as many bytes as the gathered weights) and ``grad_bytes`` written.
    Both are memory-bound kernels, priced as streaming ones (:func:`op_time`; no FLOPs, so
    the dtype named does not matter)."""
    copy_out = op_time(0, 2 * gathered_bytes, device, "bf16") if gathered_bytes > 0 else 0.0
    copy_in = (op_time(0, gathered_bytes + grad_bytes, device, "bf16")
               if grad_bytes > 0 else 0.0)
    return copy_out, copy_in


def fsdp_host_s(tensors: float, device: DeviceSpec) -> float:
    """Seconds of host work FSDP2 spends around one gather, and again around one
    reduce-scatter, of a unit holding ``tensors`` parameter tensors: its hooks, wrapping
    gradients as DTensors and swapping sharded and unsharded parameters, all per tensor.
    ``autopar calibrate`` measures a gather and a reduce-scatter together
    (``DeviceSpec.sharded_host_s_per_tensor``, :mod:`autopar.calibrate.sharded`); half is
    put on each (assumed, not measured apart). On a CPU this is step time, shared with the
    other processes as the device's compute is (:func:`compute_share`); GPU presets set it 0
    (the host runs ahead of the kernels)."""
    return tensors * device.sharded_host_s_per_tensor / 2 / compute_share(device)


def with_contention(comm_s: float, exposed_s: float, contention: float) -> float:
    """The step time communication adds: its exposed part, plus ``contention`` of the part
    hidden behind compute (which that compute runs slower for)."""
    if not 0.0 <= contention < 1.0:
        raise ValueError(f"contention must be in [0, 1), got {contention}")
    return exposed_s + contention * max(0.0, comm_s - exposed_s)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit on one device, per microbatch: its collectives and its compute."""

    gather_s: float  # all-gather of its weights (once for forward, once for backward)
    reduce_s: float  # reduce-scatter of its gradients after its backward
    forward_s: float
    backward_s: float  # including recomputation
    regather: bool = True  # gathered again for backward (False: kept from forward, the root)


@dataclass(frozen=True)
class CommTime:
    """Seconds of data-parallel communication per step, and the part that is not hidden."""

    comm_s: float
    exposed_s: float


def fsdp_comm(units: Sequence[Unit]) -> float:
    """Seconds of one microbatch's FSDP2 collectives, overlapped or not."""
    return sum(u.gather_s * (2 if u.regather else 1) + u.reduce_s for u in units)


def fsdp_step(units: Sequence[Unit], *, prefetch: int = 1, overlap: bool = True,
              contention: float = OVERLAP_SLOWDOWN) -> CommTime:
    """One microbatch's FSDP2 collectives on a timeline of two resources, compute and the
    communication stream (collectives run one at a time, in the order issued).

    Forward runs the units in order: unit ``i`` starts when its gather has finished and unit
    ``i - 1`` has; the gather of unit ``i + prefetch`` is issued when unit ``i`` starts.
    Backward runs them in reverse, re-gathering each (``regather``), issuing the gather
    ``prefetch`` units ahead and each reduce-scatter when the unit's backward ends. The step's
    communication is done when the last reduce-scatter is. ``overlap=False`` (gloo on CPU,
    whose collectives use the cores that compute) serializes everything. The exposed time
    includes ``contention`` of the hidden time (:func:`with_contention`).
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    compute = sum(u.forward_s + u.backward_s for u in units)
    comm = fsdp_comm(units)
    if not units:
        return CommTime(0.0, 0.0)
    if not overlap:
        return CommTime(comm, comm)
    n = len(units)
    clock = {"comm": 0.0, "compute": 0.0}

    def collective(seconds: float, ready: float) -> float:
        clock["comm"] = max(clock["comm"], ready) + seconds
        return clock["comm"]

    # forward
    gathered = [0.0] * n
    issued = 0
    for i in range(min(n, prefetch + 1)):
        gathered[i] = collective(units[i].gather_s, 0.0)
        issued = i + 1
    for i, u in enumerate(units):
        start = max(gathered[i], clock["compute"])
        while issued < n and issued <= i + prefetch:
            gathered[issued] = collective(units[issued].gather_s, start)
            issued += 1
        clock["compute"] = start + u.forward_s
    # backward, last unit first
    order = list(range(n - 1, -1, -1))
    ready = {i: clock["compute"] for i in order}  # a kept (root) unit is ready at once
    issued = 0
    for j in range(min(n, prefetch + 1)):
        i = order[j]
        if units[i].regather:
            ready[i] = collective(units[i].gather_s, clock["compute"])
        issued = j + 1
    done = clock["compute"]
    for j, i in enumerate(order):
        start = max(ready[i], clock["compute"])
        while issued < n and issued <= j + prefetch:
            k = order[issued]
            if units[k].regather:
                ready[k] = collective(units[k].gather_s, start)
            issued += 1
        clock["compute"] = start + units[i].backward_s
        done = collective(units[i].reduce_s, clock["compute"])
    end = max(done, clock["compute"])
    return CommTime(comm, with_contention(comm, max(0.0, end - compute), contention))


def bucketed_step(bucket_s: Sequence[float], backward_s: float, *, overlap: bool = True,
                  contention: float = OVERLAP_SLOWDOWN) -> CommTime:
    """Gradient buckets reduced as backward produces them (DDP, ZeRO 1/2): bucket ``k`` of
    ``b`` is ready after ``(k + 1) / b`` of the backward (gradients arrive at an even rate),
    and the buckets' collectives run one at a time; the hidden ones slow the backward by
    ``contention`` of their time (:func:`with_contention`).

    >>> round(bucketed_step([1.0, 1.0], 4.0, contention=0.0).exposed_s, 3)   # the last bucket
    1.0
    """
    comm = float(sum(bucket_s))
    if not bucket_s:
        return CommTime(0.0, 0.0)
    if not overlap:
        return CommTime(comm, comm)
    b = len(bucket_s)
    clock = 0.0
    for k, seconds in enumerate(bucket_s):
        clock = max(clock, backward_s * (k + 1) / b) + seconds
    return CommTime(comm, with_contention(comm, max(0.0, clock - backward_s), contention))
