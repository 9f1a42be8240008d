"""HSDP (ZeRO sharded within groups of consecutive data-parallel ranks, the groups
replicated): priced against full sharding and chosen only where it is faster and fits.
Its execution (FSDP2 on a 2-D mesh) is checked against single-device training in
test_equivalence.py and resumed from a checkpoint in test_checkpoint.py."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_plan
from autopar.models import GPT, GPTConfig


def _cluster(inter_gb_per_s: float) -> dict:
    """4 nodes of 4 H100s, the nodes joined by ``inter_gb_per_s`` per device."""
    return {"nodes": 4, "devices_per_node": 4, "device": {"preset": "H100-80GB"},
            "inter_node_link": {"bandwidth_gb_per_s": inter_gb_per_s, "latency_us": 10}}


@pytest.fixture(scope="module")
def traced():
    model = GPT(GPTConfig(block_size=128, vocab_size=4096, n_layer=4, n_head=4, n_embd=256))
    idx = torch.randint(0, 4096, (4, 128))
    return autopar.trace(model, (idx, idx))


def _plan(traced, inter: float = 3.0, **pins) -> Plan:
    # 8 microbatches per step: full sharding gathers every layer across nodes 8 times over,
    # HSDP inside each node, all-reducing its gradient shards across nodes once
    pins = {"zero": 3, "dp": 16, "global_batch": 128, "microbatch": 1,
            "recompute": ("none",), **pins}
    return autopar.plan(traced, _cluster(inter), **pins)


def _solved(plan: Plan) -> dict[int, dict]:
    """The fastest solved candidate per dp_replicate."""
    out: dict[int, dict] = {}
    for c in plan.solver["candidates"]:
        if "step_time_s" in c:
            r = c.get("dp_replicate", 1)
            if r not in out or c["step_time_s"] < out[r]["step_time_s"]:
                out[r] = c
    return out


def test_hsdp_is_chosen_where_it_keeps_the_gathers_inside_nodes(traced, tmp_path) -> None:
    plan = _plan(traced)
    assert plan.training["dp_replicate"] == 4  # one group of 4 ranks per node
    solved = _solved(plan)
    assert set(solved) == {1, 4}  # both priced, the faster kept
    assert solved[4]["step_time_s"] < solved[1]["step_time_s"]
    assert plan.predicted["step_time_s"] == pytest.approx(solved[4]["step_time_s"])
    assert "hsdp      ZeRO-3 shards within 4 data-parallel ranks" in format_plan(plan, "gpt")
    path = tmp_path / "plan.json"  # the plan file carries it, validated on load
    plan.save(path)
    assert Plan.load(path).training["dp_replicate"] == 4


def test_hsdp_states_are_sharded_within_a_group_only(traced) -> None:
    full = _plan(traced, dp_replicate=1).predicted["memory"]
    hsdp = _plan(traced, dp_replicate=4).predicted["memory"]
    for part in ("params", "grads", "optimizer"):
        # each state sharded over 4 ranks instead of 16 (sizes rounded per shard)
        assert hsdp[part] == pytest.approx(4 * full[part], rel=0.02), part


def test_full_sharding_where_hsdp_does_not_fit(traced) -> None:
    solved = _solved(_plan(traced))
    between = (solved[1]["peak_memory_bytes"] + solved[4]["peak_memory_bytes"]) / 2
    tight = _plan(traced, memory_fraction=between / (80 * 2**30))
    assert "dp_replicate" not in tight.training
    assert tight.predicted["peak_memory_bytes"] <= between


def test_fast_links_and_one_microbatch_keep_full_sharding_priced(traced) -> None:
    """With one microbatch HSDP moves as many bytes across nodes as full sharding does
    (its all-reduce of shards), so the choice follows the modelled times either way."""
    plan = _plan(traced, inter=400.0, microbatch=8)
    solved = _solved(plan)
    best = min(solved, key=lambda r: solved[r]["step_time_s"])
    assert plan.training.get("dp_replicate", 1) == best


@pytest.mark.parametrize("pins, words", [
    ({"dp_replicate": 3}, "does not split dp=16"),
    ({"dp_replicate": 16}, "groups of 2 or more"),
    ({"dp_replicate": 2, "zero": 0}, "ZeRO 1, 2 or 3"),
])
def test_a_pinned_dp_replicate_that_cannot_run_is_refused(traced, pins, words) -> None:
    with pytest.raises(autopar.AutoparError, match=words) as info:
        _plan(traced, **pins)
    assert info.value.where == "dp_replicate"


def test_a_plan_file_with_a_bad_dp_replicate_is_refused(traced, tmp_path) -> None:
    data = _plan(traced).to_dict()
    data["training"]["dp_replicate"] = 3
    with pytest.raises(autopar.AutoparError, match="training.dp_replicate"):
        Plan.from_dict(data)
