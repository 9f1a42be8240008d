"""The pass infrastructure: order checks, failure naming, and what each pass reports."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.core.errors import PassError
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


class CastLike(torch.nn.Module):
    """``b(h).type_as(h)`` with ``h = a(x)``: type_as reads ``h`` only for its dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return (self.b(h).type_as(h) ** 2).mean()


@pytest.mark.parametrize("other", ["S(1)", "P"])
def test_a_whole_op_reading_a_split_input_for_its_dtype_keeps_whole_gradients(other) -> None:
    """``type_as(R, split) -> R`` computes the same whole output on every device, so the
    gradient of its replicated input is whole too. It was all-reduced as if partial, which
    doubled it under tp=2 (tiny Gemma 2 trained wrong on such a layout)."""
    from autopar.core.plan import Plan
    from autopar.ops import comm_ops

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    gm = autopar.trace(CastLike(), ((x,), {}))
    data = autopar.plan(gm, "tests/clusters/cpu-fast-links.yaml", tp=2, recompute=("none",)
                        ).to_dict()
    layout = {"linear": (["R", "R", "R"], ["R"]),
              "linear_1": (["R", "S(0)", "S(0)"], ["S(1)"]),  # b(h): column-parallel
              "type_as": (["R", other], ["R"]), "pow_1": (["R"], ["R"]), "mean": (["R"], ["R"])}
    for name, (ins, outs) in layout.items():
        data["strategies"][name]["tp"] = {"in": ins, "out": outs}
    plan = Plan.from_dict(data)
    program, _ = PassManager(sharding_passes()).run(gm, PassContext(plan, {"dp": 0, "tp": 0}))
    nodes = {n.name: n for n in program.graph.nodes}
    assert nodes["type_as"].args[0].target is comm_ops.redistribute  # b(h) gathered, no more
    # a replicated input read by split work still has its partial gradients summed
    assert nodes["linear_1"].args[0].target is comm_ops.grad_all_reduce


