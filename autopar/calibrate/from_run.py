"""Refit a machine profile from a recorded training run (``autopar calibrate --from-run``).

A run directory holds one ``rank{r}.json`` per rank, written by
``ParallelModule.record_run`` (see :mod:`autopar.runtime.record`): each step's wall time,
its forward and backward, and every collective with its kind, bytes, group size and
seconds, plus the plan that ran (whose ``predicted`` terms the cost model gave under the
plan's own ``cluster`` numbers).

The refit fits the cost model's own time terms to those measurements, by least squares:

- **link** (latency, bus bandwidth): the communication cost model's collective time,
  ``latencies(kind, n) * latency + bytes(kind, n) / bandwidth`` (ring collectives; on gloo
  all-gathers and reduce-scatters priced as all-reduces), fitted to the run's
  collectives (:func:`fit_link_to_steps`: seconds, each collective weighted by how often a
  step runs it, so the fit reproduces a step's time in collectives). A
  collective ends when its last rank arrives, so the time it costs is what the last rank to
  arrive waited: for each collective the ranks ran alike, the least time over ranks counts
  (the rest is other ranks' compute). A DDP bucket launched before the backward pass ended
  ran partly beside it: it is no link point, and only its exposed part counts as a wait.
  It needs two message sizes at least; with fewer, the
  plan's link is kept, and the report says so. Either way the refitted link has no
  per-kind fits (``LinkSpec.per_kind``): the refit prices every collective on this one link.
- **device speed** ``a``: every device time term of the compute model (matmuls, elementwise
  traffic, the kernel floor, first-touch allocation, the optimizer) is ``a`` times what the
  plan's device numbers give when peak FLOP/s and memory bandwidth are divided by ``a`` and
  the floor and allocation cost multiplied by it. So the modelled device time of a step is
  ``a * D``, ``D = predicted.compute_s + predicted.optimizer_s``, and ``a`` is the
  (Huber-weighted, :func:`huber_scale`) least squares solution of ``step_s[i] - p2p_wait_s[i] - sum(link(c) for c in collectives[i])
  ~ a * D`` (the slowest rank's) over the recorded steps, with each collective at the
  fitted link's time: the step is the model's device and link terms, and what the link does
  not explain (ranks waiting for each other) is the device's. Several runs fit together
  when they were planned with the same device at other speeds (as a refitted profile
  makes): their ``D`` is brought to the first run's device numbers.

The warm-up steps at the start of a recording are left out, and so are steps whose time is
an outlier (Tukey's fences; a busy machine stretches some steps several-fold). The refitted profile carries
the plan's device numbers scaled by ``a``, the fitted link, and the points and residuals
under ``measurements.from_run``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from autopar.calibrate.collectives import CalibrationError, CollectivePoint
from autopar.calibrate.run_files import RankRecord, Run, _overlapped, read_run
from autopar.core.cluster.profile import _HOST_KEYS, Profile
from autopar.core.cluster.spec import LinkSpec
from autopar.cost_models.comm import collective_time

__all__ = ["RankRecord", "Run", "RunFit", "fit_runs", "format_fit", "read_run", "refit_profile"]
_DEVICE_TIME_KEYS = ("kernel_floor_s", "allocation_s_per_byte", "sharded_host_s_per_tensor",
                     "sharded_optimizer_s_per_tensor", "view_s")
_DEVICE_RATE_KEYS = ("memory_bandwidth_bytes_per_s",)
_OP_RATES = "op_s_per_element"
_DEVICE_KEPT_KEYS = ("matmul_efficiency", "matmul_efficiency_curve", "memory_efficiency",
                     "attention_efficiency", "attention_efficiency_curve", "memory_overlap",
                     "corun_slowdown", "fp8_matmul_efficiency", "generated_attention_forward",
                     "generated_attention_backward")


# --- fitting -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunFit:
    """What the runs say about the machine (fitted to measurements)."""

    device_scale: float  # measured device time / modelled (least squares)
    device_residual: float  # median |fit - measured| / measured over the steps
    device_points: tuple[tuple[float, float], ...]  # (modelled D, measured) per step
    link: ModelLink | None  # None: fewer than two message sizes, link kept
    link_points: tuple[CollectivePoint, ...]
    base_device: Mapping[str, Any]
    base_link: Mapping[str, float]
    backend: str = "gloo"
    busy_latency_s: float = 0.0  # the plan's, kept: a run's collectives cannot separate it
    corun_slowdown: float | None = None  # None: the plan's, kept (autopar.calibrate.corun_split)

    def device(self) -> dict[str, Any]:
        """The profile's device section: the plan's device numbers, every time term scaled
        by ``device_scale``."""
        a = self.device_scale
        base = self.base_device
        out: dict[str, Any] = {"peak_flops": {k: float(v) / a for k, v in
                                              base["peak_flops"].items()}}
        for key in _DEVICE_RATE_KEYS:
            out[key] = float(base[key]) / a
        for key in _DEVICE_TIME_KEYS:
            if key in base:
                out[key] = float(base[key]) * a
        for key in _DEVICE_KEPT_KEYS:
            if key in base and base[key] not in (None, [], ()):
                out[key] = base[key]
        if self.corun_slowdown is not None:
            out["corun_slowdown"] = self.corun_slowdown
        if base.get(_OP_RATES):  # seconds per element: device time, scaled like the floor
            out[_OP_RATES] = {op: [float(t) * a for t in rates]
                              for op, rates in base[_OP_RATES].items()}
        return out

    def step_link(self) -> Any:
        """The link that prices the recorded collectives in the device fit."""
        return self.link or _base_link(self.base_link, self.backend)

    def link_dict(self) -> dict[str, float]:
        """The refitted link, with the plan's busy latency kept: the device fit took it out
        of the measured steps for each asynchronous message (``Run.measured_device_s``), as
        the cost model adds it back, so it is neither lost (pipelines would look cheap) nor
        counted twice."""
        busy = {"busy_latency_s": self.busy_latency_s}
        if self.link is None:
            return {**self.base_link, **busy}
        return {"bandwidth_bytes_per_s": self.link.bandwidth_bytes_per_s,
                "latency_s": self.link.latency_s, **busy}


def fit_runs(runs: Sequence[Run]) -> RunFit:
    """Least-squares device speed and link over ``runs`` (all planned for one device)."""
    if not runs:
        raise CalibrationError("no run to fit", where="--from-run", fix="name a run directory")
    base = runs[0].plan["cluster"]
    backend = str(base.get("backend", "gloo"))
    slower = [1.0]
    for run in runs[1:]:
        k = relative_time(run.plan["cluster"]["device"], base["device"])
        if k is None:
            raise CalibrationError(
                f"run '{run.directory}' was planned with other device numbers than "
                f"'{runs[0].directory}' (not the same device at another speed), so one device "
                "speed cannot be fitted to both",
                where=str(run.directory),
                fix="fit runs planned with the same cluster (or with profiles refitted from one "
                "another) together, or the latest run alone")
        slower.append(k)
    points, weights = _link_points(runs)
    link = None
    if len({p.nbytes for p in points}) >= 2 and int(base.get("nodes", 1)) == 1:
        link = fit_link_to_steps(points, weights, backend)
    base_link = {k: float(v) for k, v in base.get("intra_node_link", {}).items()
                 if k in ("bandwidth_bytes_per_s", "latency_s")}
    step_link = link or _base_link(base_link, backend)
    device_points = []
    for run, k in zip(runs, slower):
        modelled = run.modelled_device_s() / k  # at the first run's device numbers
        if not modelled > 0:
            raise CalibrationError(
                f"run '{run.directory}': its plan models no device time", where=str(run.directory),
                fix="record a run of a plan made by this autopar")
        for i in run.kept_steps:
            device_points.append((modelled, run.measured_device_s(i, step_link,
                                                                  run.busy_latency_s())))
    d = [p[0] for p in device_points]
    y = [p[1] for p in device_points]
    scale = huber_scale(d, y)
    if not scale > 0:
        raise CalibrationError(
            "the recorded steps leave no device time once the collectives are taken out",
            where=", ".join(str(r.directory) for r in runs),
            fix="record more steps, on a quieter machine")
    residual = statistics.median(abs(scale * di - yi) / yi for di, yi in zip(d, y) if yi > 0)
    return RunFit(scale, residual, tuple(device_points), link, tuple(points),
                  base["device"], base_link, backend, runs[0].busy_latency_s())


def huber_scale(d: Sequence[float], y: Sequence[float], k: float = 1.345,
                iterations: int = 20) -> float:
    """``a`` minimizing the Huber loss of ``y - a * d``: least squares, with steps whose
    residual exceeds ``k`` robust standard deviations (1.4826 x the median absolute
    residual) weighted down to a linear loss (iteratively reweighted least squares). A step
    that another process stretched several-fold then counts like a step a little slow, not
    quadratically; on clean data it is plain least squares."""
    w = [1.0] * len(d)
    a = 0.0
    for _ in range(iterations):
        den = sum(wi * di * di for wi, di in zip(w, d))
        if not den > 0:
            return 0.0
        new = sum(wi * di * yi for wi, di, yi in zip(w, d, y)) / den
        residuals = [yi - new * di for di, yi in zip(d, y)]
        sigma = 1.4826 * statistics.median(abs(r) for r in residuals)
        converged = abs(new - a) <= 1e-9 * abs(new)
        a = new
        if converged or not sigma > 0:
            break
        w = [1.0 if abs(r) <= k * sigma else k * sigma / abs(r) for r in residuals]
    return a


@dataclass(frozen=True)
class ModelLink:
    """A link priced as the communication cost model prices it (ring collectives; on gloo,
    all-gathers and reduce-scatters as all-reduces), with how well it fits the points."""

    latency_s: float
    bandwidth_bytes_per_s: float
    backend: str = "gloo"
    median_error: float = 0.0
    max_error: float = 0.0
    points: int = 0

    def predict(self, kind: str, nbytes: float, n: int) -> float:
        return collective_time(kind, nbytes, n, LinkSpec(self.bandwidth_bytes_per_s,
                                                         self.latency_s), backend=self.backend)

    def as_dict(self) -> dict[str, float | int | str]:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "backend": self.backend, "median_error": self.median_error,
                "max_error": self.max_error, "points": self.points}


def _base_link(link: Mapping[str, float], backend: str) -> ModelLink:
    return ModelLink(float(link.get("latency_s", 0.0)),
                     float(link.get("bandwidth_bytes_per_s", 0.0)) or 1e300, backend)


def model_terms(kind: str, nbytes: float, n: int, backend: str) -> tuple[float, float]:
    """``(latencies, bytes)`` with ``time = latencies * latency + bytes / bandwidth`` in the
    communication cost model (:func:`autopar.cost_models.comm.collective_time`, the one
    source of the formula), read off it at two links."""
    latencies = collective_time(kind, nbytes, n, LinkSpec(1e300, 1.0), backend=backend)
    moved = collective_time(kind, nbytes, n, LinkSpec(1.0, 0.0), backend=backend)
    return latencies, moved


def relative_time(device: Mapping[str, Any], base: Mapping[str, Any]) -> float | None:
    """``k`` when ``device`` is ``base`` with every time term ``k`` times longer (peak FLOP/s
    and bandwidth divided by ``k``, floor and allocation cost multiplied: what a refit
    writes), so its modelled device times are ``k`` times ``base``'s; None otherwise."""
    if device == base:
        return 1.0
    try:
        peaks, base_peaks = device["peak_flops"], base["peak_flops"]
        if set(peaks) != set(base_peaks):
            return None
        ratios = [float(base_peaks[d]) / float(peaks[d]) for d in peaks]
        ratios += [float(base[k]) / float(device[k]) for k in _DEVICE_RATE_KEYS]
        ratios += [float(device.get(k, 0.0)) / float(base[k]) for k in _DEVICE_TIME_KEYS
                   if float(base.get(k, 0.0) or 0.0) > 0]
        if any(float(device.get(k, 0.0) or 0.0) > 0 for k in _DEVICE_TIME_KEYS
               if not float(base.get(k, 0.0) or 0.0) > 0):
            return None
        kept = all(device.get(k) == base.get(k) for k in _DEVICE_KEPT_KEYS)
        rates, base_rates = device.get(_OP_RATES) or {}, base.get(_OP_RATES) or {}
        if set(rates) != set(base_rates):
            return None
        ratios += [float(t) / float(b) for op in rates
                   for t, b in zip(rates[op], base_rates[op]) if float(b) > 0]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    k = statistics.fmean(ratios)
    if not kept or not k > 0 or any(abs(r / k - 1) > 1e-6 for r in ratios):
        return None
    return k


