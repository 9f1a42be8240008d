"""The report's HTML tables: the chosen plan's figures, where the cost model is validated,
and why the other candidates lost. Every value escaped; every number labelled modelled,
measured, or what else it is (a choice, a device's spec)."""

from __future__ import annotations

from html import escape
from typing import Any

from autopar.core.plan import Plan
from autopar.core.plan_summary import setting_text
from autopar.core.units import format_bytes, format_count, format_seconds
from autopar.report.facts import Candidates
from autopar.report.measured import RunSteps

EXAMPLES = 50
"""Settings listed under each reason a candidate lost (the rest are counted)."""


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    """An HTML table of already-escaped cells."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _tag(label: str) -> str:
    return f'<span class="tag tag-{escape(label.split()[0])}">{escape(label)}</span>'


def summary_table(plan: Plan, run: RunSteps | None) -> str:
    """The chosen plan's headline figures, first thing on the page."""
    p, b, t = plan.predicted, plan.batch, plan.training
    cap = float(p.get("memory_capacity_bytes", 0.0))
    peak = float(p.get("peak_memory_bytes", 0.0))
    mesh = " × ".join(f"{a}={n}" for a, n in plan.mesh.items())
    rows: list[tuple[str, str, str]] = [
        ("step time", format_seconds(float(p.get("step_time_s", 0.0))), "modelled"),
        ("throughput", f"{float(p.get('tokens_per_s', 0.0)):,.0f} tokens/s; "
         f"{float(p.get('tflops_per_device', 0.0)):.1f} TFLOP/s per device; "
         f"MFU {float(p.get('mfu', 0.0)):.1%}", "modelled"),
        ("peak memory per device", format_bytes(peak) + (f" of {format_bytes(cap)} "
         f"({peak / cap:.0%})" if cap else ""), "modelled"),
        ("mesh", f"{mesh} on {plan.world_size} devices", "chosen"),
        ("batch", f"{b.get('global')} sequences × {b.get('seq')} tokens; microbatch "
         f"{b.get('microbatch')} × {b.get('microbatches')} per data-parallel rank", "chosen"),
        ("training", f"{t.get('precision')}, {t.get('optimizer')}, ZeRO-{t.get('zero')}, "
         f"recompute {t.get('recompute')}", "chosen"),
    ]
    pipe = plan.pipeline
    if plan.mesh.get("pp", 1) > 1 and pipe:
        rows.append(("pipeline", f"{pipe.get('schedule')}, {pipe.get('virtual_stages', 1)} "
                     f"chunk(s) per rank, {pipe.get('microbatches')} microbatches", "chosen"))
        rows.append(("pipeline bubble", f"{format_seconds(float(pipe.get('bubble_s', 0.0)))} "
                     f"({float(pipe.get('bubble_fraction', 0.0)):.1%} of the microbatches' "
                     "work)", "modelled"))
    s = plan.solver
    rows.append(("solver", f"{s.get('status', '')} in "
                 f"{format_seconds(float(s.get('wall_s', 0.0)))}, "
                 f"{len(s.get('candidates', []))} candidates considered", "measured"))
    for solve in s.get("plan_solves", []):
        gap = "" if solve.get("gap") is None else f", gap {100 * solve['gap']:.2f}%"
        again = " (reused)" if solve.get("reused") else ""
        rows.append((f"{solve['what']} solve", f"{solve['outcome']}{gap}{again}",
                     "CP-SAT, within the model"))
    if s.get("interrupted"):
        rows.append(("search", "interrupted (Ctrl-C): the best plan found so far", "measured"))
    if run is not None:
        err = run.median_s / run.predicted_s - 1 if run.predicted_s else 0.0
        rows.append(("step time, run", f"{format_seconds(run.median_s)} median past the "
                     f"warm-up ({err:+.1%} against the prediction)", "measured"))
    params = plan.model.get("params")
    if isinstance(params, (int, float)):
        rows.insert(0, ("model", f"{plan.model.get('name', '')}: "
                        f"{format_count(params)} parameters", "counted from the trace"))
    return _table(["", "chosen plan", ""],
                  [[escape(k), escape(v), _tag(lab)] for k, v, lab in rows], "summary")


def ground_table(rows: list[dict[str, Any]]) -> str:
    """Each parallel scheme of the plan: validated against measured runs, or extrapolated."""
    if not rows:
        return "<p>The plan carries no validated-ground labels.</p>"
    out = []
    for g in rows:
        label = "validated" if g.get("validated") else "extrapolated"
        med, worst = g.get("median_error"), g.get("worst_error")
        out.append([
            escape(f"{g.get('scheme')}={g.get('degree')}"), _tag(label),
            escape(str(g.get("validated_up_to", "—"))),
            escape(f"{med:.0%}" if isinstance(med, (int, float)) else "—"),
            escape(f"{worst:.0%}" if isinstance(worst, (int, float)) else "—"),
            escape(", ".join(g.get("sources", [])) or "—"), escape(str(g.get("text", "")))])
    return _table(["scheme", "label", "validated up to (devices)",
                   "median error, modelled vs measured", "worst error, modelled vs measured",
                   "measured on", "what the plan says"], out, "ground")


def reasons_table(cands: Candidates) -> str:
    """Why the other candidates lost, one row per reason, with the settings behind it."""
    if not cands.reasons:
        return "<p>The plan lists no other candidates.</p>"
    rows = []
    for reason, group in sorted(cands.reasons.items(), key=lambda kv: -len(kv[1])):
        items = "".join(f"<li>{escape(_line(c))}</li>" for c in group[:EXAMPLES])
        more = (f"<li>… and {len(group) - EXAMPLES} more</li>" if len(group) > EXAMPLES
                else "")
        rows.append([escape(reason), str(len(group)),
                     f"<details><summary>{escape(_line(group[0]))}</summary><ul>{items}{more}"
                     "</ul></details>"])
    return _table(["why it lost", "candidates", "settings (step time and memory modelled)"],
                  rows, "reasons")


def _line(c: dict[str, Any]) -> str:
    text = setting_text(c)
    if isinstance(c.get("step_time_s"), (int, float)):
        text += (f": step {format_seconds(c['step_time_s'])}, peak "
                 f"{format_bytes(c.get('peak_memory_bytes', 0))} (modelled)")
    return text
