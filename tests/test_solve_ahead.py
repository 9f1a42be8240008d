"""Layout solves run ahead on a second core (autopar.solver.search.solve_ahead) change how long a
plan takes, never which plan: the same graph and cluster give the same plan with the
worker as without it, and a solve taken from the worker is the one solved in turn."""

from __future__ import annotations

import torch

import autopar
import autopar.solver.search.solve_ahead as solve_ahead
from autopar.analysis.batch_axis import batch_strategies
from autopar.core.cluster.load import load_cluster
from autopar.models.gpt import GPT, GPTConfig
from autopar.solver.model.cpsat import build, run
from autopar.solver.model.problem import build_problem
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.setting import Setting


def _traced():
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    return autopar.trace(model, (idx, idx))


def _plan(gm, monkeypatch, cores: int, taken: list):
    monkeypatch.setattr(solve_ahead, "usable_cores", lambda: cores)
    close = solve_ahead.SolveAhead.close

    def counting_close(self):
        taken.append(self.taken)
        close(self)

    monkeypatch.setattr(solve_ahead.SolveAhead, "close", counting_close)
    # 8 A100s, global batch 64: meshes with several microbatch sizes and recompute modes
    return autopar.plan(gm, "8xA100-80GB", global_batch=64)


def test_the_same_plan_with_and_without_the_worker(monkeypatch) -> None:
    gm = _traced()
    taken_ahead: list = []
    taken_in_turn: list = []
    ahead = _plan(gm, monkeypatch, 2, taken_ahead)
    in_turn = _plan(gm, monkeypatch, 1, taken_in_turn)
    assert sum(taken_ahead) > 0, "the worker should have run solves the search then used"
    assert sum(taken_in_turn) == 0
    assert ahead.to_dict()["strategies"] == in_turn.to_dict()["strategies"]
    assert ahead.predicted == in_turn.predicted
    assert (ahead.mesh, ahead.training, ahead.batch) == (in_turn.mesh, in_turn.training,
                                                         in_turn.batch)


def test_a_solve_taken_from_the_worker_equals_one_solved_here() -> None:
    gm = _traced()
    problem = build_problem(gm, 2, batch_strategies(gm, 8))
    setting = Setting(dp=1, tp=2, zero=0, microbatch=8, microbatches=1)
    tables = CostTables(problem, load_cluster("2xA100-80GB"), PlanOptions(),
                        setting, 8, 16)
    here = run(build(tables, 10.0))
    ahead = solve_ahead.SolveAhead(cores=2)
    try:
        ahead.submit(("k",), build(tables, 10.0))
        assert not ahead.wants(("k",))
        taken = ahead.solve(("k",), lambda: build(tables, 10.0))
    finally:
        ahead.close()
    assert taken.choice == here.choice and taken.objective_s == here.objective_s
    # a key never submitted is solved on this thread
    other = solve_ahead.SolveAhead(cores=2)
    try:
        assert other.solve(("other",), lambda: build(tables, 10.0)).choice == here.choice
        assert other.taken == 0
    finally:
        other.close()
