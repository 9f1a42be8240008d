"""Measure collectives between local processes and fit a link's latency and bandwidth.

``measure_collectives`` launches ``collective_worker.py`` under torchrun (gloo on CPU, NCCL on
GPUs) and reads back one time per (collective, size). ``fit_link`` fits the ring model the
communication cost model uses, with nccl-tests' bus-bandwidth factors::

    time = steps * latency + frac * bytes / bus_bandwidth

    all_reduce                      steps 2(n-1)   frac 2(n-1)/n
    all_gather, reduce_scatter,     steps n-1      frac (n-1)/n
    all_to_all
    broadcast                       steps n-1      frac 1

``bytes`` is the whole tensor (see the worker), so a bandwidth fitted here is a bus bandwidth
that nccl-tests would report and the cost model divides by unchanged. The fit is a least
squares on relative errors, so microsecond and second-long points weigh the same, with
latency >= 0 and bandwidth > 0. One machine is one node: its fit is the intra-node link.

The cost model has one link per level for every collective, so the profile's link is fitted
to ``LINK_KIND`` (all-reduce) alone: the collective whose bus bandwidth nccl-tests headlines,
and the one a training step leans on (DDP gradients, tensor-parallel partial sums, and
autopar's reduce-scatter on gloo). Backends are not equally good at every collective (gloo's
all-gather and reduce-scatter reach a fraction of its all-reduce bus bandwidth), so each
collective's own fit is recorded beside it, and the table shows how far the link is off.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.core.errors import AutoparError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
LINK_KIND = "all_reduce"
KIB, MIB = 2**10, 2**20
_WORKER = Path(__file__).with_name("collective_worker.py")


class CalibrationError(AutoparError):
    """A measurement could not be made or does not fit the model."""


def ring_factors(kind: str, n: int) -> tuple[int, float]:
    """``(latency steps, bus-bandwidth fraction of the bytes)`` of a ring collective."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "broadcast":
        return n - 1, 1.0
    return n - 1, (n - 1) / n


@dataclass(frozen=True)
class CollectivePoint:
    """One measured collective: ``nbytes`` of tensor over ``world_size`` ranks took ``seconds``."""

    kind: str
    nbytes: int
    world_size: int
    seconds: float

    def __post_init__(self) -> None:
        ring_factors(self.kind, self.world_size)
        if self.world_size < 2 or self.nbytes <= 0 or not self.seconds > 0:
            raise ValueError(f"a collective point needs >= 2 ranks, bytes > 0, time > 0: {self}")

    @property
    def bus_bandwidth(self) -> float:
        """Bytes/s by the nccl-tests convention (the fraction of bytes a rank must move)."""
        return ring_factors(self.kind, self.world_size)[1] * self.nbytes / self.seconds


@dataclass(frozen=True)
class LinkFit:
    """A fitted link, with how well it reproduces the points it was fitted to."""

    latency_s: float
    bandwidth_bytes_per_s: float
    median_error: float  # median |predicted - measured| / measured
    max_error: float
    points: int

    def predict(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds the ring model gives for one collective."""
        steps, frac = ring_factors(kind, n)
        return steps * self.latency_s + frac * nbytes / self.bandwidth_bytes_per_s

    def as_dict(self) -> dict[str, float | int]:
        return {
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "median_error": self.median_error,
            "max_error": self.max_error,
            "points": self.points,
        }


def fit_link(points: Iterable[CollectivePoint]) -> LinkFit:
    """Least-squares latency and bus bandwidth over ``points`` (any mix of kinds and sizes)."""
    pts = list(points)
    if len(pts) < 2 or len({p.nbytes for p in pts}) < 2:
        raise CalibrationError(
            f"cannot fit a latency and a bandwidth to {len(pts)} point(s) of one size",
            where="collective measurements",
            fix="measure at least two message sizes",
        )
    factors = [ring_factors(p.kind, p.world_size) for p in pts]
    seconds = np.array([p.seconds for p in pts])
    # Rows divided by the measured time: the residuals are relative errors.
    a = np.array([[s, f * p.nbytes] for (s, f), p in zip(factors, pts)]) / seconds[:, None]
    ones = np.ones(len(pts))
    latency, inverse_bw = np.linalg.lstsq(a, ones, rcond=None)[0]
    if latency < 0:  # bandwidth alone explains the data better: clamp latency at 0
        latency, inverse_bw = 0.0, float(a[:, 1] @ ones / (a[:, 1] @ a[:, 1]))
    if inverse_bw <= 0:
        raise CalibrationError(
            "the collective times do not grow with message size, so no bandwidth can be fitted",
            where="collective measurements",
            fix="include larger messages (MiB and up), or re-run on a quieter machine",
        )
    fit = LinkFit(float(latency), float(1 / inverse_bw), 0.0, 0.0, len(pts))
    errors = [abs(fit.predict(p.kind, p.nbytes, p.world_size) - p.seconds) / p.seconds for p in pts]
    return LinkFit(
        fit.latency_s,
        fit.bandwidth_bytes_per_s,
        statistics.median(errors),
        max(errors),
        len(pts),
    )


def collective_sizes(quick: bool) -> list[int]:
    """Message sizes from 1 KiB to 64 MiB in steps of 2 (quick: five, up to 16 MiB)."""
    if quick:
        return [KIB, 16 * KIB, 256 * KIB, 4 * MIB, 16 * MIB]
    return [KIB * 2**i for i in range(17)]


def measure_collectives(
    nproc: int,
    *,
    device_type: str = "cpu",
    sizes: Iterable[int] | None = None,
    kinds: Iterable[str] = KINDS,
    quick: bool = False,
    threads: int = 1,
    timeout_s: float = 600.0,
) -> list[CollectivePoint]:
    """Launch ``nproc`` ranks on this machine with torchrun and time every collective."""
    if nproc < 2:
        raise CalibrationError(
            f"collectives need at least 2 processes, got --nproc {nproc}",
            where="--nproc",
            fix="use --nproc 2 or more",
        )
    sizes = sorted(set(sizes or collective_sizes(quick)))
    data = run_worker(_WORKER, nproc, [
        "--sizes", ",".join(map(str, sizes)),
        "--kinds", ",".join(kinds),
        "--repeats", "9" if quick else "21",
        "--batch-ms", "10" if quick else "20",
        "--device", device_type,
    ], threads=threads, timeout_s=timeout_s, what="the collective benchmark")  # fmt: skip
    world = int(data["world_size"])
    return [CollectivePoint(p["kind"], p["bytes"], world, p["seconds"]) for p in data["points"]]


def run_worker(worker: Path, nproc: int, args: list[str], *, threads: int, timeout_s: float,
               what: str) -> dict:
    """Launch ``nproc`` ranks of the benchmark script ``worker`` on this machine with
    torchrun (``--out`` and ``--threads`` added to ``args``) and return what rank 0 wrote."""
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        out = Path(tmp) / "points.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(worker),
            "--out", str(out), "--threads", str(threads), *args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        try:
            run = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            raise CalibrationError(
                f"{what} did not finish in {timeout_s:.0f} s",
                where=" ".join(cmd),
                fix="check that the processes can reach each other, or use --quick",
            ) from None
        if run.returncode != 0 or not out.exists():
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-8:])
            raise CalibrationError(
                f"{what} failed (exit status {run.returncode}):\n{tail}",
                where=" ".join(cmd),
                fix="run that command to see the full error",
            )
        return json.loads(out.read_text(encoding="utf-8"))
