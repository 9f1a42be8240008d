"""The search's candidates as a scatter of step time against peak memory (both modelled),
the chosen plan marked."""

from __future__ import annotations

import plotly.graph_objects as go

from autopar.core.plan_summary import setting_text
from autopar.core.units import format_bytes, format_seconds
from autopar.report.charts import GIB, TEMPLATE, title_of
from autopar.report.facts import Candidates


def _hover(c: dict) -> str:
    return (f"{setting_text(c)}<br>{c.get('status', '')}<br>"
            f"step {format_seconds(c['step_time_s'])}, peak {format_bytes(c['peak_memory_bytes'])}"
            " (modelled)")


def candidates_figure(cands: Candidates, capacity: float) -> go.Figure:
    """One point per solved candidate, coloured by its pipeline depth; the chosen one a star."""
    fig = go.Figure()
    for pp in sorted({int(c.get("pp", 1)) for c in cands.solved}):
        group = [c for i, c in enumerate(cands.solved) if int(c.get("pp", 1)) == pp
                 and i != cands.chosen]
        if not group:
            continue
        fig.add_trace(go.Scatter(
            name=f"pp={pp}", mode="markers", x=[c["step_time_s"] * 1e3 for c in group],
            y=[c["peak_memory_bytes"] / GIB for c in group], marker={"size": 7, "opacity": 0.7},
            hovertext=[_hover(c) for c in group], hoverinfo="text"))
    if cands.chosen is not None:
        c = cands.solved[cands.chosen]
        fig.add_trace(go.Scatter(
            name="chosen plan", mode="markers+text", x=[c["step_time_s"] * 1e3],
            y=[c["peak_memory_bytes"] / GIB], text=["chosen"], textposition="top center",
            marker={"symbol": "star", "size": 18, "color": "#d62728",
                    "line": {"color": "black", "width": 1}},
            hovertext=[_hover(c)], hoverinfo="text"))
    if capacity > 0:
        fig.add_hline(y=capacity / GIB, line={"color": "#d62728", "dash": "dash"},
                      annotation_text=f"device capacity {format_bytes(capacity)} (spec)",
                      annotation_position="top left")
    times = [c["step_time_s"] for c in cands.solved if c["step_time_s"] > 0]
    log = bool(times) and max(times) > 20 * min(times)
    unsolved = cands.total - len(cands.solved)
    fig.update_layout(
        template=TEMPLATE, height=480,
        title=title_of("Candidate plans the solver compared — modelled",
                     f"{len(cands.solved)} with a prediction of {cands.total} considered "
                     f"({unsolved} pruned, skipped or not solved: see the table below)"),
        xaxis={"title": {"text": "step time (ms, modelled)"}, "type": "log" if log else "linear"},
        yaxis={"title": {"text": "peak memory per device (GiB, modelled)"}, "rangemode": "tozero"},
        margin={"l": 10, "r": 10, "t": 90, "b": 40})
    return fig
