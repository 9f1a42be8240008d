"""Calibration: measure this machine and write a profile the cost models can trust.

    autopar calibrate --out cpu-profile.json            # a few minutes
    autopar calibrate --quick --out cpu-profile.json    # under a minute
    autopar calibrate --from-run runs/today --out cpu-profile.json   # refit from training

measures one device (``matmul``: matmul rates by size, elementwise bandwidth, per-op floor)
and the collectives between ``--nproc`` local processes (``collectives``: gloo on CPU, NCCL
on GPUs, fitted to the ring model; on CPU also ``busy``: what an asynchronous message waits
for a core while every process computes; ``corun``: how much slower a training step runs
while the other cores train too; ``sharded``: FSDP2's host work per parameter tensor), and
writes them as a profile (``autopar.core.cluster.profile``). A cluster file then says ``profile: cpu-profile.json`` and its
device and intra-node link take the measured numbers over the preset's.

``--from-run`` measures nothing itself: it refits the device speed and the link to the step
times and collectives a real training run recorded (``ParallelModule.record_run``), by
least squares of the cost model's own terms (``autopar.calibrate.from_run``).
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import torch

from autopar.calibrate.busy import busy_latency_from, measure_busy_latency
from autopar.calibrate.collectives import (
    KINDS,
    LINK_KIND,
    CalibrationError,
    CollectivePoint,
    LinkFit,
    collective_sizes,
    fit_link,
    measure_collectives,
    ring_factors,
)
from autopar.calibrate.corun import corun_slowdown_from, measure_corun
from autopar.calibrate.device_fit import DeviceCalibration, efficiency_curve
from autopar.calibrate.matmul import calibrate_device
from autopar.calibrate.sharded import (
    format_sharded_host,
    measure_sharded_host,
    sharded_host_from,
)
from autopar.core.cluster.profile import Profile

__all__ = [
    "KINDS",
    "LINK_KIND",
    "CalibrationError",
    "CollectivePoint",
    "DeviceCalibration",
    "LinkFit",
    "calibrate_device",
    "collective_sizes",
    "busy_latency_from",
    "corun_slowdown_from",
    "format_sharded_host",
    "measure_sharded_host",
    "sharded_host_from",
    "measure_corun",
    "efficiency_curve",
    "fit_link",
    "host_info",
    "make_profile",
    "measure_busy_latency",
    "measure_collectives",
    "ring_factors",
]


def host_info(device_type: str, nproc: int, threads: int, quick: bool) -> dict[str, Any]:
    """What the numbers were measured on, so a profile is never mistaken for another host's."""
    if device_type == "cuda":
        device_name, backend = torch.cuda.get_device_name(), "nccl"
    else:
        device_name, backend = _cpu_name(), "gloo"
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count() or 1,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "device_type": device_type,
        "device_name": device_name,
        "backend": backend,
        "nproc": nproc,
        "threads_per_process": threads,
        "quick": quick,
    }


def make_profile(
    device: DeviceCalibration,
    points: Sequence[CollectivePoint],
    host: dict[str, Any],
    busy: dict[str, Any] | None = None,
    uncontended: tuple[Sequence[CollectivePoint], dict[str, Any] | None] | None = None,
    corun: dict[str, Any] | None = None,
    sharded: dict[str, Any] | None = None,
) -> Profile:
    """The profile for these measurements: the device section, and the intra-node link
    fitted to the all-reduce points, with each other collective's own fit as its
    ``per_kind`` (which the cost model prices that collective on; ``LinkSpec.per_kind``),
    with the busy latency ``busy`` measured (:func:`measure_busy_latency`), if any.
    ``uncontended``: the points and busy latency measured again with as many processes as
    cores, when ``points`` had more (``Cluster.intra_node_uncontended``). ``corun``: the
    co-run slowdown measured on training steps (:func:`measure_corun`), if any. ``sharded``:
    FSDP2's host work per parameter tensor (:func:`measure_sharded_host`), if any."""
    link = fit_link(p for p in points if p.kind == LINK_KIND)
    fits = {
        kind: fit_link(p for p in points if p.kind == kind)
        for kind in KINDS
        if len({p.nbytes for p in points if p.kind == kind}) >= 2
    }
    per_kind = {kind: fit.as_dict() for kind, fit in fits.items()}
    measurements = device.measurements()
    measurements["collectives"] = {
        "world_size": points[0].world_size,
        "points": [
            {
                "kind": p.kind,
                "bytes": p.nbytes,
                "seconds": p.seconds,
                "bus_bytes_per_s": p.bus_bandwidth,
                "predicted_seconds": link.predict(p.kind, p.nbytes, p.world_size),
            }
            for p in points
        ],
        "link_fitted_to": LINK_KIND,
        "fit": link.as_dict(),
        "fit_per_kind": per_kind,
    }
    if busy:
        measurements["busy_latency"] = busy
    profile_device = device.profile_device()
    if corun:
        measurements["corun"] = corun
        profile_device["corun_slowdown"] = corun["corun_slowdown"]
    if sharded:
        measurements["sharded_host"] = sharded
        for key in ("sharded_host_s_per_tensor", "sharded_optimizer_s_per_tensor"):
            profile_device[key] = sharded[key]
    intra = _link_section(link, busy)
    own = {kind: _link_section(fit, None) for kind, fit in fits.items() if kind != LINK_KIND}
    if own:
        intra["per_kind"] = own
    links = {"intra_node_link": intra}
    if uncontended is not None:
        few_points, few_busy = uncontended
        few = fit_link(p for p in few_points if p.kind == LINK_KIND)
        measurements["collectives_uncontended"] = {
            "world_size": few_points[0].world_size,
            "points": [{"kind": p.kind, "bytes": p.nbytes, "seconds": p.seconds}
                       for p in few_points],
            "fit": few.as_dict(),
            **({"busy_latency": few_busy} if few_busy else {}),
        }
        links["intra_node_link_uncontended"] = _link_section(few, few_busy)
    return Profile(
        device=profile_device,
        **links,
        host=host,
        measurements=measurements,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _link_section(link: LinkFit, busy: dict[str, Any] | None) -> dict[str, float]:
    return {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s,
            **({"busy_latency_s": busy["busy_latency_s"]} if busy else {})}


def _cpu_name() -> str:
    """The CPU model ("Intel(R) Xeon(R) ..."), which ``platform`` does not give on Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
