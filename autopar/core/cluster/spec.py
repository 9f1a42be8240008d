"""The cluster types: devices, links and the cluster, validated on creation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from autopar.core.cluster.checks import (
    _check,
    _check_backend,
    _check_curve,
    _check_dtype,
    _check_op_rates,
    _check_text,
    _FrozenMap,
    check_size,
    dtype_key,
)
from autopar.core.cluster.compute_share import share_of_speed
from autopar.core.cluster.presets import (
    DEFAULT_ATTENTION_EFFICIENCY,
    DEFAULT_KERNEL_FLOOR_S,
    DEFAULT_MEMORY_EFFICIENCY,
    DTYPES,
)
from autopar.core.errors import ClusterError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceSpec:
    """One device: the numbers the compute and memory models divide by.

    ``matmul_efficiency`` is the fraction of ``peak_flops`` a large GEMM reaches.
    ``matmul_efficiency_curve`` refines it by size: ``(flops per matmul call, fraction of
    peak)`` points with rising FLOPs, as calibration measures them (empty: the compute model
    uses its parametric curve). ``memory_efficiency`` is the fraction of
    ``memory_bandwidth_bytes_per_s`` elementwise kernels reach, and ``kernel_floor_s`` the
    time no kernel (op) beats, however small: launch plus tail on a GPU, dispatch on a CPU.
    ``attention_efficiency`` is the share of the matmul rate fused attention reaches on the
    tiles it runs (a property of the attention kernel too: see ``core/cluster/presets.py``).
    """

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float
    kernel_floor_s: float = DEFAULT_KERNEL_FLOOR_S
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    matmul_efficiency_curve: tuple[tuple[float, float], ...] = ()
    attention_efficiency: float = DEFAULT_ATTENTION_EFFICIENCY
    # ``attention_efficiency`` by size, as calibration measures it: (FLOPs of the score
    # matmul per call, efficiency) points with rising FLOPs; empty: the one figure above. A
    # CPU's flash kernel at a short sequence reaches less of the matmul rate than at 1024.
    attention_efficiency_curve: tuple[tuple[float, float], ...] = ()
    # Seconds per byte of writing a freshly allocated large tensor (first-touch page faults):
    # 0 on GPUs, whose caching allocator reuses memory; measured on CPUs, where glibc maps
    # tensors above its mmap threshold fresh from the OS each time.
    allocation_s_per_byte: float = 0.0
    # How much slower each further process computing at once makes a process's training
    # step, as a fraction of its step alone (linear in the processes): CPU processes share
    # caches, memory bandwidth and the hypervisor's vCPUs. 0 for GPUs; measured on CPUs by
    # ``autopar calibrate`` (:mod:`autopar.calibrate.corun`).
    corun_slowdown: float = 0.0
    # How much of an op's memory traffic runs under its arithmetic: 1 on GPUs, whose warps
    # hide memory latency behind other warps' math (the roofline, Williams et al. 2009:
    # time = max(compute, memory)); less on a CPU core, where a GEMM packs its operands
    # (memory-bound) before its micro-kernel computes on them, one after the other (Goto &
    # van de Geijn 2008): time = max + (1 - overlap) * min. Fitted by ``autopar calibrate``
    # from matmuls too skinny for their arithmetic to hide their traffic.
    memory_overlap: float = 1.0
    # The share of bf16's matmul efficiency an fp8 matmul (``torch._scaled_mm``, cuBLASLt)
    # reaches at the same shape: fp8 GEMMs fall further short of their datasheet peak. 1
    # where unmeasured; Hopper presets carry an H200's measurement (``core/cluster/presets.py``).
    fp8_matmul_efficiency: float = 1.0
    # autopar's generated attention kernels (``autopar.kernels``, Triton), which the program
    # runs at every fused attention site on a GPU, against the kernel ``attention_efficiency``
    # describes (SDPA's flash backend in the presets): their speed relative to it in the
    # forward and the backward pass. 1 where unmeasured; Hopper presets carry an H100's
    # measurement (``core/cluster/presets.py``).
    generated_attention_forward: float = 1.0
    generated_attention_backward: float = 1.0
    # How much the speed of devices of this kind varies from one chip to the next (the
    # coefficient of variation: manufacturing spread under each chip's power management). A
    # synchronous step runs at its slowest device's pace, so a cluster of N runs slower than
    # one median chip (``slowest_of``). 0 where every device is the same chip (CPU
    # processes on one machine); GPU presets carry a fleet measurement (``presets.py``).
    speed_spread: float = 0.0
    # The share of its own speed a device gets while every device of the job computes: CPU
    # processes outnumbering cores (``Cluster.cores_per_node``, with ``corun_slowdown``),
    # and the wait for the slowest of the job's devices (``speed_spread``). Set by
    # ``Cluster``; every device time term is divided by it.
    compute_share: float = 1.0
    # Host work FSDP2 adds per parameter tensor per step, beyond its collectives and copies
    # (its hooks, DTensor wrapping, parameter swaps; one gather and one reduce-scatter), and
    # what the optimizer spends per parameter tensor stepping DTensor shards over plain
    # tensors. 0 for GPUs: their host runs ahead of their kernels, so its work hides while a
    # step is device-bound (what the GPU rows measure). Measured on CPUs, where the host is
    # the device, by ``autopar calibrate`` (:mod:`autopar.calibrate.sharded`).
    sharded_host_s_per_tensor: float = 0.0
    sharded_optimizer_s_per_tensor: float = 0.0
    # Seconds per output element of ops whose arithmetic, not their memory traffic, bounds
    # them on this device, forward and backward, by aten name: {"gelu": (fwd, bwd)}. On a CPU
    # core GELU's erf, softmax's exponentials and a norm's reductions run several times
    # longer per element than the bandwidth an add reaches; a GPU hides them under memory
    # (empty there: the roofline prices them). Measured by ``autopar calibrate``.
    op_s_per_element: Mapping[str, tuple[float, float]] = field(default_factory=lambda: _FrozenMap())
    # Seconds an op that runs no kernel costs per pass (a view, a transpose; forward, and
    # its backward node under autograd): dispatch and autograd's bookkeeping. 0 for GPUs,
    # whose host runs ahead of the kernels; measured on CPUs (a few µs each, and a traced
    # transformer layer has dozens).
    view_s: float = 0.0

    def __post_init__(self) -> None:
        _check_text(self.name, "name", "DeviceSpec.name")
        _check("bytes", self.memory_bytes, "memory_bytes", "DeviceSpec.memory_bytes")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ClusterError(
                f"peak_flops must be a non-empty mapping, got {self.peak_flops!r}",
                where="DeviceSpec.peak_flops",
                fix=f"give FLOP/s for at least one of {', '.join(DTYPES)}",
            )
        for key, value in self.peak_flops.items():
            _check_dtype(key, f"DeviceSpec.peak_flops.{key}")
            _check("positive", value, f"peak_flops.{key}", f"DeviceSpec.peak_flops.{key}")
        ordered = {k: self.peak_flops[k] for k in DTYPES if k in self.peak_flops}
        object.__setattr__(self, "peak_flops", _FrozenMap(ordered))
        _check(
            "positive",
            self.memory_bandwidth_bytes_per_s,
            "memory_bandwidth_bytes_per_s",
            "DeviceSpec.memory_bandwidth_bytes_per_s",
        )
        _check(
            "fraction", self.matmul_efficiency, "matmul_efficiency", "DeviceSpec.matmul_efficiency"
        )
        _check("nonnegative", self.kernel_floor_s, "kernel_floor_s", "DeviceSpec.kernel_floor_s")
        _check("nonnegative", self.allocation_s_per_byte, "allocation_s_per_byte",
               "DeviceSpec.allocation_s_per_byte")
        _check(
            "fraction", self.memory_efficiency, "memory_efficiency", "DeviceSpec.memory_efficiency"
        )
        _check("nonnegative", self.corun_slowdown, "corun_slowdown",
               "DeviceSpec.corun_slowdown")
        _check("share", self.memory_overlap, "memory_overlap", "DeviceSpec.memory_overlap")
        _check("share", self.speed_spread, "speed_spread", "DeviceSpec.speed_spread")
        _check("fraction", self.fp8_matmul_efficiency, "fp8_matmul_efficiency",
               "DeviceSpec.fp8_matmul_efficiency")
        for field_name in ("generated_attention_forward", "generated_attention_backward"):
            _check("positive", getattr(self, field_name), field_name,
                   f"DeviceSpec.{field_name}")
        for field_name in ("sharded_host_s_per_tensor", "sharded_optimizer_s_per_tensor",
                           "view_s"):
            _check("nonnegative", getattr(self, field_name), field_name,
                   f"DeviceSpec.{field_name}")
        _check("fraction", self.compute_share, "compute_share", "DeviceSpec.compute_share")
        object.__setattr__(self, "op_s_per_element", _check_op_rates(
            self.op_s_per_element, "op_s_per_element", "DeviceSpec.op_s_per_element"))
        _check("fraction", self.attention_efficiency, "attention_efficiency",
               "DeviceSpec.attention_efficiency")
        curve = _check_curve(
            self.matmul_efficiency_curve,
            "matmul_efficiency_curve",
            "DeviceSpec.matmul_efficiency_curve",
        )
        object.__setattr__(self, "matmul_efficiency_curve", curve)
        object.__setattr__(self, "attention_efficiency_curve", _check_curve(
            self.attention_efficiency_curve, "attention_efficiency_curve",
            "DeviceSpec.attention_efficiency_curve"))

    def peak(self, dtype: str | torch.dtype) -> float:
        """Dense peak FLOP/s in ``dtype``; an unsupported dtype is an error, never a guess."""
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            raise ClusterError(
                f"device {self.name} does not support {key} (no peak FLOP/s for it)",
                where=f"device.peak_flops.{key}",
                fix=f"use one of the dtypes it supports: {', '.join(self.peak_flops)}; or add "
                f"{key} under device.peak_tflops in a cluster file",
            )
        return self.peak_flops[key]


@dataclass(frozen=True)
class LinkSpec:
    """A link as collectives see it: per-device, one-direction bus bandwidth, and latency.

    ``busy_latency_s`` is what an *asynchronous* message (a DDP gradient bucket, an FSDP
    gather, a pipeline send) waits on top of ``latency_s`` while every core of the node
    computes: gloo moves CPU tensors with its own I/O threads, which must take a core that a
    training process's compute thread holds. It is 0 on GPUs (NCCL's progress does not wait
    for the host) and measured by ``autopar calibrate`` on CPUs. Blocking collectives, where
    every rank waits (tensor parallelism), do not pay it: their cores are free.

    ``per_kind``: collective kind -> (bus bandwidth, per-hop latency) fitted to that kind's
    own measurements (``autopar calibrate`` writes them from a profile's points), which
    price it instead of the link's all-reduce fit: gloo's reduce-scatter, for one, takes
    1.7-2.5x an all-reduce of the same tensor.

    >>> LinkSpec(1e9, 1e-4, per_kind={"reduce_scatter": (4e8, 2e-4)}).per_kind["reduce_scatter"]
    (400000000.0, 0.0002)
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    busy_latency_s: float = 0.0
    per_kind: Mapping[str, tuple[float, float]] = field(default_factory=lambda: _FrozenMap())

    def __post_init__(self) -> None:
        _check(
            "positive",
            self.bandwidth_bytes_per_s,
            "bandwidth_bytes_per_s",
            "LinkSpec.bandwidth_bytes_per_s",
        )
        _check("nonnegative", self.latency_s, "latency_s", "LinkSpec.latency_s")
        _check("nonnegative", self.busy_latency_s, "busy_latency_s", "LinkSpec.busy_latency_s")
        object.__setattr__(self, "per_kind", _FrozenMap(_per_kind(self.per_kind,
                                                                  "LinkSpec.per_kind")))


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of identical devices; ``sources`` says where each value came from.

    ``cores_per_node``: the node's devices share this many compute units, as local CPU
    processes (one thread each) share the machine's cores. With more devices than cores each
    gets ``cores / devices`` of its speed, and the ``min(devices, cores)`` processes computing
    at once slow each other by ``device.corun_slowdown`` per further process: together
    ``device.compute_share``. A plan on fewer devices of the node (``sub_cluster``) gets
    more. None: every device computes on its own (GPUs).

    ``compute_share`` also holds the wait for the slowest of the cluster's devices: a step
    of ``world_size`` synchronous devices runs ``device.speed_spread * slowest_of(world_size)``
    slower than one median chip (GPU fleets: ~2% at 8, ~5% at 1,024; none on one device).

    ``intra_node_uncontended``: the intra-node link when the node runs no more processes than
    it has cores (``autopar calibrate --nproc N`` measures it too when N is more than the
    cores). gloo's messages wait for the scheduler while processes outnumber cores, so a
    CPU cluster's link is slower with 4 processes on 2 cores than with 2; a cluster (or a
    ``sub_cluster``) of at most ``cores_per_node`` devices uses it as ``intra_node``.

    >>> Cluster(1, 4, DeviceSpec("cpu", 2**30, {"fp32": 1e11}, 1e10, 1.0), LinkSpec(1e9, 1e-4),
    ...         LinkSpec(1e9, 1e-4), cores_per_node=2).device.compute_share
    0.5
    """

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    name: str = ""
    backend: str = "nccl"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    cores_per_node: int | None = None
    intra_node_uncontended: LinkSpec | None = None
    # What plans for this cluster must obey, as constraint texts (``autopar.core.constraints``;
    # a cluster file's ``constraints:``): a policy of the site, not a fact of the hardware,
    # so clusters compare equal without them.
    constraints: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        _check("count", self.nodes, "nodes", "Cluster.nodes")
        _check("count", self.devices_per_node, "devices_per_node", "Cluster.devices_per_node")
        if self.cores_per_node is not None:
            _check("count", self.cores_per_node, "cores_per_node", "Cluster.cores_per_node")
        check_size(self.nodes, self.devices_per_node, lambda key: f"Cluster.{key}")
        for attr, cls in (
            ("device", DeviceSpec),
            ("intra_node", LinkSpec),
            ("inter_node", LinkSpec),
        ):
            if not isinstance(getattr(self, attr), cls):
                raise ClusterError(
                    f"{attr} must be a {cls.__name__}, got {type(getattr(self, attr)).__name__}",
                    where=f"Cluster.{attr}",
                    fix=f"pass a {cls.__name__}, or build the cluster with load_cluster()",
                )
        uncontended = self.intra_node_uncontended
        if uncontended is not None and not isinstance(uncontended, LinkSpec):
            raise ClusterError(
                f"intra_node_uncontended must be a LinkSpec or None, got "
                f"{type(uncontended).__name__}",
                where="Cluster.intra_node_uncontended",
                fix="pass a LinkSpec, or build the cluster with load_cluster()",
            )
        share = share_of_speed(self.device.speed_spread, self.device.corun_slowdown,
                               self.world_size, self.devices_per_node, self.cores_per_node)
        if (self.cores_per_node is not None and uncontended is not None
                and self.devices_per_node <= self.cores_per_node):
            object.__setattr__(self, "intra_node", uncontended)
        if self.device.compute_share != share:
            object.__setattr__(self, "device", replace(self.device, compute_share=share))
        _check_text(self.name, "name", "Cluster.name", empty_ok=True)
        _check_backend(self.backend, "Cluster.backend")
        if not isinstance(self.sources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()
        ):
            raise ClusterError(
                "sources must map field names to strings",
                where="Cluster.sources",
                fix="e.g. {'device.memory_bytes': 'preset H100-80GB'}",
            )
        object.__setattr__(self, "sources", _FrozenMap(self.sources))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, in base units; ``load_cluster(c.to_dict()) == c``, sources included."""
        d = self.device
        cores = {} if self.cores_per_node is None else {"cores_per_node": self.cores_per_node}
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            **cores,
            "backend": self.backend,
            "device": {
                "name": d.name,
                "memory_bytes": d.memory_bytes,
                "peak_flops": dict(d.peak_flops),
                "memory_bandwidth_bytes_per_s": d.memory_bandwidth_bytes_per_s,
                "matmul_efficiency": d.matmul_efficiency,
                "matmul_efficiency_curve": [list(p) for p in d.matmul_efficiency_curve],
                "kernel_floor_s": d.kernel_floor_s,
                "memory_efficiency": d.memory_efficiency,
                "attention_efficiency": d.attention_efficiency,
                "attention_efficiency_curve": [list(p) for p in d.attention_efficiency_curve],
                "allocation_s_per_byte": d.allocation_s_per_byte,
                "corun_slowdown": d.corun_slowdown,
                "memory_overlap": d.memory_overlap,
                "fp8_matmul_efficiency": d.fp8_matmul_efficiency,
                "generated_attention_forward": d.generated_attention_forward,
                "generated_attention_backward": d.generated_attention_backward,
                "sharded_host_s_per_tensor": d.sharded_host_s_per_tensor,
                "sharded_optimizer_s_per_tensor": d.sharded_optimizer_s_per_tensor,
                "op_s_per_element": {op: list(r) for op, r in d.op_s_per_element.items()},
                "view_s": d.view_s,
                "speed_spread": d.speed_spread,
            },
            "intra_node_link": _link_dict(self.intra_node),
            "inter_node_link": _link_dict(self.inter_node),
            **({"intra_node_link_uncontended": _link_dict(self.intra_node_uncontended)}
               if self.intra_node_uncontended is not None else {}),
            "sources": dict(self.sources),
        }


