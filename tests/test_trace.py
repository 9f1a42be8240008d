"""Tracing: what a user relies on in the annotated graph ``autopar.trace`` returns.

Every fact is checked against an independent source: node shapes against the fake values
export recorded, FLOPs against ``FlopCounterMode`` on the real model, saved-for-backward
bytes against what autograd really keeps (``saved_tensors_hooks``), parameter facts
against ``model.named_parameters()``.
"""

from __future__ import annotations

import json
import linecache
import math
import re
import resource
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.core.errors import TraceError
from autopar.core.graph_facts import META_KEY, GraphFacts, NodeFacts, graph_facts
from autopar.models import GPT, GPTConfig
from autopar.trace import TensorSpec

VOCAB = 97
BATCH, SEQ = 3, 12  # distinct from each other and from the models' max positions (16)
LAYERS = 3


# --- helpers ------------------------------------------------------------------------------


def facts(node: fx.Node) -> NodeFacts:
    return node.meta[META_KEY]


def fake_tensors(node: fx.Node) -> list[torch.Tensor]:
    """The tensors export recorded for a node (independently of autopar's helpers)."""
    return [t for t in tree_flatten(node.meta.get("val"))[0] if isinstance(t, torch.Tensor)]


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def ancestors_with_trainable_param(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that (transitively) read a trainable parameter."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        f = facts(node)
        if node.op == "get_attr" and f.param is not None and f.param.trainable:
            out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def gpt(n_layer: int = LAYERS, **overrides: Any) -> GPT:
    config = dict(block_size=16, vocab_size=VOCAB, n_layer=n_layer, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**config, **overrides}))


def token_batch(batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Two distinct tensors: torch.export merges a tensor passed twice into one input.
    return tuple(torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))


@dataclass
class Traced:
    name: str
    model: nn.Module
    args: tuple
    kwargs: dict
    gm: fx.GraphModule
    container: str  # the repeated-block container

    @property
    def graph(self) -> GraphFacts:
        return graph_facts(self.gm)

    def run(self) -> Any:
        return self.model(*self.args, **self.kwargs)


def _build(name: str) -> tuple[nn.Module, tuple, dict, str]:
    torch.manual_seed(0)
    idx, tgt = token_batch()
    if name == "gpt":
        return gpt(), (idx, tgt), {}, "transformer.h"
    pytest.importorskip("transformers")
    from autopar.models import hf

    kwargs = {"input_ids": idx, "labels": tgt, "use_cache": False}
    sizes = dict(layers=LAYERS, hidden=32, heads=4, vocab=VOCAB, seq=16)
    if name == "llama":
        return hf.build_llama(**sizes, kv_heads=2, ffn=64), (), kwargs, "model.layers"
    if name == "gpt2":
        return hf.build_gpt2(**sizes), (), kwargs, "transformer.h"
    if name == "mixtral":
        model = hf.build_mixtral(**sizes, kv_heads=2, ffn=64, experts=4, top_k=2)
        return model, (), kwargs, "model.layers"
    raise AssertionError(name)


MODELS = ["gpt", "llama", "gpt2", "mixtral"]


_TRACED: dict[str, Traced] = {}


def traced_model(name: str) -> Traced:
    """Each tiny model is built and traced once per session; tests only read it."""
    if name not in _TRACED:
        model, args, kwargs, container = _build(name)
        example = (args, kwargs) if kwargs else args
        _TRACED[name] = Traced(name, model, args, kwargs, autopar.trace(model, example), container)
    return _TRACED[name]


@pytest.fixture(params=MODELS)
def traced(request: pytest.FixtureRequest) -> Traced:
    return traced_model(request.param)


# --- node facts ---------------------------------------------------------------------------


def test_every_node_has_facts_matching_fake_values(traced: Traced) -> None:
    checked = 0
    for node in traced.gm.graph.nodes:
        f = facts(node)
        assert isinstance(f, NodeFacts), node.name
        assert (f.name, f.op) == (node.name, node.op)
        vals = fake_tensors(node)
        if node.op != "call_function" or not vals:
            continue
        shapes = tuple(tuple(int(s) for s in t.shape) for t in vals)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in vals)
        assert f.shapes == shapes, node.name
        assert f.dtypes == dtypes, node.name
        assert all(isinstance(s, int) for shape in f.shapes for s in shape)
        if not f.is_view:
            assert f.bytes_written == sum(numel(s) * t.element_size() for s, t in zip(shapes, vals))
        checked += 1
    assert checked > 50


