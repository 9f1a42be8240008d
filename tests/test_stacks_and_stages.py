"""Models with two stacks of layers, and what pipeline stages carry, without processes.

- Layers are numbered in the order they run over every stack, and outlining cuts an
  encoder-decoder into its layers and the glue between its stacks (T5 with ZeRO-3 or pp
  once failed with "cycle exists between partitions").
- Values made from the inputs alone (attention masks) are recomputed where they are read,
  not carried between stages; what is carried is made contiguous (gloo sends nothing else:
  OPT, Falcon, BERT and ViT once sent an expanded mask).
- Zero-bubble stages whose split backward would lose a weight's gradient are detected.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.api.parallelize import _microbatch_graph
from autopar.core.graph_facts import META_KEY
from autopar.passes import PassContext, PassManager, program_passes
from autopar.passes.outline_layers import OutlineLayers, partition_nodes
from autopar.passes.pipeline_split import sendable
from autopar.passes.recompute_inputs import RecomputeInputs, _weightless
from autopar.runtime.pipeline import _split_loses_weights


class Cross(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(h) + self.b(memory)) * mask


class EncoderDecoder(nn.Module):
    """Two stacks; "decoder" sorts before "encoder", but the encoder runs first."""

    def __init__(self, width: int = 16, vocab: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                     for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.decoder = nn.ModuleList(Cross(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        shifted = tgt.new_zeros(tgt.shape)  # written in place: not a value of inputs alone
        shifted[:, 1:] = tgt[:, :-1]
        memory = self.embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.norm(memory)
        mask = (tgt > 0).unsqueeze(-1).expand(-1, -1, memory.shape[-1])  # from inputs alone
        h = self.embed(shifted)
        for layer in self.decoder:
            h = layer(h, memory, mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


@pytest.fixture(scope="module")
def encoder_decoder():
    torch.manual_seed(0)
    model = EncoderDecoder()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))
    return model, inputs, autopar.trace(model, inputs)


def test_layers_are_numbered_in_run_order_over_both_stacks(encoder_decoder) -> None:
    _, _, gm = encoder_decoder
    seen = {}
    for node in gm.graph.nodes:
        facts = node.meta[META_KEY]
        if facts.layer is not None and node.op != "get_attr":
            seen.setdefault(facts.layer, facts.module_path.split(".")[:2])
    assert seen == {0: ["encoder", "0"], 1: ["encoder", "1"], 2: ["decoder", "0"],
                    3: ["decoder", "1"]}


def test_outlining_two_stacks_keeps_the_result(encoder_decoder) -> None:
    model, inputs, gm = encoder_decoder
    gm = copy.deepcopy(gm)
    expected = gm(*inputs)
    outlined = OutlineLayers().run(gm, None).graph_module
    assert outlined.meta["autopar_layer_paths"] == ["encoder.0", "encoder.1", "decoder.0",
                                                    "decoder.1"]
    called = [str(n.target) for n in outlined.graph.nodes if n.op == "call_module"]
    assert called == ["before_layers", "encoder.0", "encoder.1", "between_layers_1",
                      "decoder.0", "decoder.1", "after_layers"]
    torch.testing.assert_close(outlined(*inputs), expected)


def test_values_from_inputs_alone_are_read_only_where_they_are_made(encoder_decoder) -> None:
    model, inputs, gm = encoder_decoder
    gm = copy.deepcopy(gm)
    expected = gm(*inputs)
    result = RecomputeInputs().run(gm, None)
    assert result.modified and "recomputed" in result.changes[0]
    gm = result.graph_module
    gm.recompile()
    part, _ = partition_nodes(gm)
    leaves = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in _weightless(gm, leaves):
        assert {part.get(u, part[node]) for u in node.users} == {part[node]}, node.name
    torch.testing.assert_close(gm(*inputs), expected)


@pytest.mark.parametrize("arch", ["opt", "t5"])
def test_pipeline_stages_carry_sendable_values_and_train_like_the_model(arch: str) -> None:
    pytest.importorskip("transformers")
    from tests.hf_zoo import build

    model, (args, kwargs) = build(arch)
    plan = autopar.plan(model, "2xcpu", (args, kwargs), pp=2, microbatches=2)
    gm = autopar.trace(model, (args, kwargs))
    local = _microbatch_graph(model, (args, kwargs), plan, gm)  # what one rank runs
    program, _ = PassManager(program_passes(plan)).run(local, PassContext(plan, {"pp": 0}))
    stages = [str(n.target) for n in program.graph.nodes if n.op == "call_module"]
    assert len(stages) == plan.pipeline.get("virtual_stages", 1) * 2
    sent = []
    for name in stages[:-1]:
        out = program.get_submodule(name).graph.output_node().args[0]
        assert all(v.op == "call_function" and v.target is sendable for v in out), name
        program.get_submodule(name).register_forward_hook(lambda m, i, o: sent.extend(o))
    half = {k: v[:2] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    torch.testing.assert_close(program(**half)[0], model(**half)["loss"])
    # Carried: the model's inputs, or values computed from weights; never a mask made from
    # the inputs alone (each layer recomputes it), and always contiguous.
    assert sent and all(t.is_contiguous() for t in sent)
    inputs = [v for v in half.values() if isinstance(v, torch.Tensor)]
    assert all(t.requires_grad or any(t is x for x in inputs) for t in sent)


def test_split_backward_losing_a_weight_gradient_is_detected() -> None:
    torch.manual_seed(0)
    stage = nn.ModuleDict({"embed": nn.Embedding(10, 4), "proj": nn.Linear(4, 4)})
    x = torch.randn(2, 4, requires_grad=True)  # received from the previous stage
    ids = torch.tensor([1, 2])  # integer input: needs no gradient

    def outputs(*values):
        return {"stage_output": values, "input_values": [x, ids]}

    met = stage["proj"](x) + stage["embed"](ids)
    assert not _split_loses_weights(stage, outputs(met))
    alone = stage["embed"](ids)  # reaches an output without meeting x: its gradient is lost
    assert _split_loses_weights(stage, outputs(stage["proj"](x), alone))
    both = stage["embed"](ids)
    assert _split_loses_weights(stage, outputs(stage["proj"](x) + both, both))
