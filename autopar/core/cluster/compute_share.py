"""The share of its own speed a device gets while every device of the job computes: the
wait for the slowest of the job's chips, and local CPU processes sharing the node's cores."""

from __future__ import annotations

import functools
import os
import statistics


@functools.lru_cache(maxsize=256)
def slowest_of(devices: int) -> float:
    """How many standard deviations of chip speed the slowest of ``devices`` chips falls below
    the median: the expected largest of that many standard normal draws, integrated
    numerically (n x phi(x) Phi(x)^(n-1) over x). A step of synchronous devices waits for the
    slowest (``DeviceSpec.speed_spread``); one device waits for none.

    >>> [round(slowest_of(n), 2) for n in (1, 2, 8, 128, 1024)]
    [0.0, 0.56, 1.42, 2.59, 3.25]
    """
    if devices <= 1:
        return 0.0
    normal, step = statistics.NormalDist(), 0.01
    total = 0.0
    for i in range(-1000, 1001):  # x from -10 to 10
        x = i * step
        total += x * devices * normal.pdf(x) * normal.cdf(x) ** (devices - 1) * step
    return total


def slowest_chip_delay(speed_spread: float, devices: int) -> float:
    """How much slower a step of ``devices`` synchronous chips runs than one median chip, as
    a fraction: the slowest chip's shortfall (``DeviceSpec.speed_spread`` sigmas times
    :func:`slowest_of`)."""
    return speed_spread * slowest_of(devices)


def share_of_speed(speed_spread: float, corun_slowdown: float, world_size: int,
                   devices_per_node: int, cores_per_node: int | None) -> float:
    """``DeviceSpec.compute_share`` of a cluster's devices: the wait for the slowest of
    ``world_size`` chips, and with ``cores_per_node`` each process's share of the cores
    times the slowdown of the ``min(devices, cores)`` processes computing at once."""
    share = 1.0 / (1.0 + slowest_chip_delay(speed_spread, world_size))
    if cores_per_node is not None:
        at_once = min(devices_per_node, cores_per_node)
        share *= min(1.0, cores_per_node / devices_per_node) / (
            1.0 + corun_slowdown * (at_once - 1))
    return share


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity: ``taskset`` narrows it, which
    ``os.cpu_count`` does not see): what ``cores_per_node`` of a local CPU cluster is."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1