def test_a_graph_traced_to_run_only_has_the_same_facts_less_its_costs() -> None:
    """``costs=False`` (parallelize's traces on ranks that do not plan): every fact a pass
    or the plan check reads is the same; only the planner's op costs are left out."""
    t = traced_model("gpt")
    bare = autopar.trace(t.model, t.args, costs=False)
    assert graph_facts(bare).fingerprint == graph_facts(t.gm).fingerprint
    pairs = list(zip(bare.graph.nodes, t.gm.graph.nodes, strict=True))
    assert not any(facts(b).fwd_flops or facts(b).saved_inputs for b, _ in pairs)
    keep = ("name", "shapes", "dtypes", "params", "is_view", "requires_grad", "bytes_read",
            "module_path")
    for b, full in pairs:
        assert all(getattr(facts(b), k) == getattr(facts(full), k) for k in keep), b.name
    assert any(facts(full).fwd_flops for _, full in pairs)


def test_linear_flops_are_2mnk(traced: Traced) -> None:
    linear, addmm = torch.ops.aten.linear.default, torch.ops.aten.addmm.default
    seen = both_grad = 0
    for node in traced.gm.graph.nodes:
        if node.target is linear:
            x, w = node.args[0], node.args[1]
            xs, ws = fake_tensors(x)[0].shape, fake_tensors(w)[0].shape
            m, k, n = numel(tuple(xs[:-1])), xs[-1], ws[0]
        elif node.target is addmm:  # GPT-2's Conv1D: addmm(bias, x[M, K], w[K, N])
            x, w = node.args[1], node.args[2]
            (m, k), n = fake_tensors(x)[0].shape, fake_tensors(w)[0].shape[1]
        else:
            continue
        f = facts(node)
        assert f.fwd_flops == 2 * m * n * k, node.name
        seen += 1
        if facts(x).requires_grad and facts(w).requires_grad:
            assert f.bwd_flops == 2 * f.fwd_flops, node.name
            both_grad += 1
    assert seen >= 4 * LAYERS
    assert both_grad == seen  # every projection here has a trainable weight and input


def test_linear_backward_flops_follow_requires_grad() -> None:
    """Input without grad: only the weight gradient (1x forward); frozen layer: none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))
    gm = autopar.trace(model, (torch.randn(5, 8),))
    first, second, third = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert facts(first).bwd_flops == facts(first).fwd_flops == 2 * 5 * 8 * 16
    assert facts(second).bwd_flops == 2 * facts(second).fwd_flops

    model[0].requires_grad_(False)
    gm = autopar.trace(model, (torch.randn(5, 8),))
    first, second, third = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert facts(first).bwd_flops == 0 and not facts(first).requires_grad
    assert facts(second).bwd_flops == facts(second).fwd_flops == 2 * 5 * 16 * 4
    assert facts(third).bwd_flops == 2 * facts(third).fwd_flops


def test_attention_has_flops(traced: Traced) -> None:
    sdpa = [
        n
        for n in traced.gm.graph.nodes
        if n.target is torch.ops.aten.scaled_dot_product_attention.default
    ]
    if traced.name == "gpt2":
        assert not sdpa  # built with eager attention: explicit matmuls instead
        return
    assert len(sdpa) == LAYERS
    for node in sdpa:
        q, k, v = (fake_tensors(a)[0] for a in node.args[:3])
        b, h, sq, d = q.shape
        sk, dv = k.shape[-2], v.shape[-1]
        f = facts(node)
        assert f.fwd_flops == 2 * b * h * sq * sk * d + 2 * b * h * sq * sk * dv > 0
        assert f.bwd_flops > f.fwd_flops


def test_total_forward_flops_match_flop_counter(traced: Traced) -> None:
    g = traced.graph
    nodes = [facts(n) for n in traced.gm.graph.nodes]
    assert g.fwd_flops == sum(f.fwd_flops for f in nodes)
    assert g.bwd_flops == sum(f.bwd_flops for f in nodes)
    with FlopCounterMode(display=False) as counter:
        traced.run()
    real = counter.get_total_flops()
    assert real > 0
    # Eager Mixtral runs its experts through torch._grouped_mm, whose FLOPs autopar registers
    # (autopar.ops.moe_ops); the trace counts Hugging Face's traced fallback op the same way.
    assert g.fwd_flops == pytest.approx(real, rel=0.01), (traced.name, g.fwd_flops, real)


def test_moe_expert_matmuls_have_flops() -> None:
    """Mixtral's experts are a grouped matmul (an opaque custom op in fp32): its FLOPs must
    still be counted, or the cost model ignores most of an MoE model's compute."""
    gm = traced_model("mixtral").gm
    grouped = [n for n in gm.graph.nodes if "grouped_mm" in str(facts(n).target)]
    assert grouped, "expected the experts' grouped matmuls in the graph"
    for node in grouped:
        x, w = (fake_tensors(a)[0] for a in node.args[:2])
        rows, k = x.shape
        n = w.shape[-1]
        assert facts(node).fwd_flops == 2 * rows * k * n, (node.name, facts(node).target)


