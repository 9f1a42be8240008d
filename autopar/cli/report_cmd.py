"""``autopar report PLAN.json -o PLAN.html [--run DIR]``: a saved plan as one
self-contained HTML page of charts (:mod:`autopar.report`)."""

from __future__ import annotations

import argparse

from autopar.core.plan import Plan
from autopar.report import build_report, save


def run_report(args: argparse.Namespace) -> int:
    """Read the plan (and the run), write the page, say where and how large."""
    plan = Plan.load(args.plan)
    report = build_report(plan, getattr(args, "run", None))
    path = save(report.html, args.out)
    print(f"wrote {path} ({path.stat().st_size / 1024:,.0f} KiB, {report.charts} charts)")
    return 0