def _link_points(runs: Iterable[Run]) -> tuple[list[CollectivePoint], list[float]]:
    """One point per (kind, bytes, group size): the mean of its cost over the steps, and
    how many times a step runs it (its weight). Least squares on these is least squares on
    every recorded collective: the fit reproduces the time steps spent in collectives."""
    times: dict[tuple[str, int, int], list[float]] = {}
    steps = 0
    for run in runs:
        for i in run.kept_steps:
            steps += 1
            for c in run.collective_seconds(i)[0]:
                if c["seconds"] > 0 and not _overlapped(c):
                    times.setdefault((c["kind"], c["bytes"], c["group_size"]), []).append(
                        float(c["seconds"]))
    keys = sorted(times)
    points = [CollectivePoint(kind, nbytes, n, statistics.fmean(times[(kind, nbytes, n)]))
              for kind, nbytes, n in keys]
    return points, [len(times[k]) / max(steps, 1) for k in keys]


def fit_link_to_steps(points: Sequence[CollectivePoint], weights: Sequence[float],
                      backend: str = "gloo") -> ModelLink | None:
    """Latency and bus bandwidth by least squares of the cost model's collective times
    (:func:`model_terms`) on the points' seconds (not relative errors, as :func:`fit_link`
    fits a sweep of sizes), each point weighted by how often a step runs it: the fitted link
    reproduces the time a step spends in its collectives, which the large messages
    dominate. None when no positive bandwidth fits."""
    import numpy as np

    terms = np.array([model_terms(p.kind, p.nbytes, p.world_size, backend) for p in points])
    t = np.array([p.seconds for p in points])
    w = np.sqrt(np.asarray(weights, dtype=float))
    a = terms * w[:, None]
    latency, inverse_bw = np.linalg.lstsq(a, t * w, rcond=None)[0]
    if latency < 0:
        latency = 0.0
        inverse_bw = float((a[:, 1] @ (t * w)) / (a[:, 1] @ a[:, 1]))
    if not inverse_bw > 0:
        return None
    fit = ModelLink(float(latency), float(1 / inverse_bw), backend)
    errors = [abs(fit.predict(p.kind, p.nbytes, p.world_size) - p.seconds) / p.seconds
              for p in points]
    return ModelLink(fit.latency_s, fit.bandwidth_bytes_per_s, backend,
                     statistics.median(errors), max(errors), len(points))


