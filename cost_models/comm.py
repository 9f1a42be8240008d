"""Collective times on a hierarchical alpha-beta model, in nccl-tests' bus-bandwidth terms.

A collective over ``n`` devices costs a number of latency hops plus its bytes at the link's
bandwidth. Link bandwidths are *bus* bandwidths, the figure nccl-tests reports, so numbers
measured by nccl-tests (or ``autopar calibrate``) drop in unchanged. nccl-tests
(PERFORMANCE.md) defines ``algbw = size / time`` and ``busbw = algbw * factor`` with the
factor that makes busbw the per-device link speed a ring algorithm needs:

=============== ============ ===========================================================
kind            factor       ``size`` (our ``nbytes``)
=============== ============ ===========================================================
all_reduce      2(n-1)/n     the reduced tensor
all_gather      (n-1)/n      the gathered output (all shards)
reduce_scatter  (n-1)/n      the input (all shards)
all_to_all      (n-1)/n      one device's input
broadcast       1            the tensor
send_recv       1            the message
=============== ============ ===========================================================

Algorithms (NCCL 2.x, ``src/graph/tuning.cc``):

- ``ring``: every collective. Latency: one hop per ring step, ``2(n-1)`` for all-reduce
  (reduce-scatter then all-gather), ``n-1`` otherwise; bandwidth: ``factor * nbytes / busbw``.
- ``tree``: all-reduce only (NCCL runs every other collective as a ring). A pipelined
  double binary tree reduces up and broadcasts down: ``2 * ceil(log2 n)`` latency hops, and
  NCCL converts tree bus bandwidth to algorithm bandwidth with a ratio of 0.5 after a 0.9
  derating, so the transfer is ``2 * nbytes / (0.9 * busbw)`` -- the ring's
  ``2(n-1)/n * nbytes / busbw`` at large ``n``, slightly slower, but with logarithmic latency.
- ``auto``: the faster of the two for all-reduce, as NCCL's tuner picks by its own model.

Which link a mesh axis uses follows from the axis order: axes are laid out outer to inner,
``tp`` innermost as in Megatron, so an innermost axis's devices are contiguous in rank order
and an outer axis's devices are strided by the product of the axes inside it. An axis whose
group spans several nodes runs :func:`hierarchical_time` when that beats a flat ring on the
inter-node link: NCCL's ring crosses each node boundary with several channels at once, so
its effective inter-node speed is the node's NICs together, which is what the hierarchical
form models by giving each of a node's devices its own share of the NICs.

>>> from autopar.core.cluster import load_cluster
>>> c = load_cluster("2x8xH100-80GB")
>>> axis_link(c, {"dp": 2, "tp": 8}, "tp") is c.intra_node
True
>>> axis_link(c, {"dp": 2, "tp": 8}, "dp") is c.inter_node
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autopar.core.cluster import Cluster, LinkSpec
from autopar.core.cluster.spec import COLLECTIVE_KINDS

KINDS = COLLECTIVE_KINDS
ALGORITHMS = ("ring", "tree", "auto")

TREE_BANDWIDTH_DERATE = 0.9
"""NCCL's tuning model derates tree bus bandwidth by 0.9 before converting it to algorithm
bandwidth (``busBw*.9`` for NCCL_ALGO_TREE in ``src/graph/tuning.cc``)."""

TREE_ALGBW_RATIO = 0.5
"""NCCL's tree algorithm bandwidth is half its bus bandwidth (``ratio = .5`` for non-ring
algorithms in ``tuning.cc``): each byte goes up the tree and back down."""


# --- The nccl-tests bandwidth convention ----------------------------------------------------
def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw for ``kind`` over ``n`` devices (nccl-tests PERFORMANCE.md).

    >>> bus_factor("all_reduce", 8), bus_factor("all_gather", 8), bus_factor("broadcast", 8)
    (1.75, 0.875, 1.0)
    """
    _check(kind)
    if kind in ("broadcast", "send_recv"):
        return 1.0
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    return 2 * frac if kind == "all_reduce" else frac


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' algbw: the collective's ``size`` over its time, in bytes/s."""
    if seconds <= 0:
        raise ValueError(f"a collective takes a positive time, got {seconds!r} s")
    return nbytes / seconds


def bus_bandwidth(kind: str, nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests' busbw of a measured collective: the per-device link speed it implies, the
    figure a cluster's links are given in.

    >>> bus_bandwidth("all_reduce", 1e9, 0.01, 8) / 1e9   # 100 GB/s algbw
    175.0
    """
    return algorithm_bandwidth(nbytes, seconds) * bus_factor(kind, n)


