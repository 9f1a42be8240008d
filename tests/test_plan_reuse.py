"""Tracing a deep stack of alike layers by exporting two and three layers and repeating
the last (autopar.trace.repeat) gives exactly the graph, facts and plan of the whole export;
planning shares one problem skeleton across tp degrees without changing the plan."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.graph_facts import META_KEY
from autopar.models.gpt import GPT, GPTConfig
from autopar.trace import capture as export_module
from autopar.trace.capture import _export, export_model
from autopar.trace.inputs import split_example_inputs
from autopar.trace.repeat import _same, export_repeated, find_stack
from tests import hf_zoo

LAYERS = 5


def _gpt():
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=LAYERS, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, (idx, idx)


def _llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**hf_zoo._DEC, "num_hidden_layers": LAYERS},
                                   **hf_zoo._LLAMA_LIKE)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
    ids = hf_zoo._tokens(1)
    return model, ((), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})


BUILDERS = {"gpt": _gpt, "llama": _llama}


def _facts(gm) -> list:
    return [(n.name, n.meta[META_KEY]) for n in gm.graph.nodes]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def traced(request):
    """(model, inputs, graph traced whole, graph traced by repeating)."""
    model, inputs = BUILDERS[request.param]()
    args, kwargs = split_example_inputs(inputs, torch.device("cpu"))
    assert find_stack(model) is not None
    repeated = export_repeated(model, args, kwargs, _export)
    assert repeated is not None, "the stack should be traced by repeating"
    whole, _ = export_model(model, args, kwargs, repeat=False)
    return model, inputs, whole, repeated


def test_repeated_graph_equals_whole_export(traced) -> None:
    _, _, whole, repeated = traced
    assert _same(whole.graph, repeated.graph)
    assert whole.code == repeated.code


def test_repeated_facts_equal_whole_trace(traced, monkeypatch) -> None:
    model, inputs, _, _ = traced
    fast = autopar.trace(model, inputs)
    real = export_module.export_model
    # autopar.trace is the function; its globals are the package's
    monkeypatch.setitem(autopar.trace.__globals__, "export_model",
                        lambda m, a, k: real(m, a, k, repeat=False))
    slow = autopar.trace(model, inputs)
    assert _facts(fast) == _facts(slow)
    assert fast.meta[META_KEY] == slow.meta[META_KEY]
    for name, p in slow.named_parameters():
        assert fast.get_parameter(name) is p
    plan_fast = autopar.plan(fast, "2xcpu", tp=2)
    plan_slow = autopar.plan(slow, "2xcpu", tp=2)
    assert plan_fast.to_dict()["strategies"] == plan_slow.to_dict()["strategies"]
    assert plan_fast.predicted == plan_slow.predicted


def test_repeated_graph_runs_like_the_model(traced) -> None:
    model, inputs, whole, repeated = traced
    args, kwargs = split_example_inputs(inputs, torch.device("cpu"))
    torch.testing.assert_close(repeated(*args, **kwargs), whole(*args, **kwargs))


def test_layers_that_differ_are_traced_whole() -> None:
    model, inputs = _gpt()
    model.transformer.h[3].attn.dropout_p = 0.5  # hypothetical per-layer difference
    model.transformer.h[3].extra = "different"
    assert find_stack(model) is None


def test_shallow_stacks_are_traced_whole() -> None:
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    assert find_stack(model) is None


@pytest.mark.parametrize("build", sorted(BUILDERS))
def test_batch_marking_asks_each_layer_kind_once(build, monkeypatch) -> None:
    """The batch dimension is marked once per layer kind and input placements, then copied
    to the alike layers: the same strategies as asking every node's rule."""
    from autopar.analysis import batch_axis

    model, inputs = BUILDERS[build]()
    gm = autopar.trace(model, inputs)
    batch = autopar.core.graph_facts.graph_facts(gm).batch_size
    asked: list[str] = []
    real = batch_axis.strategies_for
    monkeypatch.setattr(batch_axis, "strategies_for",
                        lambda call, n: asked.append(call.target) or real(call, n))
    shared = batch_axis.batch_strategies(gm, batch)
    asked_shared = len(asked)
    monkeypatch.setattr(batch_axis, "_alike_layers", lambda gm: (lambda facts: None))
    assert batch_axis.batch_strategies(gm, batch) == shared
    assert asked_shared < len(asked) - asked_shared  # fewer rules asked
