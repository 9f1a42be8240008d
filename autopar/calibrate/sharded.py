"""FSDP2's host work on a CPU: what sharded data parallelism costs beyond its messages.

On a CPU the host is the device, so the Python FSDP2 runs around every unit (pre-forward
and post-backward hooks, wrapping gradients as DTensors, swapping sharded and unsharded
parameters) and the optimizer's dispatch over DTensor shards are step time. On the
project's 2-core VM they made ZeRO-1, 2 and 3 90-100 ms slower a step than DDP on the demo
GPT (``benchmarks/cpu_step_parts.py``), where their collectives and copies account for a
third of it. (On a GPU the host runs ahead of the kernels and this work hides while the
step is device-bound; GPU presets leave it 0.)

``sharded_worker.py`` times, on ``processes`` gloo ranks, a small transformer trained plain,
under FSDP2 as ZeRO-1/2 run it, and FSDP2's data movement alone (see its docstring). Per
parameter tensor and step:

- ``sharded_host_s_per_tensor = (sharded - plain - bare) / tensors`` for forward + backward;
- ``sharded_optimizer_s_per_tensor = (sharded - bare) / tensors`` for the AdamW step (the
  bare optimizer steps plain tensors shaped as this rank's shards).

Both are measured with one process per core, all training at once. The cost model divides
them by the device's compute share, as every device time: that prices processes outnumbering
the cores (time-sliced), and counts the co-run slowdown a second time (a few percent on the
project's VMs: measured 1.03-1.07x).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autopar.calibrate.collectives import CalibrationError, run_worker

_WORKER = Path(__file__).with_name("sharded_worker.py")


def sharded_host_from(measured: Mapping[str, Any]) -> dict[str, float]:
    """The two per-tensor costs the worker's medians imply (seconds, never negative).

    >>> sharded_host_from({"tensors": 50, "plain_s": 0.040, "sharded_s": 0.090,
    ...                    "bare_s": 0.030, "sharded_optimizer_s": 0.035,
    ...                    "bare_optimizer_s": 0.005})
    {'sharded_host_s_per_tensor': 0.0004, 'sharded_optimizer_s_per_tensor': 0.0006}
    """
    tensors = int(measured["tensors"])
    if tensors <= 0:
        raise CalibrationError("the sharded benchmark counted no parameter tensors",
                               where="sharded_worker.py", fix="report this as a bug")
    host = measured["sharded_s"] - measured["plain_s"] - measured["bare_s"]
    optimizer = measured["sharded_optimizer_s"] - measured["bare_optimizer_s"]
    return {"sharded_host_s_per_tensor": round(max(0.0, host) / tensors, 7),
            "sharded_optimizer_s_per_tensor": round(max(0.0, optimizer) / tensors, 7)}


def measure_sharded_host(processes: int, *, threads: int = 1, quick: bool = False,
                         timeout_s: float = 600.0) -> dict[str, Any]:
    """Launch ``processes`` gloo ranks and measure; the worker's medians (measured) and the
    per-tensor costs they imply (:func:`sharded_host_from`)."""
    if processes < 2:
        raise CalibrationError(
            f"FSDP2's host work needs 2 processes or more, got {processes}",
            where="measure_sharded_host", fix="measure with --nproc 2 or more")
    rounds, steps = (3, 6) if quick else (5, 10)
    measured = run_worker(_WORKER, processes, ["--rounds", str(rounds), "--steps", str(steps)],
                          threads=threads, timeout_s=timeout_s,
                          what="the FSDP2 host-work benchmark")
    return {**sharded_host_from(measured), "measured": measured}


def format_sharded_host(sharded: Mapping[str, Any]) -> str:
    """The per-tensor costs with the step times they came from (measured)."""
    m = sharded["measured"]
    ms = 1e3
    return (f"\nFSDP2 host work (measured: {m['world_size']} processes, a {m['blocks']}-layer "
            f"transformer, {m['tensors']} parameter tensors in {m['units']} units)\n"
            f"  forward + backward: plain {m['plain_s'] * ms:.1f} ms, FSDP2 "
            f"{m['sharded_s'] * ms:.1f} ms, its collectives and copies alone "
            f"{m['bare_s'] * ms:.1f} ms -> "
            f"{sharded['sharded_host_s_per_tensor'] * 1e6:.0f} µs per tensor a step\n"
            f"  AdamW: over DTensor shards {m['sharded_optimizer_s'] * ms:.1f} ms, over plain "
            f"shards {m['bare_optimizer_s'] * ms:.1f} ms -> "
            f"{sharded['sharded_optimizer_s_per_tensor'] * 1e6:.0f} µs per tensor")
