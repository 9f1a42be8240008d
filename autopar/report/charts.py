"""The report's charts about one step, as Plotly figures: the schedule timeline, memory per
rank, and the step's parts. Every axis, hover and label says modelled or measured."""

from __future__ import annotations

import plotly.graph_objects as go

from autopar.core.units import format_bytes, format_seconds
from autopar.report.facts import MemoryBar
from autopar.report.schedule import COMPUTE, DP, OPTIMIZER, TP, StepLanes
from autopar.report.timeline import BACKWARD, FORWARD, WEIGHT

TEMPLATE = "plotly_white"
KIND_STYLE = {  # kind -> (legend name, colour of the first chunk on a rank, of the second)
    FORWARD: ("forward", "#1f77b4", "#7fb5de"),
    BACKWARD: ("backward", "#d95f02", "#f5a36b"),
    WEIGHT: ("weight gradient (W)", "#2ca02c", "#8fd18f"),
    COMPUTE: ("forward + backward", "#1f77b4", "#1f77b4"),
    TP: ("tensor-parallel comm", "#17becf", "#17becf"),
    DP: ("data-parallel comm (exposed)", "#7f7f7f", "#7f7f7f"),
    OPTIMIZER: ("optimizer", "#9467bd", "#9467bd"),
}
MEMORY_COLOURS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c",
                  "activations": "#d62728", "buffers": "#9467bd", "temporaries": "#8c564b",
                  "fragmentation": "#bcbd22"}
STEP_COLOURS = {"compute": "#1f77b4", "tensor-parallel comm": "#17becf",
                "pipeline bubble": "#e6e6e6", "data-parallel comm (exposed)": "#7f7f7f",
                "pipeline p2p": "#bcbd22", "optimizer": "#9467bd", "other": "#8c564b"}
GIB = 2**30
UNIFORM_TEXT = {"minsize": 9, "mode": "hide"}  # labels that do not fit are left out


def title_of(text: str, subtitle: str = "") -> dict:
    out: dict = {"text": text, "x": 0.01, "xanchor": "left"}
    if subtitle:
        out["subtitle"] = {"text": subtitle}
    return out