def refit_profile(runs: Sequence[Run], fit: RunFit | None = None) -> Profile:
    """The profile the runs imply: the plan's device scaled, the fitted link, the points."""
    fit = fit or fit_runs(runs)
    host = {k: v for k, v in runs[0].ranks[0].host.items()
            if k in _HOST_KEYS and isinstance(v, (str, int, float, bool))}
    host["nproc"] = runs[0].world_size
    host["backend"] = runs[0].plan["cluster"].get("backend", "gloo")
    measurements = {
        "from_run": {
            "runs": [str(r.directory) for r in runs],
            "device_scale": fit.device_scale,
            **({"corun_slowdown": fit.corun_slowdown} if fit.corun_slowdown is not None
               else {}),
            "device_fit_median_error": fit.device_residual,
            "device_points": [{"modelled_device_s_at_plan": dm, "measured_device_s": ym}
                              for dm, ym in fit.device_points],
            "link_points": [{"kind": p.kind, "bytes": p.nbytes, "group_size": p.world_size,
                             "seconds": p.seconds} for p in fit.link_points],
            "link_fit": fit.link.as_dict() if fit.link else None,
            "runs_step_s": [{"predicted": r.predicted(), "measured": r.measured_step_s()}
                            for r in runs],
        }
    }
    return Profile(
        device=fit.device(),
        intra_node_link=fit.link_dict(),
        host=host,
        measurements=measurements,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def format_fit(runs: Sequence[Run], fit: RunFit) -> str:
    """What was measured, what the plan modelled, and what was fitted (each labelled)."""
    lines = []
    for run in runs:
        steps = list(run.fitted_steps)
        dev = statistics.median(run.measured_device_s(i) for i in steps)
        net = statistics.median(run.measured_device_s(i, fit.step_link(), run.busy_latency_s())
                                for i in steps)
        comm = statistics.median(run.measured_comm_s(i) for i in steps)
        p = run.plan.get("predicted", {})
        mesh = " x ".join(f"{k}{v}" for k, v in run.plan.get("mesh", {}).items() if v > 1) or "1"
        lines += [
            f"run {run.directory}: {run.world_size} ranks, mesh {mesh}, {len(steps)} steps "
            f"fitted (of {min(len(r.steps) for r in run.ranks)}; warm-up left out"
            + (f"; {len(steps) - len(run.kept_steps)} outlier(s) too" if len(steps) > len(
                run.kept_steps) else "") + ")",
            f"  {'':<22} {'modelled':>10} {'measured':>10}",
            f"  {'step time':<22} {_ms(run.predicted()):>10} {_ms(run.measured_step_s()):>10}",
            f"  {'device (compute+opt)':<22} {_ms(run.modelled_device_s()):>10} {_ms(dev):>10}"
            + ("   (net of FSDP2's collectives as modelled: not timed)"
               if run.untimed_comm_s() else ""),
            f"  {'  with collectives at':<22} {'':>10} {_ms(net):>10}   (what the device fit "
            "uses: step net of the fitted link's time",
            f"  {'  the fitted link':<22} {'':>10} {'':>10}    for the recorded collectives)",
            f"  {'collectives':<22} "
            f"{_ms(float(p.get('tp_comm_s', 0)) + float(p.get('dp_exposed_s', 0))):>10} "
            f"{_ms(comm):>10}",
        ]
    lines += ["", "fitted (least squares of the cost model's terms to the measurements; the "
              "device's Huber-weighted)",
              f"  device speed: measured device time = {fit.device_scale:.3f} x modelled "
              f"(median error {fit.device_residual:.1%} over {len(fit.device_points)} steps)"]
    if fit.link is not None:
        lines.append(
            f"  link: latency {fit.link.latency_s * 1e6:.1f} µs, bus bandwidth "
            f"{fit.link.bandwidth_bytes_per_s / 1e9:.3f} GB/s (the cost model's collectives, "
            f"{fit.link.points} points, median error {fit.link.median_error:.0%})")
        for p in fit.link_points:
            lines.append(f"    {p.kind:<14} {p.nbytes:>12,} B over {p.world_size}: measured "
                         f"{p.seconds * 1e6:9.1f} µs, fitted "
                         f"{fit.link.predict(p.kind, p.nbytes, p.world_size) * 1e6:9.1f} µs")
    else:
        sizes = len({p.nbytes for p in fit.link_points})
        lines.append(f"  link: kept from the plan's cluster ({sizes} message size(s) recorded; "
                     "a latency and a bandwidth need two)")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
