"""The co-run slowdown of a CPU: what a training step loses while the other cores train too.

Local CPU processes (one thread each, one per core) share more than cores: caches, memory
bandwidth, the hypervisor's scheduling of the VM's vCPUs. Matmul, elementwise and small-op
microbenchmarks barely show it (0.84-1.16x when two run at once on the project's 2-core
VMs), yet a small GPT's training step ran 1.45x slower per process beside a second one on
one such VM (Intel Xeon) and 1.07x on another (AMD EPYC), both measured with
``benchmarks/cpu_step_parts.py``. So it is measured here on training steps, not predicted
from microbenchmarks, and it differs by machine enough that no preset can stand for it.

Each of ``processes`` spawned processes trains its own small transformer (two sizes) in
alternating rounds: *alone* (each process in turn while the others wait at a barrier)
and *together* (all at once). The VM's drift falls on both within a round, so each round's
``together / alone`` is one sample; the median over rounds, sizes and processes is the
slowdown ``r`` with ``processes`` computing. The cost model takes it as linear in the
processes computing at once: ``corun_slowdown = (r - 1) / (processes - 1)`` per further
process (``DeviceSpec.corun_slowdown``; measured at ``processes``, extrapolated beyond).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from autopar.calibrate.collectives import CalibrationError

SIZES = ((4, 64, 128), (4, 64, 256))
"""(batch, sequence, hidden) of the two models timed: the size of models planned for CPUs."""


def corun_slowdown_from(samples: Iterable[Mapping[str, Any]], processes: int) -> float:
    """The slowdown per further process computing at once that the samples imply (>= 0).

    >>> corun_slowdown_from([{"alone_s": 0.02, "together_s": 0.029},
    ...                      {"alone_s": 0.02, "together_s": 0.024},
    ...                      {"alone_s": 0.01, "together_s": 0.02}], processes=2)
    0.45
    """
    ratios = [s["together_s"] / s["alone_s"] for s in samples]
    if not ratios or processes < 2:
        raise CalibrationError("no co-run samples were measured", where="corun.py",
                               fix="run autopar calibrate with --nproc 2 or more")
    return round(max(0.0, statistics.median(ratios) - 1.0) / (processes - 1), 4)


def _model(hidden: int) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(hidden, max(1, hidden // 64), 4 * hidden,
                                             dropout=0.0, batch_first=True, norm_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                               torch.nn.Linear(hidden, 256))


def _step_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor, steps: int) -> float:
    """Median seconds of ``steps`` training steps (forward, backward, AdamW)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(args: tuple) -> list[dict[str, Any]]:
    """One process: for each size and round, its step alone (in turn) and with the others."""
    index, processes, rounds, steps, threads, barrier = args
    torch.set_num_threads(threads)
    torch.manual_seed(index)
    samples = []
    for batch, seq, hidden in SIZES:
        model = _model(hidden)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = torch.randn(batch, seq, hidden), torch.randint(0, 256, (batch, seq))
        _step_seconds(model, optimizer, x, y, 3)  # warm up: first steps allocate
        for r in range(rounds):
            alone = 0.0
            for turn in range(processes):
                barrier.wait()
                if turn == index:
                    alone = _step_seconds(model, optimizer, x, y, steps)
            barrier.wait()
            together = _step_seconds(model, optimizer, x, y, steps)
            samples.append({"hidden": hidden, "round": r, "alone_s": alone,
                            "together_s": together})
    return samples


def measure_corun(processes: int, *, threads: int = 1, quick: bool = False) -> dict[str, Any]:
    """Spawn ``processes`` CPU processes and measure; ``{"corun_slowdown", ...}``."""
    if processes < 2:
        raise CalibrationError(f"the co-run slowdown needs 2 processes or more, got {processes}",
                               where="measure_corun", fix="measure with --nproc 2 or more")
    import multiprocessing

    rounds, steps = (3, 6) if quick else (5, 10)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(processes)
        with ctx.Pool(processes) as pool:
            results = pool.map(_worker, [(i, processes, rounds, steps, threads, barrier)
                                         for i in range(processes)])
    samples = [s for per_process in results for s in per_process]
    return {"corun_slowdown": corun_slowdown_from(samples, processes), "processes": processes,
            "samples": samples}