def timeline_figure(step: StepLanes, pp: int) -> go.Figure:
    """Blocks per lane on the step's time axis (ms, modelled); gaps are bubbles."""
    fig = go.Figure()
    for kind, (name, first, second) in KIND_STYLE.items():
        segs = [s for s in step.segments if s.kind == kind]
        if not segs:
            continue
        colours = [second if s.chunk is not None and (s.chunk // pp) % 2 else first for s in segs]
        fig.add_trace(go.Bar(
            name=name, orientation="h", y=[s.lane for s in segs],
            x=[(s.end - s.start) * 1e3 for s in segs], base=[s.start * 1e3 for s in segs],
            marker={"color": colours, "line": {"color": "white", "width": 0.5}},
            text=["" if s.microbatch is None else str(s.microbatch) for s in segs],
            textposition="inside", insidetextanchor="middle", textangle=0,
            hovertext=[f"{s.text}<br>{format_seconds(s.start)} to {format_seconds(s.end)} "
                       f"({format_seconds(s.end - s.start)}, modelled)" for s in segs],
            hoverinfo="text"))
    ticks = [lane + (f"<br>idle {format_seconds(step.idle_s[lane])} (modelled)"
                     if lane in step.idle_s else "") for lane in step.lanes]
    sub = (f"pipeline span {format_seconds(step.simulated_span_s)} as simulated, "
           f"{format_seconds(step.modelled_span_s)} by the plan's formula (compute + tp + "
           "bubble + p2p); both modelled" if step.idle_s else
           f"step {format_seconds(step.simulated_span_s)} (modelled)")
    fig.update_layout(
        template=TEMPLATE, barmode="overlay", bargap=0.25, uniformtext=UNIFORM_TEXT, title=title_of(step.title, sub),
        height=170 + 70 * len(step.lanes), margin={"l": 10, "r": 10, "t": 90, "b": 50},
        legend={"orientation": "h", "y": -0.25 if len(step.lanes) < 3 else -0.15},
        xaxis={"title": {"text": "time within the step (ms, modelled)"}, "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": step.lanes, "autorange": "reversed",
               "tickvals": step.lanes, "ticktext": ticks, "automargin": True})
    return fig


def memory_figure(bars: list[MemoryBar], capacity: float) -> go.Figure:
    """Stacked bytes per rank at its peak (GiB, modelled) against the device's capacity."""
    fig = go.Figure()
    labels = [b.label for b in bars]
    for part, colour in MEMORY_COLOURS.items():
        values = [b.parts.get(part, 0.0) for b in bars]
        if not any(values):
            continue
        fig.add_trace(go.Bar(
            name=part, x=labels, y=[v / GIB for v in values], marker_color=colour,
            hovertext=[f"{b.label}: {part} {format_bytes(v)} (modelled)"
                       for b, v in zip(bars, values)], hoverinfo="text"))
    top = max([b.total for b in bars] + [capacity])
    fig.add_trace(go.Scatter(
        x=labels, y=[b.total / GIB for b in bars], mode="text", showlegend=False,
        text=[f"{format_bytes(b.total)} (modelled)"
              + (f"<br>+ {format_bytes(b.host)} host" if b.host else "") for b in bars],
        textposition="top center", hoverinfo="skip"))
    if capacity > 0:
        fig.add_hline(y=capacity / GIB, line={"color": "#d62728", "dash": "dash"},
                      annotation_text=f"device capacity {format_bytes(capacity)} (spec)",
                      annotation_position="top left")
    fig.update_layout(
        template=TEMPLATE, barmode="stack", height=460,
        title=title_of(f"Memory per {'device' if len(bars) == 1 else 'pipeline rank'} at "
                       "its peak — modelled",
                     "stacked by category; the dashed line is the device's memory"),
        yaxis={"title": {"text": "GiB (modelled)"}, "range": [0, top / GIB * 1.12]},
        margin={"l": 10, "r": 10, "t": 90, "b": 40})
    return fig


def breakdown_figure(parts: list[tuple[str, float]], step_s: float,
                     measured_s: float | None = None) -> go.Figure:
    """The modelled step as stacked parts (ms), beside the measured step when there is one."""
    fig = go.Figure()
    rows = ["predicted (modelled)"] + (["measured (median step)"] if measured_s else [])
    for name, seconds in parts:
        fig.add_trace(go.Bar(
            name=name, orientation="h", y=[rows[0]], x=[seconds * 1e3],
            marker_color=STEP_COLOURS.get(name),
            text=[format_seconds(seconds)] if seconds > 0.03 * step_s else [""],
            textposition="inside", insidetextanchor="middle", textangle=0,
            hovertext=[f"{name}: {format_seconds(seconds)} (modelled), "
                       f"{seconds / step_s:.1%} of the step" if step_s else name],
            hoverinfo="text"))
    if measured_s:
        fig.add_trace(go.Bar(
            name="measured step", orientation="h", y=[rows[1]], x=[measured_s * 1e3],
            marker_color="#444", text=[f"{format_seconds(measured_s)} (measured)"],
            textposition="inside", hovertext=[f"median step time {format_seconds(measured_s)} "
                                              "(measured)"], hoverinfo="text"))
    fig.update_layout(
        template=TEMPLATE, barmode="stack", height=260 + 40 * len(rows),
        uniformtext=UNIFORM_TEXT, legend_traceorder="normal",
        title=title_of("Step-time breakdown — modelled" + (" vs measured" if measured_s else ""),
                     f"step {format_seconds(step_s)} (modelled)"),
        xaxis={"title": {"text": "ms per step"}},
        yaxis={"automargin": True, "autorange": "reversed"},
        legend={"orientation": "h", "y": -0.35}, margin={"l": 10, "r": 10, "t": 90, "b": 40})
    return fig
