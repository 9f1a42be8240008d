"""torchtitan's per-op recomputation policy (``recompute="op"``): what the cost model keeps,
and that the runtime's checkpoint policy trains exactly like no recomputation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.core.cluster import load_cluster
from autopar.models import resolve_model
from autopar.passes.checkpoint_layers import checkpointed
from autopar.solver.search.pinned import PinnedConfig, estimate_graph
from autopar.trace import trace

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=100,seq=32"


@pytest.fixture(scope="module")
def llama():
    spec = resolve_model(LLAMA)
    with torch.device("meta"):
        model = spec.build()
    return trace(model, spec.example_inputs(2, 32))


def _estimate(gm, recompute: str):
    cluster = load_cluster("1xH100-80GB")
    return estimate_graph(gm, cluster, PinnedConfig(recompute=recompute, precision="bf16"))


def test_op_policy_keeps_every_other_matmul_and_attention(llama) -> None:
    tables = _estimate(llama, "op").tables
    saved = tables.op_policy_saved
    per_layer: dict[int, list[str]] = {}
    for node in llama.graph.nodes:
        facts = node.meta.get("autopar")
        if node.name in saved and facts is not None:
            per_layer.setdefault(facts.layer, []).append(facts.target)
    assert set(per_layer) == {0, 1}
    for targets in per_layer.values():
        # q, v, gate and down projections of the 7 linears (q k v o gate up down), and SDPA
        assert targets.count("aten.linear.default") == 4
        assert sum("scaled_dot_product" in t for t in targets) == 1


def test_op_policy_prices_between_none_and_full(llama) -> None:
    none, op, full = (_estimate(llama, m).prediction for m in ("none", "op", "full"))
    acts = [sum(p.layer_activations.values()) for p in (none, op, full)]
    assert acts[0] > acts[1] > acts[2], acts
    compute = [p.compute_s for p in (none, op, full)]
    assert compute[0] < compute[1] < compute[2], compute


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.gate = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_op_checkpoint_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    plain = block(x).pow(2).sum()
    plain.backward()
    expected = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    checked = checkpointed(block, "op", 8, x).pow(2).sum()
    checked.backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    assert torch.equal(plain, checked)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