class TiedHead(torch.nn.Module):
    """An embedding whose weight is also the output head's (``tied``), or a separate head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.head(self.embed(idx)) ** 2).mean()


@pytest.mark.parametrize("tied", [True, False])
def test_a_weight_with_a_whole_gradient_term_is_summed_at_once(tied: bool) -> None:
    """A weight read replicated by split work has partial gradients, summed over tp; that
    sum may wait for the end of the step (one bucketed all-reduce) only when no other read
    adds a whole term to the same ``.grad``: deferred, the whole term was summed too,
    counted once per device (tiny BERT, RoBERTa and BART's tied embeddings trained wrong)."""
    from autopar.core.plan import Plan
    from autopar.ops import comm_ops

    idx = torch.randint(0, 16, (4, 8))
    gm = autopar.trace(TiedHead(tied), ((idx,), {}))
    data = autopar.plan(gm, "tests/clusters/cpu-fast-links.yaml", tp=2, recompute=("none",)
                        ).to_dict()
    weights = [n.name for n in gm.graph.nodes if n.op == "get_attr"]
    embedding = next(n.name for n in gm.graph.nodes if "embedding" in str(n.target))
    head = next(n.name for n in gm.graph.nodes if "linear" in str(n.target))
    layout = {**{w: ([], ["R"]) for w in weights},
              embedding: (["R", "R"], ["R"]),  # whole: its weight gradient is whole
              head: (["S(1)", "R"], ["S(1)"])}  # split by sequence: a partial term
    for name, (ins, outs) in {**layout, "pow_1": (["S(1)"], ["S(1)"]),
                              "mean": (["S(1)"], ["P(avg)"])}.items():
        data["strategies"][name]["tp"] = {"in": ins, "out": outs}
    program, _ = PassManager(sharding_passes()).run(gm, PassContext(Plan.from_dict(data),
                                                                     {"dp": 0, "tp": 0}))
    syncs = [n for n in program.graph.nodes if n.target is comm_ops.grad_all_reduce]
    assert len(syncs) == 1 and syncs[0].users.keys() == {program.graph.find_nodes(
        op="call_function", target=torch.ops.aten.linear.default)[0]}
    assert syncs[0].args[2] is not tied  # deferred only without the embedding's whole term


class FilledBuffer(torch.nn.Module):
    """A buffer made empty and filled in place through slices, then read by a matmul (as
    DeepSeek-V3's attention assembles its query and key heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        self.c = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = x.new_empty(4, 8)
        buffer[:, :4] = self.a(x)
        buffer[:, 4:] = self.b(x)
        return (self.c(buffer) ** 2).mean()


def test_a_buffer_filled_in_place_is_synced_once_filled() -> None:
    """The gradient all-reduce of a replicated value read by split work is a view of it, so
    it must come after the last in-place write: made before, autograd refused to run the
    program ("a view was created ... its base ... modified inplace")."""
    from autopar.core.plan import Plan
    from autopar.ops import comm_ops

    x = torch.randn(4, 8)
    gm = autopar.trace(FilledBuffer(), ((x,), {}))
    data = autopar.plan(gm, "tests/clusters/cpu-fast-links.yaml", tp=2, recompute=("none",)
                        ).to_dict()
    whole = {n.name: ([], ["R"]) for n in gm.graph.nodes if n.op == "get_attr"}
    whole.update({n.name: (["R"] * len(data["strategies"][n.name]["tp"]["in"]), ["R"])
                  for n in gm.graph.nodes if n.name in data["strategies"]
                  and n.op == "call_function"})
    layout = {**whole, "linear_2": (["R", "S(0)", "S(0)"], ["S(1)"]),  # c: column-parallel
              "pow_1": (["S(1)"], ["S(1)"]), "mean": (["S(1)"], ["P(avg)"])}
    for name, (ins, outs) in layout.items():
        data["strategies"][name]["tp"] = {"in": ins, "out": outs}
    program, _ = PassManager(sharding_passes()).run(gm, PassContext(Plan.from_dict(data),
                                                                     {"dp": 0, "tp": 0}))
    order = [n.name for n in program.graph.nodes]
    (sync,) = [n for n in program.graph.nodes if n.target is comm_ops.grad_all_reduce
               and n.args[0].name == "new_empty"]
    assert order.index("copy__1") < order.index(sync.name) < order.index("linear_2")


def _steps(axes: list[str], have: str, need: str) -> list[str]:
    from autopar.core.placements import parse_placement
    from autopar.passes.insert_collectives import redistribution_steps

    steps = redistribution_steps(axes, tuple(map(parse_placement, have.split())),
                                 tuple(map(parse_placement, need.split())))
    return [f"{ax} {src}->{dst}" for ax, src, dst in steps]


def test_redistribution_steps_undo_an_inner_split_of_the_dim_an_outer_move_cuts() -> None:
    """A local tensor is cut outer axis first; moving an outer axis along a dim an inner
    axis splits must gather the inner axis first (else each rank gets the wrong tokens)."""
    axes = ["cp", "tp"]
    assert _steps(axes, "R S(2)", "S(2) S(2)") == ["tp S(2)->R", "cp R->S(2)", "tp R->S(2)"]
    assert _steps(axes, "S(1) S(1)", "R R") == ["tp S(1)->R", "cp S(1)->R"]
    assert _steps(axes, "S(1) S(1)", "R S(1)") == ["tp S(1)->R", "cp S(1)->R", "tp R->S(1)"]
    # other dims, partial sums and inner-only moves keep the plain outer-to-inner order
    assert _steps(axes, "R S(1)", "S(2) S(1)") == ["cp R->S(2)"]
    assert _steps(axes, "R P", "S(2) R") == ["cp R->S(2)", "tp P->R"]
    assert _steps(axes, "S(2) R", "S(2) S(2)") == ["tp R->S(2)"]
    assert _steps(["dp", "cp", "tp"], "S(0) R S(1)", "S(0) S(1) S(1)") == [
        "tp S(1)->R", "cp R->S(1)", "tp R->S(1)"]
