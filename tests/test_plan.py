"""Plans: the solver's choices on known cases, determinism, JSON round trip, plan checks."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cli.load import trace_model
from autopar.errors import PlanError
from autopar.models import GPT, GPTConfig
from autopar.plan import Plan


@pytest.fixture(scope="module")
def tiny_gpt_plan() -> Plan:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    return autopar.plan(model, "2xcpu", (idx, idx))


def test_required_fields_present(tiny_gpt_plan: Plan) -> None:
    data = json.loads(tiny_gpt_plan.to_json())
    assert isinstance(data["schema_version"], int)
    assert data["mesh"]["dp"] * data["mesh"]["tp"] == 2
    for key in ("step_time_s", "peak_memory_bytes", "tflops_per_device", "tokens_per_s"):
        assert data["predicted"][key] > 0, key
    assert data["solver"]["status"] == "OPTIMAL"
    assert data["solver"]["wall_s"] >= 0
    assert data["model"]["params"] == sum(
        p.numel() for p in GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2,
                                          n_embd=32)).parameters()
    )
    assert len(data["model"]["fingerprint"]) == 16
    assert data["cluster"]["devices"] == 2


def test_round_trips_exactly(tiny_gpt_plan: Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    tiny_gpt_plan.save(path)
    loaded = Plan.load(path)
    assert loaded == tiny_gpt_plan
    assert loaded.to_json() == tiny_gpt_plan.to_json()


def test_strategies_parse_back(tiny_gpt_plan: Plan) -> None:
    for name in tiny_gpt_plan.strategies:
        assert tiny_gpt_plan.strategy(name, "tp") is not None
        assert tiny_gpt_plan.strategy(name, "dp") is not None


def test_other_model_is_rejected(tiny_gpt_plan: Plan) -> None:
    with pytest.raises(PlanError) as e:
        tiny_gpt_plan.check_model("0123456789abcdef", "MyModel")
    text = str(e.value)
    assert tiny_gpt_plan.model["fingerprint"] in text and "0123456789abcdef" in text
    assert "re-plan" in text


def test_other_schema_version_is_rejected(tiny_gpt_plan: Plan) -> None:
    data = tiny_gpt_plan.to_dict()
    data["schema_version"] = 99
    with pytest.raises(PlanError, match="schema version 99"):
        Plan.from_dict(data)


def test_same_inputs_same_plan() -> None:
    def make() -> str:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=64))
        idx = torch.randint(0, 64, (8, 16))
        plan = autopar.plan(model, "tests/clusters/cpu-fast-links.yaml", (idx, idx))
        plan.solver["wall_s"] = 0.0
        for c in plan.solver["candidates"]:
            c["wall_s"] = 0.0
        return plan.to_json()

    assert make() == make()


def test_small_gpt_on_8_a100_is_pure_data_parallel() -> None:
    traced = trace_model("gpt-125m", None, None)
    plan = autopar.plan(traced.gm, "8xA100-80GB", global_batch=traced.batch)
    assert plan.mesh == {"dp": 8, "tp": 1}
    assert not plan.layers  # nothing sharded on tp


def _param(plan: Plan, suffix: str) -> str:
    (placement,) = [ax["tp"] for fqn, ax in plan.params.items() if fqn.endswith(suffix)][:1]
    return placement


def test_megatron_pairing_comes_out_of_the_solver() -> None:
    """Llama-3-8B layers on one 8xH100 node with tp pinned to 8 and a batch too small to
    split 8 ways: q/k/v and gate/up are split by output features (column), down by input
    features (row) — found by the solver, not written for Llama. (o_proj is free to take
    another layout: with sequence parallelism an all-to-all into a sequence-split o_proj
    can beat the row-parallel reduce-scatter.)"""
    pytest.importorskip("transformers")
    traced = trace_model("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,"
                         "seq=4096,batch=2", None, None)
    plan = autopar.plan(traced.gm, "8xH100-80GB", global_batch=2, tp=8)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        assert _param(plan, f"layers.0.{name}.weight") == "S(0)", name
    assert _param(plan, "layers.0.mlp.down_proj.weight") == "S(1)"
    # And the MLP computes as Megatron's pair: column-parallel matmuls feed a row-parallel
    # one whose partial sums are reduced once.
    layer = next(row for row in plan.layers if row["block"] == "model.layers")["strategies"]
    matmuls = [s for name, s in layer.items() if "aten.linear" in name]
    assert matmuls.count("(R,S(0))->(S(2))") >= 5  # q, k, v, gate, up
    assert "(S(2),S(1))->(P)" in matmuls  # down


@pytest.mark.slow
def test_llama3_70b_needs_tensor_parallelism_inside_nodes() -> None:
    pytest.importorskip("transformers")
    traced = trace_model("llama3-70b", None, None)
    plan = autopar.plan(traced.gm, "16x8xH100-80GB", global_batch=traced.batch)
    assert plan.mesh["tp"] > 1 and 8 % plan.mesh["tp"] == 0
    assert plan.predicted["peak_memory_bytes"] <= 80 * 2**30
    # Without tensor parallelism (and without recomputing activations) no plan fits.
    with pytest.raises(autopar.errors.NoFeasiblePlanError, match="fits on no mesh"):
        autopar.plan(traced.gm, "16x8xH100-80GB", global_batch=traced.batch, tp=1,
                     recompute=("none",))
