"""``autopar report``: a saved plan as one self-contained HTML page of charts.

    autopar report plan.json -o plan.html [--run RUN_DIR]

The page shows the pipeline schedule per rank (played out from the plan's modelled stage
times), memory per rank against the device's capacity, the step's parts, the candidates
the solver compared and why the others lost, where the cost model is validated, and, with
a recorded run, predicted against measured step time. Every number says modelled or
measured.

Library: Plotly (plotly.py >= 5.23), with plotly.js inlined once in the page's head.
Chosen over hand-drawn SVG for hover details on every block and point, zoom, and legends
that hide series, with no drawing code to keep; the price is size: a report is ~4.7 MiB
(plotly.js 4.6 MiB; the charts, tables and their data 0.1-0.3 MiB), drawn offline in
~4 s by headless Chromium on a 2-core VM. Vega-Altair would weigh less, but inlining its
renderer needs the vl-convert-python package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from autopar.core.errors import AutoparError
from autopar.core.plan import Plan


class ReportError(AutoparError):
    """A report cannot be written (where it should go, what it needs)."""


@dataclass(frozen=True)
class Report:
    """A report page and how many charts it holds."""

    html: str
    charts: int


def report_html(plan: Plan, run_dir: str | os.PathLike[str] | None = None) -> str:
    """The report of ``plan`` as HTML text; ``run_dir``: a run recorded with
    ``ParallelModule.record_run``, to compare predicted with measured step time."""
    return build_report(plan, run_dir).html


def write_report(plan: Plan, path: str | os.PathLike[str],
                 run_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the report of ``plan`` to ``path`` (UTF-8 HTML); the path written."""
    return save(build_report(plan, run_dir).html, path)


def save(html: str, path: str | os.PathLike[str]) -> Path:
    """Write ``html`` to ``path``, every failure a :class:`ReportError` saying what to do."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ReportError(f"'{out}' is a directory", where=str(out),
                          fix="give a file name, e.g. plan.html")
    if not out.parent.is_dir():
        raise ReportError(f"directory '{out.parent}' does not exist", where=str(out),
                          fix="create it first, or write the report elsewhere")
    try:
        out.write_text(html, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"cannot write the report to '{out}': {e.strerror or e}",
                          where=str(out), fix="check the directory's permissions and free "
                          "space") from None
    return out


def build_report(plan: Plan, run_dir: str | os.PathLike[str] | None = None) -> Report:
    """The page and how many charts it holds (what ``autopar report`` says it wrote)."""
    if not isinstance(plan, Plan):
        raise ReportError(f"expected an autopar Plan, got {type(plan).__name__}",
                          where="report_html(plan)",
                          fix="load one with autopar.Plan.load('plan.json')")
    try:
        from autopar.report.page import build_page
    except ImportError as e:  # plotly is a dependency, but an environment may lack it
        raise ReportError(f"the report needs Plotly, which cannot be imported ({e})",
                          where="import plotly", fix="pip install 'plotly>=5'") from None
    return build_page(plan, run_dir)


__all__ = ["Report", "ReportError", "build_report", "report_html", "save", "write_report"]