# --- parameters -----------------------------------------------------------------------------


def test_param_facts_match_the_model(traced: Traced) -> None:
    params = dict(traced.model.named_parameters(remove_duplicate=False))
    buffers = dict(traced.model.named_buffers(remove_duplicate=False))
    counted = 0
    seen_ids: set[int] = set()
    for node in traced.gm.graph.nodes:
        if node.op != "get_attr":
            continue
        p = facts(node).param
        target = str(node.target)
        if target in params:
            assert p is not None, target
            assert (p.fqn, p.shape, p.trainable, p.is_buffer) == (
                target,
                tuple(params[target].shape),
                params[target].requires_grad,
                False,
            )
            assert p.dtype == str(params[target].dtype).removeprefix("torch.")
            assert id(params[target]) not in seen_ids, f"{target} read twice"
            seen_ids.add(id(params[target]))
            counted += p.numel
        elif target in buffers:
            assert p is not None and p.is_buffer and not p.trainable
            assert p.shape == tuple(buffers[target].shape)
    n_params = sum(p.numel() for p in traced.model.parameters())
    assert traced.graph.params == n_params
    assert traced.graph.trainable_params == n_params
    assert counted == n_params  # each parameter read (and planned) exactly once


def test_frozen_params_are_not_trainable_and_need_no_grad() -> None:
    torch.manual_seed(0)
    model = gpt()
    frozen = model.transformer.wpe.weight
    frozen.requires_grad_(False)
    gm = autopar.trace(model, token_batch())
    g = graph_facts(gm)
    assert g.params == sum(p.numel() for p in model.parameters())
    assert g.trainable_params == g.params - frozen.numel()

    (wpe,) = [
        n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "transformer.wpe.weight"
    ]
    assert facts(wpe).param.trainable is False and facts(wpe).param.is_buffer is False
    assert not facts(wpe).requires_grad
    (lookup,) = wpe.users  # the position-embedding lookup reads only the frozen table
    assert not facts(lookup).requires_grad
    assert facts(lookup).bwd_flops == 0 and not facts(lookup).saved_inputs

    trainable = ancestors_with_trainable_param(gm)
    for node in gm.graph.nodes:
        if node not in trainable:
            assert not facts(node).requires_grad, node.name
        elif node.op == "call_function" and any(t.is_floating_point() for t in fake_tensors(node)):
            assert facts(node).requires_grad, node.name


def test_module_path_and_source_line_of_a_linear() -> None:
    torch.manual_seed(0)
    gm = autopar.trace(gpt(), token_batch())
    (node,) = [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.linear.default
        and facts(n).module_path == "transformer.h.1.attn.c_attn"
    ]
    f = facts(node)
    assert f.module_type == "Linear"
    assert f.params == ("transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_attn.bias")
    match = re.fullmatch(r"(.+\.py):(\d+)", f.source)
    assert match, f.source
    assert match.group(1).endswith("autopar/models/gpt.py")
    assert "self.c_attn(" in linecache.getline(match.group(1), int(match.group(2)))


