"""Predicted against measured step time, per recorded step: a run directory written by
``ParallelModule.record_run`` (read and validated by :func:`autopar.calibrate.run_files.read_run`,
whose errors say which file and field is wrong)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from autopar.calibrate.run_files import read_run
from autopar.core.plan import Plan


@dataclass
class RunSteps:
    """Each recorded step's wall time (measured: the median over ranks) beside the plan's
    step time (modelled)."""

    directory: str
    steps: list[int]
    measured_s: list[float]
    warmup_steps: int
    predicted_s: float
    median_s: float  # over the steps past the warm-up (measured)
    notes: list[str] = field(default_factory=list)


def run_steps(plan: Plan, directory: str | os.PathLike[str]) -> RunSteps:
    run = read_run(directory)
    n = min(len(r.steps) for r in run.ranks)
    notes = []
    ran = run.plan.get("model", {}).get("fingerprint")
    if ran is not None and ran != plan.model.get("fingerprint"):
        notes.append(f"The run recorded another model's plan (fingerprint {ran}, this plan's "
                     f"{plan.model.get('fingerprint')}): the comparison is only indicative.")
    elif run.plan.get("mesh") not in (None, plan.mesh):
        notes.append(f"The run recorded another mesh ({run.plan.get('mesh')}) than this "
                     f"plan's ({plan.mesh}): the comparison is only indicative.")
    return RunSteps(
        directory=str(directory), steps=list(range(n)),
        measured_s=[run.step_s(i) for i in range(n)],
        warmup_steps=min(run.ranks[0].warmup_steps, n),
        predicted_s=float(plan.predicted.get("step_time_s", 0.0)),
        median_s=run.measured_step_s(), notes=notes)
