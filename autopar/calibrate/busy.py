"""The busy latency of a CPU link: what an asynchronous message waits for a core.

On a GPU, NCCL moves data while the device computes. On CPU processes, gloo moves it with
I/O threads that need a core, and with one compute thread per process on every core they
wait for one. Measured on the project's 2-core VM, a 16 KiB all-reduce costs ~0.15-0.35 ms
between idle processes but adds 1-2 ms per step to processes that compute while it is in
flight — the gap that left DDP and pipeline plans on CPU 30-50% slower than modelled.

``busy_latency_s`` is the median over ``busy_worker.py``'s points of
``loaded - compute - idle_message``: the iteration with the message in flight, less the
compute alone and the message on idle processes. The cost model adds it to every
asynchronous message (``cost_models.comm.busy_latency``) when the node has no spare core.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from autopar.calibrate.collectives import CalibrationError, run_worker

_WORKER = Path(__file__).with_name("busy_worker.py")


def busy_latency_from(points: Iterable[Mapping[str, Any]]) -> float:
    """The busy latency the points imply (>= 0).

    >>> busy_latency_from([{"loaded_s": 3.5e-3, "compute_s": 2e-3, "idle_message_s": 2e-4},
    ...                    {"loaded_s": 6.0e-3, "compute_s": 5e-3, "idle_message_s": 2e-4}])
    0.00105
    """
    extras = [max(0.0, p["loaded_s"] - p["compute_s"] - p["idle_message_s"]) for p in points]
    if not extras:
        raise CalibrationError("no busy-latency points were measured", where="busy_worker.py",
                               fix="run autopar calibrate again")
    return round(statistics.median(extras), 9)


def measure_busy_latency(nproc: int, *, threads: int = 1, quick: bool = False,
                         timeout_s: float = 300.0) -> dict[str, Any]:
    """Launch ``nproc`` ranks with torchrun and measure; ``{"busy_latency_s", "points"}``."""
    data = run_worker(_WORKER, nproc, ["--repeats", "3" if quick else "7"], threads=threads,
                      timeout_s=timeout_s, what="the busy-latency benchmark")
    points = data["points"]
    return {"busy_latency_s": busy_latency_from(points), "world_size": data["world_size"],
            "points": points}