def test_module_path_and_source_line_in_hf_llama() -> None:
    traced = traced_model("llama")
    (node,) = [
        n
        for n in traced.gm.graph.nodes
        if facts(n).module_path == "model.layers.2.self_attn.q_proj" and n.op == "call_function"
    ]
    f = facts(node)
    file, line = f.source.rsplit(":", 1)
    assert file.endswith("modeling_llama.py")
    assert "q_proj" in linecache.getline(file, int(line))


# --- repeated blocks, batch ------------------------------------------------------------------


def test_repeated_blocks_share_layer_position_and_signature(traced: Traced) -> None:
    g = traced.graph
    (block,) = [b for b in g.blocks if b.container == traced.container]
    assert block.layers == tuple(range(LAYERS))
    assert len(set(block.signature_of.values())) == 1  # all layers look alike
    layer_re = re.compile(rf"^{re.escape(traced.container)}\.(\d+)(\.|$)")

    per_layer: dict[int, list[NodeFacts]] = {i: [] for i in range(LAYERS)}
    for node in traced.gm.graph.nodes:
        f = facts(node)
        m = layer_re.match(f.module_path)
        if m:
            assert (f.block, f.layer) == (traced.container, int(m.group(1))), node.name
            per_layer[f.layer].append(f)
        else:
            assert f.layer is None, node.name
    first = per_layer[0]
    assert [f.position for f in first] == list(range(len(first)))
    for i in range(1, LAYERS):
        other = per_layer[i]
        assert [f.position for f in other] == list(range(len(first))), f"layer {i}"
        for a, b in zip(first, other):
            assert (a.op, a.target if a.op != "get_attr" else "attr", a.shapes) == (
                b.op,
                b.target if b.op != "get_attr" else "attr",
                b.shapes,
            ), (a.name, b.name)


def test_batch_and_sequence_detected(traced: Traced) -> None:
    g = traced.graph
    assert (g.batch_size, g.seq_len, g.tokens) == (BATCH, SEQ, BATCH * SEQ)
    assert g.tracer == "torch.export"


# --- saved for backward ----------------------------------------------------------------------


