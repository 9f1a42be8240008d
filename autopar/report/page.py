"""The report as one HTML page: Plotly's library inlined once, each chart a container with
its figure, the tables, and a Content-Security-Policy that lets the page load nothing from
anywhere (so a stray URL inside the library could not fetch either)."""

from __future__ import annotations

import os
import re
from html import escape

import plotly.graph_objects as go
import plotly.offline

from autopar.core.plan import Plan
from autopar.core.version import __version__
from autopar.report import Report, facts
from autopar.report.candidates_chart import candidates_figure
from autopar.report.charts import breakdown_figure, memory_figure, timeline_figure
from autopar.report.measured import RunSteps, run_steps
from autopar.report.run_chart import run_figure
from autopar.report.schedule import step_lanes
from autopar.report.tables import ground_table, reasons_table, summary_table

CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "img-src data: blob:; font-src data:")
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
_URL_ATTR = re.compile(r"""\b(src|href)(\s*=\s*)(["'])(\s*)h(ttps?:)""", re.IGNORECASE)

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1rem 1.5rem; color: #222; }
h1 { font-size: 1.5rem; margin-bottom: .2rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: .5rem 0; font-size: .9rem; }
th, td { border-bottom: 1px solid #ddd; padding: .3rem .6rem; text-align: left;
         vertical-align: top; }
.tag { font-size: .75rem; padding: 0 .4rem; border-radius: .6rem; background: #eee; }
.tag-modelled { background: #e3ecf7; } .tag-measured { background: #e4f4e4; }
.tag-validated { background: #e4f4e4; } .tag-extrapolated { background: #fbe9d6; }
.chart { min-height: 200px; margin: .5rem 0; } .notes { font-size: .85rem; color: #555; }
.warning { background: #fff4ce; padding: .5rem; }
"""


def plotly_script() -> str:
    """Plotly's library for a ``<script>`` element. The bundle holds URL strings (map tiles,
    the Plotly logo's link) that these charts never use; each ``href="http...`` in it is
    written ``href="\\x68ttp...`` -- the same JavaScript string -- so no attribute in the
    page's text names a web address."""
    js = plotly.offline.get_plotlyjs()
    js = _URL_ATTR.sub(lambda m: f"{m[1]}{m[2]}{m[3]}{m[4]}\\x68{m[5]}", js)
    return js.replace("</script", "<\\/script")


def _chart(fig: go.Figure, name: str, label: str) -> str:
    """A titled container holding one figure (its library comes from the page's head)."""
    body = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{name}",
                       config=PLOTLY_CONFIG, default_height=f"{fig.layout.height or 450}px")
    return f'<div class="chart" id="chart-{name}" data-label="{label}">{body}</div>'


def _notes(lines: list[str]) -> str:
    if not lines:
        return ""
    return '<ul class="notes">' + "".join(f"<li>{escape(x)}</li>" for x in lines) + "</ul>"


def build_page(plan: Plan, run_dir: str | os.PathLike[str] | None = None) -> Report:
    """The page for ``plan`` (and a recorded run, when given), and how many charts it has."""
    run: RunSteps | None = run_steps(plan, run_dir) if run_dir is not None else None
    p = plan.predicted
    capacity = float(p.get("memory_capacity_bytes", 0.0))
    pp = int(plan.mesh.get("pp", 1))
    lanes = step_lanes(plan)
    bars, memory_notes = facts.memory_bars(plan)
    cands = facts.candidates(plan)
    sections = [
        ("Pipeline schedule" if pp > 1 else "Step timeline",
         _chart(timeline_figure(lanes, pp), "timeline", "modelled") + _notes(lanes.notes)),
        ("Memory per rank", _chart(memory_figure(bars, capacity), "memory", "modelled")
         + _notes(memory_notes)),
        ("Step-time breakdown", _chart(breakdown_figure(
            facts.step_parts(plan), float(p.get("step_time_s", 0.0)),
            run.median_s if run else None), "breakdown", "modelled")),
        ("Candidate plans", _chart(candidates_figure(cands, capacity), "candidates", "modelled")
         + ("" if cands.chosen is not None else _notes(
             ["No candidate has the plan's setting and step time: the chosen plan is not "
              "marked (the plan may have been edited by hand)."]))),
    ]
    if run is not None:
        sections.append(("Predicted vs measured", _chart(run_figure(run), "run", "measured")
                         + _notes([f"Run directory: {run.directory}", *run.notes])))
    sections += [
        ("Validated vs extrapolated", "<p>Where the cost model behind this plan was checked "
         "against measured runs (benchmarks/fidelity_*.py).</p>"
         + ground_table(facts.ground_rows(plan))),
        ("Why the other candidates lost", reasons_table(cands)),
    ]
    charts = sum(body.count('class="chart"') for _, body in sections)
    name = escape(str(plan.model.get("name", "model")))
    cluster = escape(str(plan.cluster.get("name", "")))
    html = "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>autopar plan: {name} on {cluster}</title>", f"<style>{STYLE}</style>",
        f"<script>{plotly_script()}</script>", "</head><body>",
        f"<h1>autopar plan: {name} on {cluster}</h1>",
        "<p class=\"notes\">Every number is labelled: <b>modelled</b> (autopar's cost model) "
        "or <b>measured</b> (a recorded run, the solver's own wall time).</p>",
        summary_table(plan, run),
        *(f'<section><h2>{escape(title)}</h2>{body}</section>' for title, body in sections),
        f'<p class="notes">Written by autopar {escape(__version__)} from plan schema '
        f"{plan.schema_version}; self-contained: it loads nothing from the network.</p>",
        "</body></html>", ""])
    return Report(html, charts)
