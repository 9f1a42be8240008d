"""One setting the search considered, as plans and reports show it: what was tried, how
it ended (solved, pruned, skipped, rejected) and what it was predicted to cost."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.solver.pricing.evaluate import Prediction
from autopar.solver.setting import Setting


@dataclass
class Candidate:
    setting: Setting
    status: str  # OPTIMAL / FEASIBLE / INFEASIBLE / PRUNED(...) / SKIPPED(...)
    prediction: Prediction | None = None
    choice: list[int] | None = None
    wall_s: float = 0.0
    # The CP-SAT solves behind this candidate (``cpsat.solve_stats``): its layout's, marked
    # "reused" when solved for another setting, and the per-layer recomputation's if any.
    solves: tuple[dict, ...] = ()

    def summary(self) -> dict:
        s = self.setting
        out = {
            "pp": s.pp, "dp": s.dp, "tp": s.tp, "zero": s.zero, "microbatch": s.microbatch,
            "microbatches": s.microbatches, "recompute": s.recompute, "status": self.status,
            "wall_s": round(self.wall_s, 4),
        }
        if s.ep > 1:
            out["ep"] = s.ep
        if s.dp_replicate > 1:
            out["dp_replicate"] = s.dp_replicate
        if s.pp > 1:
            out.update(schedule=s.schedule, virtual=s.virtual,
                       partition=list(s.partition) if s.partition else None)
        if self.prediction is not None:
            out["step_time_s"] = self.prediction.step_time_s
            out["peak_memory_bytes"] = int(self.prediction.peak_memory_bytes)
        solved_here = [s for s in self.solves if not s.get("reused")]
        if solved_here:
            out["solve_stats"] = solved_here
        return out