def _saved_bytes_real(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> int:
    """Bytes autograd keeps for backward: storages seen by saved_tensors_hooks, once each,
    excluding parameter storages."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, tgt)
    assert loss.requires_grad
    return sum(storages.values())


def _value_bytes(node: fx.Node) -> int:
    f = facts(node)
    return sum(numel(s) * getattr(torch, d).itemsize for s, d in zip(f.shapes, f.dtypes))


def _saved_bytes_traced(gm: fx.GraphModule, resolve_views: bool) -> int:
    """Outputs saved + extra buffers + inputs saved, once per producer value, no parameters.

    With ``resolve_views``, a view's producer is the value it views (what shares storage)."""

    def base(node: fx.Node) -> fx.Node:
        while resolve_views and facts(node).is_view and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    producers: set[fx.Node] = set()
    extra = 0
    for node in gm.graph.nodes:
        f = facts(node)
        if node.op != "call_function":
            continue
        extra += f.extra_saved_bytes
        tensor_inputs = [
            a
            for a in tree_flatten((node.args, node.kwargs))[0]
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
        ]
        saved = [tensor_inputs[i] for i in f.saved_inputs]
        if f.saves_output:
            saved.append(node)
        for value in map(base, saved):
            if not (value.op == "get_attr" and facts(value).param is not None):
                producers.add(value)
    return extra + sum(_value_bytes(p) for p in producers)


@pytest.fixture(scope="module")
def saved_bytes() -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = gpt(n_layer=3, block_size=64, n_embd=64)
    idx, tgt = token_batch(4, 64)
    gm = autopar.trace(model, (idx, tgt))
    real = _saved_bytes_real(model, idx, tgt)
    per_value = _saved_bytes_traced(gm, resolve_views=False)
    per_storage = _saved_bytes_traced(gm, resolve_views=True)
    print(
        f"saved for backward: real {real} B, traced per value {per_value} B "
        f"({per_value / real - 1:+.2%}), traced per viewed value {per_storage} B "
        f"({per_storage / real - 1:+.2%})"
    )
    return real, per_value, per_storage


def test_saved_for_backward_matches_autograd(saved_bytes: tuple[int, int, int]) -> None:
    real, per_value, _ = saved_bytes
    assert per_value == pytest.approx(real, rel=0.10)


def test_saved_for_backward_matches_autograd_when_views_share_storage(
    saved_bytes: tuple[int, int, int],
) -> None:
    """Counting a view and the value it views once (as storage does), the facts are exact."""
    real, _, per_storage = saved_bytes
    assert per_storage == pytest.approx(real, rel=0.01)


# --- inputs ----------------------------------------------------------------------------------


def test_tensor_specs_trace_on_meta_without_allocating() -> None:
    # 7.3B parameters (29 GB in fp32) and 8x2048 tokens: materializing anything of this
    # size would show in the peak RSS, or exhaust the memory of a small machine.
    with torch.device("meta"):
        model = GPT(
            GPTConfig(block_size=2048, vocab_size=50304, n_layer=2, n_head=128, n_embd=16384)
        )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gm = autopar.trace(model, (TensorSpec((8, 2048)), TensorSpec((8, 2048), "int64")))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 512, f"RSS grew by {grown_mib:.0f} MiB"
    g = graph_facts(gm)
    assert (g.batch_size, g.seq_len) == (8, 2048)
    assert g.params == sum(p.numel() for p in model.parameters()) > 7e9
    assert all(p.is_meta for p in model.parameters())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            assert facts(node).shapes == ((8, 2048),) and facts(node).dtypes == ("int64",)
    assert g.fwd_flops > 2 * 8 * 2048 * 7e9  # FLOPs are still counted on meta


def test_tensor_specs_as_keyword_inputs_of_an_hf_model() -> None:
    pytest.importorskip("transformers")
    from autopar.models import hf

    with torch.device("meta"):
        model = hf.build_llama(
            layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=VOCAB, seq=32
        )
    spec = TensorSpec((2, 32), "long")
    gm = autopar.trace(model, {"input_ids": spec, "labels": spec, "use_cache": False})
    g = graph_facts(gm)
    assert (g.batch_size, g.seq_len) == (2, 32)
    assert g.input_names[:2] == ("input_ids", "labels")


@pytest.mark.parametrize("form", ["tuple", "list", "dict", "args_kwargs", "kwargs_only"])
def test_example_input_forms(form: str) -> None:
    torch.manual_seed(0)
    model = gpt(n_layer=2)
    idx, tgt = token_batch()
    example = {
        "tuple": (idx, tgt),
        "list": [idx, tgt],
        "dict": {"idx": idx, "targets": tgt},
        "args_kwargs": ((idx,), {"targets": tgt}),
        "kwargs_only": ((), {"idx": idx, "targets": tgt}),
    }[form]
    gm = autopar.trace(model, example)
    reference = autopar.trace(model, (idx, tgt))
    assert graph_facts(gm).input_names == ("idx", "targets")
    assert graph_facts(gm).fingerprint == graph_facts(reference).fingerprint
    logits, loss = gm(idx, tgt)
    ref_logits, ref_loss = model(idx, tgt)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)


def test_single_tensor_input() -> None:
    torch.manual_seed(0)
    model = gpt(n_layer=2)
    idx, _ = token_batch()
    gm = autopar.trace(model, idx)
    g = graph_facts(gm)
    assert g.input_names == ("idx",) and (g.batch_size, g.seq_len) == (BATCH, SEQ)
    logits, loss = gm(idx)
    assert loss is None
    torch.testing.assert_close(logits, model(idx)[0])


def test_same_tensor_passed_twice_still_traces_both_inputs() -> None:
    """``trace(model, (idx, idx))`` (the README's example) must give a graph that reads both
    inputs, or refuse; export silently merges the two placeholders into one."""
    torch.manual_seed(0)
    model = gpt(n_layer=2)
    idx, tgt = token_batch()
    try:
        gm = autopar.trace(model, (idx, idx))
    except TraceError:
        return  # refusing aliased example inputs is fine too
    logits, loss = gm(idx, tgt)
    ref_logits, ref_loss = model(idx, tgt)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)


# --- determinism -----------------------------------------------------------------------------


def _fingerprint(model: nn.Module, example: Any) -> str:
    return graph_facts(autopar.trace(model, example)).fingerprint


