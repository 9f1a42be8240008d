"""Optimality, stated: every CP-SAT solve reports its objective, best bound and gap, and the
plan says whether the solves that chose it were proved optimal or stopped at a time limit."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_plan
from autopar.models import GPT, GPTConfig
from autopar.solver.model.cpsat import solve_stats


def _plan(**pins) -> Plan:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    return autopar.plan(model, "2xcpu", (idx, idx), **pins)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan()


def test_every_solve_in_the_json_has_objective_bound_and_gap(plan: Plan) -> None:
    data = json.loads(plan.to_json())["solver"]
    solved = [s for c in data["candidates"] for s in c.get("solve_stats", [])]
    assert solved, "no candidate reports a solve"
    for s in solved + data["plan_solves"]:
        assert s["status"] in ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "UNKNOWN", "MODEL_INVALID")
        if s["status"] in ("OPTIMAL", "FEASIBLE"):
            assert s["objective"] >= s["bound"] >= 0
            assert 0.0 <= s["gap"] <= 1.0
        assert s["time_limit_s"] > 0 and s["wall_s"] >= 0


def test_the_plan_says_whether_it_was_proved_optimal(plan: Plan) -> None:
    solver = plan.solver
    assert solver["plan_solves"][0]["what"] == "layout"
    assert solver["proved_optimal"] == all(s["status"] == "OPTIMAL"
                                           for s in solver["plan_solves"])
    if solver["proved_optimal"]:
        assert solver["gap"] == pytest.approx(0.0, abs=1e-9)
    text = format_plan(plan, "tiny gpt")
    assert "layout solve" in text and ("proved optimal" in text or "time limit" in text)


def test_a_solve_stopped_at_its_time_limit_states_its_gap() -> None:
    stats = solve_stats("layout", "FEASIBLE", 2.0, 1.5, 3.0, 3.0, unit="s (modelled)")
    assert stats["gap"] == pytest.approx(0.25)
    assert "time limit (3 s)" in stats["outcome"] and "25.00%" in stats["outcome"]
    assert "proved optimal" in solve_stats("layout", "OPTIMAL", 1.0, 1.0, 0.1, 3.0,
                                           unit="s")["outcome"]
