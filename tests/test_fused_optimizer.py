"""torch's fused AdamW (one kernel per step: 28 B per parameter) is priced apart from its
default foreach AdamW (~96 B), with the same states: a plan says which the user builds."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError
from autopar.cost_models.compute import optimizer_step_time
from autopar.cost_models.memory import optimizer_state_bytes
from autopar.models import GPT, GPTConfig


def test_fused_adamw_moves_the_floor_of_bytes_and_keeps_the_same_states():
    device = load_cluster("H200").device
    fused = optimizer_step_time(1e9, "adamw_fused", device)
    foreach = optimizer_step_time(1e9, "adamw", device)
    assert fused == pytest.approx(foreach * 28 / 96)
    assert optimizer_state_bytes(1000, "adamw_fused") == optimizer_state_bytes(1000, "adamw")


def test_a_plan_prices_the_optimizer_it_is_told():
    gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    plans = {name: autopar.plan(gpt, "1xH100-80GB", (idx, idx), optimizer=name)
             for name in ("adamw", "adamw_fused")}
    assert (plans["adamw_fused"].predicted["optimizer_s"]
            < plans["adamw"].predicted["optimizer_s"])
    assert plans["adamw_fused"].training["optimizer"] == "adamw_fused"
    with pytest.raises(AutoparError, match="optimizer"):
        autopar.plan(gpt, "1xH100-80GB", (idx, idx), optimizer="adamw-fused")
