"""Predicted (modelled) against measured step time, step by step, from a recorded run."""

from __future__ import annotations

import plotly.graph_objects as go

from autopar.core.units import format_seconds
from autopar.report.charts import TEMPLATE, title_of
from autopar.report.measured import RunSteps


def run_figure(run: RunSteps) -> go.Figure:
    fig = go.Figure()
    warm = [i for i in run.steps if i < run.warmup_steps]
    kept = [i for i in run.steps if i >= run.warmup_steps]
    for name, steps, colour in (("measured step (warm-up)", warm, "#bbbbbb"),
                                ("measured step", kept, "#1f77b4")):
        if steps:
            fig.add_trace(go.Scatter(
                name=name, mode="lines+markers", x=steps,
                y=[run.measured_s[i] * 1e3 for i in steps], marker={"color": colour},
                line={"color": colour},
                hovertext=[f"step {i}: {format_seconds(run.measured_s[i])} (measured, median "
                           "over ranks)" for i in steps], hoverinfo="text"))
    fig.add_trace(go.Scatter(
        name="predicted (modelled)", mode="lines", x=[0, max(run.steps, default=0)],
        y=[run.predicted_s * 1e3] * 2, line={"color": "#d62728", "dash": "dash"},
        hovertext=[f"predicted {format_seconds(run.predicted_s)} (modelled)"] * 2,
        hoverinfo="text"))
    error = run.median_s / run.predicted_s - 1 if run.predicted_s else 0.0
    fig.update_layout(
        template=TEMPLATE, height=420,
        title=title_of("Step time per step — predicted (modelled) vs measured",
                     f"median measured {format_seconds(run.median_s)} past the warm-up vs "
                     f"predicted {format_seconds(run.predicted_s)}: {error:+.1%}"),
        xaxis={"title": {"text": "step"}, "dtick": 1 if len(run.steps) <= 30 else None},
        yaxis={"title": {"text": "step time (ms; measured points, modelled line)"},
               "rangemode": "tozero"},
        margin={"l": 10, "r": 10, "t": 90, "b": 40})
    return fig
