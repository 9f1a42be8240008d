"""Device speed and co-run slowdown apart, from a run and the same step in one process.

:func:`~autopar.calibrate.from_run.fit_runs` scales the device to what a run measured. A run
of ``k`` processes computing at once measures the device *and* how much the processes slow
each other (``DeviceSpec.corun_slowdown``, measured by ``autopar calibrate`` when the profile
was made), folded into one scale: a refitted profile would then price one process as slow as
``k`` beside each other. When the machine got busier since (another program on one of two
cores), one process is faster than the plan's, and that profile would never say so. A step of
one process on the same batch separates the two: its measured over modelled time is the device
scale, and what the run lost beyond that scale is the co-run slowdown (linear in the further
processes computing at once, as the cost model takes it: ``autopar.core.cluster.compute_share``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.calibrate.from_run import Run, RunFit


def split_corun(fit: RunFit, run: Run, one_modelled_s: float,
                one_measured_s: float) -> RunFit | None:
    """``fit`` with the device scale of the one-process step and the co-run slowdown that,
    with it, gives what the run measured; None when the run computed in one process only (or
    the one-process step has no time), which leaves nothing to separate.

    >>> from autopar.calibrate.from_run import RunFit
    >>> fit = RunFit(1.5, 0.0, (), None, (), {"corun_slowdown": 0.25}, {})
    >>> run = type("R", (), {"world_size": 2, "plan": {"cluster": {"cores_per_node": 2}}})()
    >>> s = split_corun(fit, run, one_modelled_s=0.04, one_measured_s=0.048)
    >>> round(s.device_scale, 3), s.corun_slowdown
    (1.2, 0.5625)
    """
    at_once = _computing_at_once(run.world_size, run.plan)
    if at_once < 2 or not (one_modelled_s > 0 and one_measured_s > 0):
        return None
    scale = one_measured_s / one_modelled_s
    planned = float(fit.base_device.get("corun_slowdown", 0.0))
    # the run measured fit.device_scale x its modelled device time, which holds the plan's
    # co-run factor 1 + planned (k - 1): the same time at ``scale`` needs this factor
    factor = fit.device_scale / scale * (1.0 + planned * (at_once - 1))
    return replace(fit, device_scale=scale,
                   corun_slowdown=round(max(0.0, factor - 1.0) / (at_once - 1), 4))


def _computing_at_once(devices: int, plan: Any) -> int:
    """The run's processes computing at once: its ranks, at most the cores they share."""
    cores = plan.get("cluster", {}).get("cores_per_node")
    return min(devices, int(cores)) if cores else devices