def test_tracing_twice_is_deterministic() -> None:
    torch.manual_seed(0)
    model = gpt()
    first = autopar.trace(model, token_batch())
    second = autopar.trace(model, token_batch(seed=1))
    assert graph_facts(first).fingerprint == graph_facts(second).fingerprint
    assert [n.name for n in first.graph.nodes] == [n.name for n in second.graph.nodes]
    assert [facts(n).fwd_flops for n in first.graph.nodes] == [
        facts(n).fwd_flops for n in second.graph.nodes
    ]
    # a freshly built model of the same architecture is the same model
    torch.manual_seed(1)
    assert _fingerprint(gpt(), token_batch()) == graph_facts(first).fingerprint


def test_another_architecture_has_another_fingerprint() -> None:
    torch.manual_seed(0)
    base = _fingerprint(gpt(), token_batch())
    assert _fingerprint(gpt(n_layer=LAYERS + 1), token_batch()) != base
    assert _fingerprint(gpt(n_embd=64), token_batch()) != base


@pytest.mark.parametrize("batch, seq", [(BATCH + 2, SEQ), (BATCH, SEQ - 4)])
def test_fingerprint_ignores_batch_and_sequence(batch: int, seq: int) -> None:
    """A plan made at one batch size applies to the same model at another (blocks.py)."""
    torch.manual_seed(0)
    model = gpt()
    assert _fingerprint(model, token_batch(batch, seq)) == _fingerprint(model, token_batch())


def test_fingerprint_same_on_meta_and_on_cpu() -> None:
    """``autopar plan`` traces on meta; ``parallelize(plan=...)`` traces the real model."""
    torch.manual_seed(0)
    model = gpt()
    with torch.device("meta"):
        meta_model = gpt()
    spec = TensorSpec((BATCH, SEQ))
    assert _fingerprint(meta_model, (spec, spec)) == _fingerprint(model, token_batch())


# --- scale -----------------------------------------------------------------------------------

_BIG_TRACE = textwrap.dedent(
    """
    import json, resource, time
    import torch, autopar
    from autopar.models import resolve_model

    spec = resolve_model("llama3-70b")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    t1 = time.perf_counter()
    gm = autopar.trace(model, spec.example_inputs(1, 8192))
    t2 = time.perf_counter()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = gm.meta["autopar"]
    print(json.dumps({
        "build_s": t1 - t0, "trace_s": t2 - t1, "rss_growth_kib": rss1 - rss0,
        "nodes": len(gm.graph.nodes), "params": g.params, "batch": g.batch_size,
        "seq": g.seq_len, "blocks": [[b.container, len(b.layers), len(set(b.signature_of.values()))]
                                     for b in g.blocks],
    }))
    """
)


@pytest.mark.slow
def test_llama3_70b_traces_on_meta_without_memory() -> None:
    """Run in a fresh process, so the peak RSS is this trace's and no earlier test's. (How
    long it takes is measured by benchmarks/plan_time.py, never bounded in a test.)"""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-c", _BIG_TRACE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    growth_gib = r["rss_growth_kib"] / 2**20
    print(
        f"\nllama3-70b: build {r['build_s']:.1f} s, trace {r['trace_s']:.1f} s, "
        f"peak RSS growth {growth_gib * 1024:.0f} MiB, {r['nodes']} nodes, "
        f"{r['params'] / 1e9:.3f}B params"
    )
    assert growth_gib < 2
    assert r["nodes"] >= 5000
    assert r["params"] == pytest.approx(70.55e9, rel=1e-3)
    assert (r["batch"], r["seq"]) == (1, 8192)
    assert ["model.layers", 80, 1] in r["blocks"]


def test_a_reshape_that_copies_is_not_a_view() -> None:
    """``reshape`` and ``contiguous`` may return a view; of a transposed tensor they copy,
    and the copy is a kernel the cost model prices (its bytes are recorded)."""

    class Heads(nn.Module):
        def forward(self, x):
            y = x.transpose(1, 2).reshape(x.shape[0], -1)  # copies
            return y + x.reshape(x.shape[0], -1)  # a view

    gm = autopar.trace(Heads(), (torch.randn(2, 3, 4),))
    reshapes = [facts(n) for n in gm.graph.nodes if n.op == "call_function"
                and facts(n).target == "aten.reshape.default"]
    assert len(reshapes) == 2
    copied, viewed = reshapes
    assert not copied.is_view and copied.bytes_written == 2 * 12 * 4
    assert viewed.is_view and viewed.bytes_written == 0