def _link_dict(link: LinkSpec) -> dict[str, Any]:
    per_kind = {kind: {"bandwidth_bytes_per_s": bw, "latency_s": lat}
                for kind, (bw, lat) in link.per_kind.items()}
    return {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s,
            "busy_latency_s": link.busy_latency_s, **({"per_kind": per_kind} if per_kind else {})}


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                    "send_recv")
"""The collectives the communication cost model prices (``cost_models.comm.KINDS``)."""


def _per_kind(data: Any, where: str) -> dict[str, tuple[float, float]]:
    """A link's per-kind fits, checked: kind -> (bus bandwidth > 0, latency >= 0)."""
    if not isinstance(data, Mapping):
        raise ClusterError(f"per_kind must map collective kinds to (bandwidth, latency), got "
                           f"{type(data).__name__}", where=where,
                           fix='e.g. {"reduce_scatter": (4e8, 2e-4)}')
    out = {}
    for kind, fit in data.items():
        if kind not in COLLECTIVE_KINDS:
            raise ClusterError(f"unknown collective kind {kind!r} in per_kind",
                               where=f"{where}.{kind}",
                               fix=f"use kinds among {', '.join(COLLECTIVE_KINDS)}")
        if not isinstance(fit, (tuple, list)) or len(fit) != 2:
            raise ClusterError(f"per_kind.{kind} must be (bandwidth bytes/s, latency s), got "
                               f"{fit!r}", where=f"{where}.{kind}",
                               fix="give two numbers: the kind's bus bandwidth and latency")
        _check("positive", fit[0], f"per_kind.{kind} bandwidth", f"{where}.{kind}")
        _check("nonnegative", fit[1], f"per_kind.{kind} latency", f"{where}.{kind}")
        out[kind] = (float(fit[0]), float(fit[1]))
    return out
