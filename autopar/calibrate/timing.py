"""Repeatable timing: the median of batched back-to-back calls, synchronized with the device."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    repeats: int,
    batch_s: float = 0.005,
) -> float:
    """Median seconds per call: one warm-up, then ``repeats`` batches of back-to-back calls.

    Batching amortizes the timer and the device sync over enough calls to last ``batch_s``,
    so a microsecond op is timed as precisely as a second-long one."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(10_000, math.ceil(batch_s / once)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
