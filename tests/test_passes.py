"""The pass infrastructure: order checks, failure naming, and what each pass reports."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.errors import PassError
from autopar.models import GPT, GPTConfig
from autopar.passes import GraphPass, PassContext, PassManager, PassResult, sharding_passes
from autopar.passes.outline_layers import OutlineLayers


class Broken(GraphPass):
    name = "broken"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise RuntimeError("boom")


class NeedsBroken(GraphPass):
    name = "needs-broken"
    requires = ("broken",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(gm, modified=False)


@pytest.fixture(scope="module")
def traced_and_plan():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    plan = autopar.plan(model, "tests/clusters/cpu-fast-links.yaml", (idx, idx), dp=2, tp=2)
    return model, idx, plan


def test_manager_names_the_failing_pass(traced_and_plan) -> None:
    model, idx, plan = traced_and_plan
    gm = autopar.trace(model, (idx, idx))
    with pytest.raises(PassError, match="pass 'broken' failed: RuntimeError: boom"):
        PassManager([Broken()]).run(gm, PassContext(plan, {"dp": 0, "tp": 0}))


def test_manager_checks_requirements() -> None:
    with pytest.raises(PassError, match="requires"):
        PassManager([NeedsBroken()])


def test_sharding_passes_report_changes_and_keep_names(traced_and_plan) -> None:
    model, idx, plan = traced_and_plan
    gm = autopar.trace(model, (idx, idx))
    names = {n.name for n in gm.graph.nodes}
    program, results = PassManager(sharding_passes()).run(gm, PassContext(plan, {"dp": 1, "tp": 1}))
    assert [r.pass_name for r in results] == [
        "shard-parameters", "localize-shapes", "substitute-local-ops", "insert-collectives",
    ]
    assert any(r.changes for r in results)
    # Every original node survives under its own name (the plan is keyed by names).
    assert names <= {n.name for n in program.graph.nodes}
    # Local shards really are local: a tp-sharded weight has half its rows or columns.
    for fqn, axes in plan.params.items():
        if axes["tp"].startswith("S("):
            dim = int(axes["tp"][2])
            local = program.get_parameter(fqn)
            full = model.get_parameter(fqn) if fqn != "lm_head.weight" else model.lm_head.weight
            assert local.shape[dim] * 2 == full.shape[dim], fqn


def test_outline_layers_keeps_parameter_names_and_results() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=4, n_embd=32))
    idx, tgt = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    gm = autopar.trace(model, (idx, tgt))
    expected = gm(idx, tgt)[1]
    names = sorted(n for n, _ in gm.named_parameters(remove_duplicate=False))
    result = OutlineLayers().run(gm, None)
    outlined = result.graph_module
    assert sorted(n for n, _ in outlined.named_parameters(remove_duplicate=False)) == names
    assert outlined.meta["autopar_layer_paths"] == ["transformer.h.0", "transformer.h.1",
                                                    "transformer.h.2"]
    assert isinstance(outlined.get_submodule("transformer.h.1"), fx.GraphModule)
    torch.testing.assert_close(outlined(idx, tgt)[1], expected)


def test_tensors_the_program_makes_go_to_the_ranks_device(traced_and_plan) -> None:
    """A model traced on the CPU records ``arange(..., device=cpu)`` for its positions; run
    on a GPU, that index met a CUDA weight and failed (seen on an H100). Every ``device=``
    of the rank's program is its own device."""
    from autopar.passes import program_passes

    model, idx, plan = traced_and_plan
    gm = autopar.trace(model, (idx, idx))
    traced = [n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs]
    assert traced and all(torch.device(d).type == "cpu" for d in traced)
    program, results = PassManager(program_passes(plan)).run(
        gm, PassContext(plan, {"dp": 0, "tp": 0}, "meta"))
    placed = [n.kwargs["device"] for m in program.modules() if isinstance(m, fx.GraphModule)
              for n in m.graph.nodes if "device" in n.kwargs]
    assert placed and all(torch.device(d) == torch.device("meta") for d in placed)
    assert any(r.pass_name == "place-created-tensors" and r.changes for r in results)


def test_moves_the_program_records_go_to_the_ranks_device() -> None:
    """HF Llama's rotary embedding reads ``inv_freq.to(x.device)``: traced on the CPU it is
    ``aten.to.device(inv_freq, cpu, ...)``, which on an H100 moved the buffer back to the
    CPU ("mat2 is on cuda:0, different from other tensors on cpu"). No device the rank's
    program names, by keyword or by position, is another than its own."""
    pytest.importorskip("transformers")
    from autopar.models import resolve_model
    from autopar.passes import program_passes

    spec = resolve_model("llama:layers=1,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,"
                         "seq=16,batch=2,rope_theta=500000")
    a, k = spec.example_inputs(2, 16, "cpu")
    gm = autopar.trace(spec.build(), (a, k))
    plan = autopar.plan(gm, "1xcpu", recompute=("none",))

    def devices(module: torch.nn.Module) -> list[torch.device]:
        return [torch.device(d) for m in module.modules() if isinstance(m, fx.GraphModule)
                for n in m.graph.nodes
                for d in (*n.args, *n.kwargs.values()) if isinstance(d, torch.device)]

    assert torch.device("cpu") in devices(gm)  # the move is there, positional
    program, _ = PassManager(program_passes(plan)).run(gm, PassContext(plan, {"dp": 0, "tp": 0},
                                                                       "meta"))
    placed = devices(program)
    assert placed and set(placed) == {torch.device("meta")}
