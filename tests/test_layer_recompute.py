"""Recomputation per layer (modelled): the solver recomputes some layers and not others when
memory is just short, pinned per-layer modes are priced as given, and the plan says which."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.cli.load import trace_model
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError, PlanError
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_plan
from autopar.solver.model.layer_recompute import compose_units
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.evaluate import assemble
from autopar.solver.pricing.unit_costs import unit_costs
from autopar.solver.search.mesh_search import search

GPT16 = "gpt:layers=16,hidden=1024,heads=16,vocab=50304,seq=2048"
A100 = "1xA100-40GB"


@pytest.fixture(scope="module")
def gpt16():
    return trace_model(GPT16, 16, None).gm


def _plan(gm, fraction: float, **kw):
    return autopar.plan(gm, A100, global_batch=16, microbatch=8, memory_fraction=fraction,
                        precision="bf16", **kw)


def test_a_tight_budget_recomputes_some_layers_and_not_others(gpt16) -> None:
    fraction = 0.4
    plan = _plan(gpt16, fraction)
    modes = plan.training["recompute_layers"]
    assert plan.training["recompute"] == "mixed" and len(modes) == 16
    assert "none" in modes and len(set(modes)) == 2
    capacity = load_cluster(A100).device.memory_bytes * fraction
    assert plan.predicted["peak_memory_bytes"] <= capacity
    # keeping everything does not fit; recomputing every layer fits but is slower
    with pytest.raises(AutoparError):
        _plan(gpt16, fraction, recompute=("none",))
    uniform = [_plan(gpt16, fraction, recompute=(m,)).predicted["step_time_s"]
               for m in set(modes) - {"none"}]
    assert plan.predicted["step_time_s"] < min(uniform)
    # one row per run of layers under one mode, and the summary says so
    rows = [r for r in plan.layers if r["block"] != "<outside layers>"]
    assert {r["recompute"] for r in rows} == set(modes)
    assert "recompute per layer" in format_plan(plan, GPT16)
    assert Plan.from_json(plan.to_json()) == plan


def test_more_memory_recomputes_fewer_layers(gpt16) -> None:
    recomputed = []
    for fraction in (0.35, 0.4, 0.45):
        plan = _plan(gpt16, fraction)
        modes = plan.training.get("recompute_layers") or [plan.training["recompute"]] * 16
        recomputed.append(sum(m != "none" for m in modes))
    assert recomputed[0] >= recomputed[1] >= recomputed[2] and recomputed[0] > recomputed[2]


def test_composed_units_of_one_mode_are_that_mode(gpt16) -> None:
    options = PlanOptions(global_batch=16, microbatch=8, precision="bf16", recompute=("full",))
    cluster = load_cluster(A100)
    result = search(gpt16, cluster, options)
    tables, setting, choice = result.tables, result.best.setting, result.best.choice
    by_mode = {m: unit_costs(CostTables(result.problem, cluster, options,
                                        replace(setting, recompute=m), 16, 2048), choice)
               for m in ("none", "full")}
    for mode in ("none", "full"):
        uniform = assemble(tables, by_mode[mode], replace(setting, recompute=mode))
        mixed = assemble(tables, compose_units(by_mode, (mode,) * 16),
                         replace(setting, recompute="mixed", layer_recompute=(mode,) * 16))
        assert mixed.step_time_s == pytest.approx(uniform.step_time_s, rel=1e-12)
        assert mixed.peak_memory_bytes == pytest.approx(uniform.peak_memory_bytes, rel=1e-12)


def test_pinned_modes_per_layer(gpt16) -> None:
    modes = ("full",) * 4 + ("none",) * 12
    plan = _plan(gpt16, 0.9, recompute_layers=modes)
    assert plan.training["recompute_layers"] == list(modes)
    with pytest.raises(AutoparError) as e:
        _plan(gpt16, 0.9, recompute_layers=("full", "none"))
    assert e.value.where == "recompute_layers" and "16" in e.value.what
    with pytest.raises(AutoparError) as e:
        _plan(gpt16, 0.9, recompute_layers=("full", "sometimes") * 8)
    assert e.value.where == "PlanOptions.recompute_layers"


def test_first_pipeline_stage_recomputes_more() -> None:
    """Under 1F1B the first stage holds the most microbatches in flight, so a budget that
    fits the last stage whole makes the first recompute (modelled)."""
    gm = trace_model(GPT16, 32, None).gm
    fits = []
    for fraction in (0.15, 0.2, 0.25):
        plan = autopar.plan(gm, "2xA100-40GB", global_batch=32, microbatch=4, pp=2,
                            schedule="1f1b", memory_fraction=fraction, precision="bf16")
        if plan.training["recompute"] != "mixed":
            continue
        modes = plan.training["recompute_layers"]
        stages = [c["layers"] for c in plan.pipeline["chunks"]]
        per_stage = [sum(m != "none" for m in modes[a:b + 1]) / (b - a + 1) for a, b in stages]
        fits.append(per_stage)
    assert fits, "no budget gave a mixed pipeline plan"
    assert all(first >= last for first, last in fits) and any(f > s for f, s in fits)


def test_plan_schema_ties_mixed_to_its_modes(gpt16) -> None:
    data = _plan(gpt16, 0.4).to_dict()
    del data["training"]["recompute_layers"]
    with pytest.raises(PlanError) as e:
        Plan.from_dict(data)
    assert e.value.where == "training.recompute_layers"
