"""Collective times on a hierarchical alpha-beta model.

Each collective is a ring over ``n`` devices: ``steps`` latency hops plus the bytes each
device moves at the link's bus bandwidth (the nccl-tests convention, so bandwidths measured
by nccl-tests drop in unchanged). Which link a mesh axis uses follows from the mesh's axis
order: axes are laid out with the last (``tp``) innermost, so an axis whose devices all sit
in one node uses the intra-node link, and any axis that spans nodes is bound by the
inter-node link.

>>> from autopar.cluster import load_cluster
>>> c = load_cluster("2x8xH100-80GB")
>>> axis_link(c, {"dp": 2, "tp": 8}, "tp") is c.intra_node
True
>>> axis_link(c, {"dp": 2, "tp": 8}, "dp") is c.inter_node
True
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.cluster import Cluster, LinkSpec

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for a ring collective over ``n`` devices.

    ``nbytes`` is the size of the whole tensor: the all-reduced tensor, the all-gather's
    output, the reduce-scatter's input, the all-to-all's input on one device.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    return collective_latency(kind, n, link) + collective_transfer_time(kind, nbytes, n, link)


def collective_latency(kind: str, n: int, link: LinkSpec) -> float:
    """The latency part of a collective: one hop per ring step."""
    _check(kind)
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1)
    return steps * link.latency_s


def collective_transfer_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """The bandwidth part of a collective; linear in ``nbytes``, so tensors sent together
    (a gradient bucket) cost the sum of their transfer times plus one latency."""
    _check(kind)
    if n <= 1 or nbytes <= 0:
        return 0.0
    frac = (n - 1) / n
    if kind == "all_reduce":
        return 2 * frac * nbytes / link.bandwidth_bytes_per_s
    if kind == "broadcast":
        return nbytes / link.bandwidth_bytes_per_s
    return frac * nbytes / link.bandwidth_bytes_per_s


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def axis_span(mesh: Mapping[str, int], axis: str) -> int:
    """Devices between the first and last member of one group of ``axis`` (contiguous ranks)."""
    names = list(mesh)
    inner = 1
    for name in names[names.index(axis) + 1 :]:
        inner *= mesh[name]
    return inner * mesh[axis]


def axis_link(cluster: Cluster, mesh: Mapping[str, int], axis: str) -> LinkSpec:
    """The link that bounds collectives on ``axis`` of ``mesh`` (ordered outer to inner)."""
    if mesh[axis] <= 1:
        return cluster.intra_node
    return cluster.intra_node if axis_span(mesh, axis) <= cluster.devices_per_node else cluster.inter_node
