"""Part of a cluster: the first devices of it, as the planner tries fewer devices."""

from __future__ import annotations

import dataclasses

from autopar.core.cluster.spec import Cluster


def sub_cluster(cluster: Cluster, devices: int) -> Cluster:
    """The first ``devices`` devices of ``cluster``: whole nodes, or part of the first one."""
    if devices >= cluster.devices_per_node:
        shape = (devices // cluster.devices_per_node, cluster.devices_per_node)
    else:
        shape = (1, devices)
    if shape == (cluster.nodes, cluster.devices_per_node):
        return cluster
    return dataclasses.replace(cluster, nodes=shape[0], devices_per_node=shape[1])
