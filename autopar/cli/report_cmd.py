"""``autopar report PLAN.json -o PLAN.html [--run DIR]``: a saved plan as one
self-contained HTML page of charts (:mod:`autopar.report`). A recorded run (its directory,
or one of its ``rank{r}.json``) stands for its plan and its measurements."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopar.calibrate.run_files import read_run
from autopar.core.plan import Plan
from autopar.report import build_report, save
from autopar.runtime.record import RUN_FORMAT


def run_report(args: argparse.Namespace) -> int:
    """Read the plan (and the run), write the page, say where and how large."""
    plan, run = _plan_and_run(Path(args.plan), getattr(args, "run", None))
    report = build_report(plan, run)
    path = save(report.html, args.out)
    print(f"wrote {path} ({path.stat().st_size / 1024:,.0f} KiB, {report.charts} charts)")
    return 0


def _plan_and_run(given: Path, run: str | None) -> tuple[Plan, str | None]:
    """The plan to report and the run to compare it with: a run record's own plan when
    ``given`` is one (its directory, or a rank file in it), else the plan file."""
    directory = given if given.is_dir() and any(given.glob("rank*.json")) else (
        given.parent if given.is_file() and _is_run_record(given) else None)
    if directory is None:
        return Plan.load(given), run
    recorded = read_run(directory)  # every rank's file checked, with its own messages
    return Plan.from_dict(dict(recorded.plan)), run or str(directory)


def _is_run_record(path: Path) -> bool:
    """Whether ``path`` is a run record (checked on its format field; anything else is
    left for :meth:`Plan.load` to judge and explain)."""
    if path.suffix != ".json" or path.stat().st_size > 64 << 20:
        return False
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == RUN_FORMAT