def algorithm_bandwidth_from_bus(kind: str, busbw: float, n: int) -> float:
    """The algbw a link of bus bandwidth ``busbw`` gives ``kind`` over ``n`` devices with the
    ring algorithm (0 when ``n`` = 1: nothing moves)."""
    factor = bus_factor(kind, n)
    return busbw / factor if factor else 0.0


# --- One collective on one link -------------------------------------------------------------
# gloo (torch.distributed on CPU) runs all-gather and reduce-scatter no faster than an
# all-reduce of the whole tensor: `autopar calibrate` on this project's CI machine fitted bus
# bandwidths of 1.56 GB/s for all-reduce but 0.78 for all-gather and 0.46 for
# reduce-scatter, i.e. the same or longer time for the same tensor. On gloo they cost what
# an all-reduce of the whole tensor costs (the link is fitted to all-reduce).
GLOO_AS_ALL_REDUCE = ("all_gather", "reduce_scatter")


def collective_time(
    kind: str, nbytes: float, n: int, link: LinkSpec, *, algorithm: str = "ring",
    backend: str = "nccl",
) -> float:
    """Seconds for ``kind`` over ``n`` devices on ``link``.

    ``nbytes`` is the size of the whole tensor: the all-reduced tensor, the all-gather's
    output, the reduce-scatter's input, the all-to-all's input on one device, the message of
    a ``send_recv`` (``n`` >= 2 means there is a peer). A kind the link has its own fit for
    (``LinkSpec.per_kind``, from a calibrated profile) is priced on that fit; otherwise
    ``backend`` "gloo" prices all-gather and reduce-scatter as all-reduces (see
    :data:`GLOO_AS_ALL_REDUCE`).

    >>> link = LinkSpec(1e9, 1e-4, per_kind={"reduce_scatter": (5e8, 1e-4)})
    >>> round(collective_time("reduce_scatter", 1e8, 2, link, backend="gloo") * 1e3, 1)
    100.1
    >>> round(collective_time("all_gather", 1e8, 2, link, backend="gloo") * 1e3, 1)
    100.2
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    fit = link.per_kind.get(kind) if link.per_kind else None
    if fit is not None:
        link = LinkSpec(*fit)
    elif backend == "gloo" and kind in GLOO_AS_ALL_REDUCE:
        kind = "all_reduce"
    if _pick(kind, algorithm) == "auto":
        return min(
            collective_time(kind, nbytes, n, link, algorithm="ring"),
            collective_time(kind, nbytes, n, link, algorithm="tree"),
        )
    return collective_latency(kind, n, link, algorithm=algorithm) + collective_transfer_time(
        kind, nbytes, n, link, algorithm=algorithm
    )


def collective_latency(kind: str, n: int, link: LinkSpec, *, algorithm: str = "ring") -> float:
    """The latency part of a collective: its hops times the link's per-hop latency
    (``algorithm`` is ``ring`` or ``tree``).

    >>> from autopar.core.cluster import LinkSpec
    >>> link = LinkSpec(1e9, 1e-5)
    >>> round(collective_latency("all_reduce", 16, link) / 1e-5)   # ring: 2(n-1) hops
    30
    >>> round(collective_latency("all_reduce", 16, link, algorithm="tree") / 1e-5)  # 2 log2 n
    8
    """
    algorithm = _split_algorithm(kind, algorithm)
    if n <= 1:
        return 0.0
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * link.latency_s
    if kind == "send_recv":
        return link.latency_s
    steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1)
    return steps * link.latency_s


def collective_transfer_time(
    kind: str, nbytes: float, n: int, link: LinkSpec, *, algorithm: str = "ring"
) -> float:
    """The bandwidth part of a collective; linear in ``nbytes``, so tensors sent together
    (a gradient bucket) cost the sum of their transfer times plus one latency."""
    algorithm = _split_algorithm(kind, algorithm)
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "tree":
        return nbytes / (TREE_ALGBW_RATIO * TREE_BANDWIDTH_DERATE * link.bandwidth_bytes_per_s)
    return bus_factor(kind, n) * nbytes / link.bandwidth_bytes_per_s


def send_recv_time(nbytes: float, link: LinkSpec) -> float:
    """Seconds to send ``nbytes`` to one peer (a pipeline stage boundary): one hop."""
    return collective_time("send_recv", nbytes, 2, link)


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def _split_algorithm(kind: str, algorithm: str) -> str:
    """``algorithm`` for the latency/transfer split, where ``auto`` has no meaning (which
    algorithm wins depends on the size: ask :func:`collective_time`)."""
    algorithm = _pick(kind, algorithm)
    if algorithm == "auto":
        raise ValueError(
            "algorithm='auto' picks by total time, so it has no separate latency or "
            "transfer part; use collective_time, or name 'ring' or 'tree'"
        )
    return algorithm


def _pick(kind: str, algorithm: str) -> str:
    """Validate ``kind`` and ``algorithm``; tree exists for all-reduce only."""
    _check(kind)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if kind != "all_reduce" and algorithm != "ring":
        if algorithm == "auto":
            return "ring"
        raise ValueError(
            f"NCCL implements the tree algorithm for all_reduce only, not {kind}; "
            "use algorithm='ring' (or 'auto')"
        )
    return algorithm


# --- Mesh axes and their links --------------------------------------------------------------
def axis_stride(mesh: Mapping[str, int], axis: str) -> int:
    """Rank distance between neighbouring members of one group of ``axis``: the product of
    the sizes of the axes inside it (``mesh`` is ordered outer to inner).

    >>> axis_stride({"pp": 2, "dp": 4, "tp": 8}, "dp"), axis_stride({"dp": 4, "tp": 8}, "tp")
    (8, 1)
    """
    names = list(mesh)
    return math.prod(mesh[name] for name in names[names.index(axis) + 1 :])


def axis_span(mesh: Mapping[str, int], axis: str) -> int:
    """Devices between the first and last member of one group of ``axis`` (contiguous ranks)."""
    return axis_stride(mesh, axis) * mesh[axis]


def axis_link(cluster: Cluster, mesh: Mapping[str, int], axis: str) -> LinkSpec:
    """The link that bounds a flat collective on ``axis`` of ``mesh`` (ordered outer to
    inner): intra-node when one group fits in a node, inter-node otherwise."""
    if mesh[axis] <= 1:
        return cluster.intra_node
    inside = axis_span(mesh, axis) <= cluster.devices_per_node
    return cluster.intra_node if inside else cluster.inter_node


def busy_latency(cluster: Cluster, mesh: Mapping[str, int], axis: str) -> float:
    """Seconds an asynchronous message on ``axis`` (a DDP bucket, an FSDP gather, a pipeline
    send) waits beyond the link's latency because every core is computing: the link's
    ``busy_latency_s`` when the node's devices are CPU processes with no spare core
    (``cores_per_node`` <= ``devices_per_node``), else 0. Blocking collectives (tensor
    parallelism) do not pay it: every rank waits for them, so their cores are free.

    >>> from autopar.core.cluster import load_cluster
    >>> c = load_cluster({"nodes": 1, "devices_per_node": 2, "cores_per_node": 2,
    ...                   "device": {"preset": "cpu"}})
    >>> busy_latency(c, {"dp": 2}, "dp") == c.intra_node.busy_latency_s > 0
    True
    >>> busy_latency(c, {"dp": 1}, "dp")
    0.0
    """
    if mesh.get(axis, 1) <= 1 or cluster.cores_per_node is None:
        return 0.0
    if cluster.cores_per_node > cluster.devices_per_node:
        return 0.0
    return axis_link(cluster, mesh, axis).busy_latency_s


@dataclass(frozen=True)
class AxisLayout:
    """How one group of a mesh axis sits on the nodes: ``per_node`` members in each of
    ``nodes`` nodes (``per_node`` = 1 when every member is in its own node, or when the
    members do not split evenly over nodes, the conservative reading)."""

    size: int
    stride: int
    per_node: int
    nodes: int


def axis_layout(mesh: Mapping[str, int], axis: str, devices_per_node: int) -> AxisLayout:
    """Where the members of one group of ``axis`` live.

    >>> axis_layout({"dp": 4, "tp": 8}, "dp", 8)      # one member per node
    AxisLayout(size=4, stride=8, per_node=1, nodes=4)
    >>> axis_layout({"dp": 16, "tp": 2}, "dp", 8)     # 4 members in each of 4 nodes
    AxisLayout(size=16, stride=2, per_node=4, nodes=4)
    >>> axis_layout({"dp": 2, "tp": 4}, "dp", 8)      # whole group in one node
    AxisLayout(size=2, stride=4, per_node=2, nodes=1)
    """
    n = mesh[axis]
    stride = axis_stride(mesh, axis)
    per_node = 1
    if stride < devices_per_node and devices_per_node % stride == 0:
        per_node = min(n, devices_per_node // stride)
        if n % per_node:
            per_node = 1
    return AxisLayout(n, stride, per_node, math.ceil(n / per_node))


def group_collective_time(
    kind: str,
    nbytes: float,
    mesh: Mapping[str, int],
    axis: str,
    cluster: Cluster,
    *,
    algorithm: str = "ring",
) -> float:
    """Seconds for ``kind`` on one group of ``axis`` of ``mesh`` (ordered outer to inner).

    A group inside one node runs on the intra-node link; a group with one member per node
    on the inter-node link. A group with several members in each of several nodes:

    - all-reduce takes the faster of a flat ring on the inter-node link and
      :func:`hierarchical_time` (NCCL's tree is reduce intra-node, all-reduce across nodes,
      broadcast intra-node, one tree pair per NIC: NVIDIA/nccl#530, #545);
    - all-gather and reduce-scatter are NCCL's flat rings (:func:`rail_ring_time`): it has no
      tree or hierarchical algorithm for them, its rings span intra- and inter-node links
      (NVIDIA/nccl#530, #1473; PAT, since 2.23, only with one GPU per node);
    - a ``send_recv`` goes between neighbouring members: across nodes once the group spans
      them.

    >>> from autopar.core.cluster import load_cluster
    >>> c = load_cluster("4x8xH100-80GB")
    >>> hier = group_collective_time("all_reduce", 1e9, {"dp": 32}, "dp", c)
    >>> hier < collective_time("all_reduce", 1e9, 32, c.inter_node)
    True
    """
    layout = axis_layout(mesh, axis, cluster.devices_per_node)
    n = layout.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if axis_span(mesh, axis) <= cluster.devices_per_node:
        return collective_time(kind, nbytes, n, cluster.intra_node, algorithm=algorithm,
                               backend=cluster.backend)
    flat = collective_time(kind, nbytes, n, cluster.inter_node, algorithm=algorithm,
                           backend=cluster.backend)
    if layout.per_node == 1 or kind == "send_recv":
        return flat
    if kind in ("all_gather", "reduce_scatter"):
        return rail_ring_time(kind, nbytes, layout.per_node, layout.nodes, cluster.intra_node,
                              cluster.inter_node)
    hier = hierarchical_time(
        kind,
        nbytes,
        layout.per_node,
        layout.nodes,
        cluster.intra_node,
        cluster.inter_node,
        algorithm=algorithm,
    )
    return min(flat, hier)


def rail_ring_time(kind: str, nbytes: float, per_node: int, nodes: int, intra: LinkSpec,
                   inter: LinkSpec) -> float:
    """Seconds for an all-gather or reduce-scatter on NCCL's rings over ``per_node * nodes``
    devices. A ring is flat: a block travels ``n - 1`` hops, ``nodes - 1`` of them between
    nodes and the rest inside one, so the latency grows with every rank. NCCL runs one ring
    per channel, and the channels cross between nodes on different NICs (one per device:
    "rails"), so a device's NVLink carries its ``(n-1)/n`` share of the data while its NIC
    carries only ``1/per_node`` of the cross-node part, and the two run at once.

    >>> from autopar.core.cluster import LinkSpec
    >>> intra, inter = LinkSpec(300e9, 3e-6), LinkSpec(25e9, 10e-6)
    >>> t = rail_ring_time("all_gather", 1e9, 8, 4, intra, inter)
    >>> round(t * 1e3, 3)   # ms: 28 x 3 + 3 x 10 us + max(31/32 GB / 300, 3/4 x 1/8 GB / 25)
    3.864
    """
    n = per_node * nodes
    hops = (n - nodes) * intra.latency_s + (nodes - 1) * inter.latency_s
    nvlink = bus_factor(kind, n) * nbytes / intra.bandwidth_bytes_per_s
    nics = bus_factor(kind, nodes) * nbytes / per_node / inter.bandwidth_bytes_per_s
    return hops + max(nvlink, nics)


def hierarchical_time(
    kind: str,
    nbytes: float,
    per_node: int,
    nodes: int,
    intra: LinkSpec,
    inter: LinkSpec,
    *,
    algorithm: str = "ring",
) -> float:
    """Seconds for ``kind`` over ``per_node * nodes`` devices done node-aware, with each of a
    node's ``per_node`` devices driving its own share of the NICs (``inter`` is per device):

    - all_reduce: intra-node reduce-scatter, inter-node all-reduce of ``1/per_node`` of the
      data (``algorithm`` applies here), intra-node all-gather;
    - all_gather: inter-node all-gather of ``1/per_node`` of the output, then intra-node;
    - reduce_scatter: intra-node, then inter-node on ``1/per_node`` of the input;
    - broadcast: across nodes, then inside each node;
    - all_to_all: no hierarchical algorithm; the direct exchange's bytes split by
      destination, ``(per_node-1)/n`` of them over NVLink and ``(nodes-1)/nodes`` over the
      NICs, both in flight at once.

    >>> from autopar.core.cluster import LinkSpec
    >>> intra, inter = LinkSpec(300e9, 3e-6), LinkSpec(25e9, 10e-6)
    >>> t = hierarchical_time("all_reduce", 1e9, 8, 4, intra, inter)
    >>> round(t * 1e3, 2)   # ms: 2 x 7/8 GB at 300 GB/s + 2 x 3/4 x 1/8 GB at 25 GB/s + hops
    13.44
    """
    _pick(kind, algorithm)
    g, nn = per_node, nodes
    shard = nbytes / g
    if kind == "all_reduce":
        return (
            collective_time("reduce_scatter", nbytes, g, intra)
            + collective_time("all_reduce", shard, nn, inter, algorithm=algorithm)
            + collective_time("all_gather", nbytes, g, intra)
        )
    if kind == "all_gather":
        return collective_time("all_gather", shard, nn, inter) + collective_time(
            "all_gather", nbytes, g, intra
        )
    if kind == "reduce_scatter":
        return collective_time("reduce_scatter", nbytes, g, intra) + collective_time(
            "reduce_scatter", shard, nn, inter
        )
    if kind == "broadcast":
        return collective_time("broadcast", nbytes, nn, inter) + collective_time(
            "broadcast", nbytes, g, intra
        )
    if kind == "all_to_all":
        n = g * nn
        local = (g - 1) / n * nbytes / intra.bandwidth_bytes_per_s
        remote = (nn - 1) / nn * nbytes / inter.bandwidth_bytes_per_s
        return (n - 1) * inter.latency_s + max(local, remote)
    return send_recv_time(nbytes, inter)
