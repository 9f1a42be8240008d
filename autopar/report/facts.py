"""What the report's charts and tables show, read from a plan (all modelled unless named
measured): memory per pipeline rank, the step's parts, and the candidates the search
compared with the reason each lost. Plain data, no drawing, so it is tested directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.core.plan import Plan

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "temporaries",
                "fragmentation")
"""Device-memory categories, bottom of the stack first (``host`` is CPU memory: shown apart)."""

STEP_PARTS = (("compute_s", "compute"), ("tp_comm_s", "tensor-parallel comm"),
              ("bubble_s", "pipeline bubble"), ("dp_exposed_s", "data-parallel comm (exposed)"),
              ("p2p_s", "pipeline p2p"), ("optimizer_s", "optimizer"))
"""The parts of ``predicted.step_time_s`` (``autopar.solver.pricing.evaluate.assemble``), in order."""


@dataclass(frozen=True)
class MemoryBar:
    """One device's modelled bytes by category at its peak."""

    label: str
    parts: dict[str, float]
    host: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def memory_bars(plan: Plan) -> tuple[list[MemoryBar], list[str]]:
    """A bar per pipeline rank (one for the device without a pipeline), and notes.

    The plan's per-stage memory leaves out data-parallel buffers (bucket and gathered-weight
    bytes), which ``predicted.memory`` adds for the rank with the highest peak: that rank's
    bar is ``predicted.memory``."""
    peak = plan.predicted.get("memory", {})
    stages = plan.pipeline.get("stages") or []
    if plan.mesh.get("pp", 1) <= 1 or not stages:
        return [MemoryBar("device", _parts(peak), float(peak.get("host", 0.0)))], []
    bars, used_peak = [], False
    for s in sorted(stages, key=lambda s: s["rank"]):
        mem = s.get("memory") or {"activations": float(s.get("memory_bytes", 0.0))}
        is_peak = not used_peak and all(
            float(mem.get(k, 0.0)) == float(peak.get(k, 0.0))
            for k in MEMORY_PARTS if k != "buffers")
        used_peak |= is_peak
        src = peak if is_peak else mem
        bars.append(MemoryBar(f"rank {s['rank']}", _parts(src), float(src.get("host", 0.0))))
    notes = ["Data-parallel buffers are in the plan for the rank with the highest peak only; "
             "the other ranks' bars leave them out."] if len(bars) > 1 else []
    return bars, notes


def _parts(mem: dict[str, Any]) -> dict[str, float]:
    return {k: float(mem.get(k, 0.0)) for k in MEMORY_PARTS}


def step_parts(plan: Plan) -> list[tuple[str, float]]:
    """(part, seconds) of the modelled step; "other" when the parts fall short of the step."""
    p = plan.predicted
    parts = [(name, float(p.get(key, 0.0) or 0.0)) for key, name in STEP_PARTS]
    rest = float(p.get("step_time_s", 0.0)) - sum(s for _, s in parts)
    if rest > 1e-6 * max(float(p.get("step_time_s", 0.0)), 1e-12):
        parts.append(("other", rest))
    return parts


# --- candidates ------------------------------------------------------------------------

@dataclass
class Candidates:
    """The search's candidates: those with a prediction (to plot), the chosen one's index,
    and every candidate's reason for losing, grouped."""

    solved: list[dict[str, Any]]
    chosen: int | None  # index into ``solved``
    reasons: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    total: int = 0


def _plan_setting(plan: Plan) -> dict[str, Any]:
    mesh, pipe = plan.mesh, plan.pipeline
    want = {"pp": mesh.get("pp", 1), "dp": mesh.get("dp", 1), "tp": mesh.get("tp", 1),
            "zero": plan.training.get("zero"), "microbatch": plan.batch.get("microbatch"),
            "microbatches": plan.batch.get("microbatches")}
    if mesh.get("pp", 1) > 1:
        want.update(schedule=pipe.get("schedule"), virtual=pipe.get("virtual_stages", 1))
    return want


def candidates(plan: Plan) -> Candidates:
    """The candidates of ``plan.solver``, the chosen one found by its setting and step time
    (the plan's own figures), and why each other one lost."""
    rows = [c for c in plan.solver.get("candidates", []) if isinstance(c, dict)]
    solved = [c for c in rows if isinstance(c.get("step_time_s"), (int, float))
              and isinstance(c.get("peak_memory_bytes"), (int, float))]
    step = float(plan.predicted.get("step_time_s", 0.0))
    want = _plan_setting(plan)
    same = [i for i, c in enumerate(solved)
            if all(c.get(k, want[k]) == want[k] for k in want)] or list(range(len(solved)))
    chosen = min(same, key=lambda i: abs(solved[i]["step_time_s"] - step)) if same else None
    if chosen is not None and abs(solved[chosen]["step_time_s"] - step) > 1e-9 * max(step, 1):
        chosen = None  # no candidate has the plan's figures (a hand-edited plan)
    out = Candidates(solved, chosen, total=len(rows))
    for c in rows:
        if chosen is not None and c is solved[chosen]:
            continue
        out.reasons.setdefault(_reason(c, step), []).append(c)
    return out


def _reason(c: dict[str, Any], chosen_step: float) -> str:
    status = str(c.get("status", ""))
    head, _, rest = status.partition("(")
    if head in ("SKIPPED", "PRUNED", "REJECTED"):
        return f"{head.lower()}: {rest.rstrip(')')}" if rest else head.lower()
    if "step_time_s" not in c:
        return f"not solved: {status.lower() or 'no status'}"
    t = float(c["step_time_s"])
    if abs(t - chosen_step) <= 1e-9 * max(chosen_step, 1e-12):
        return ("as fast as the chosen plan: ties go to fewer pipeline stages, smaller tp, "
                "lower ZeRO stage")
    if t < chosen_step:
        return ("predicted faster, but beyond the cost model's validated ground, where a "
                "layout must win by the model's error there (--extrapolation-margin)")
    return "solved, slower than the chosen plan (modelled)"


def ground_rows(plan: Plan) -> list[dict[str, Any]]:
    """The plan's per-scheme labels: validated against measured runs, or extrapolated."""
    return [g for g in plan.predicted.get("ground", []) if isinstance(g, dict)]
