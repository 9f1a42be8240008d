"""What the cost model prices matches the program that runs: the casts autopar's precision
inserts (``solver/pricing/cast_costs.py``), and the bytes a program that fuses its elementwise ops
does not move (``solver/pricing/elementwise_fusion.py``, ``PinnedConfig.fuse_elementwise``)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.analysis.precision import WORD_OF_DTYPE, assign_precision, params_word
from autopar.cli.load import trace_model
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY
from autopar.passes import PassContext, PassManager
from autopar.passes.cast_precision import CastPrecision, cast_to
from autopar.passes.chunked_loss import ChunkedLoss
from autopar.solver.pricing.cast_costs import inserted_casts
from autopar.solver.pricing.elementwise_fusion import fused_bytes
from autopar.solver.pricing.precision_costs import fp8_quantize_times, inserted_cast_time
from autopar.solver.search.pinned import PinnedConfig, estimate_graph

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=100,seq=16"


def test_priced_casts_are_the_casts_the_program_runs() -> None:
    """Under bf16 every cast the cast-precision pass puts into the program (norm inputs up
    to fp32, their outputs back, the residual stream's reads of bf16 projections) is one the
    cost model prices, and it prices no other: the same value, to the same dtype."""
    pytest.importorskip("transformers")
    from autopar.models.hf import build_llama

    model = build_llama(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq=16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = ((), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    plan = autopar.plan(model, "1xcpu", inputs, precision="bf16", recompute=("none",))
    gm = autopar.trace(model, inputs)
    traced = {n.name for n in gm.graph.nodes}
    # in the program's order: the chunked loss (which upcasts its logits itself), the casts
    program, _ = PassManager([ChunkedLoss(), CastPrecision()]).run(
        copy.deepcopy(gm), PassContext(plan, {"tp": 0}))
    ran = {(n.args[0].name, WORD_OF_DTYPE[str(n.args[1])]) for n in program.graph.nodes
           if n.target is cast_to and n.name not in traced  # not a retargeted model cast
           and n.args[0].op != "get_attr"}  # weights: priced with the op that reads them
    assignment = assign_precision(gm, "bf16", params=params_word("bf16", 0))
    priced = {(c.value, c.want) for casts in inserted_casts(gm, assignment).values()
              for c in casts}
    assert ran and ran == priced
    assert any(want == "fp32" for _, want in priced) and any(w == "bf16" for _, w in priced)


def test_casts_make_a_bf16_step_slower_and_fusing_programs_fold_them() -> None:
    """The casts cost time in an eager bf16 program (modelled, H100); a fusing program folds
    those beside an elementwise op into its kernels."""
    traced = trace_model(LLAMA, 1, None)
    gm = traced.gm
    assignment = assign_precision(gm, "bf16", params=params_word("bf16", 0))
    eager, fused = inserted_casts(gm, assignment), inserted_casts(gm, assignment, fused=True)
    assert sum(map(len, fused.values())) < sum(map(len, eager.values()))
    est = estimate_graph(gm, load_cluster("1xH100-80GB"), PinnedConfig(
        dp=1, global_batch=1, precision="bf16", recompute="none"))
    by_name = {d.name: (d, d.candidates[i]) for d, i in zip(est.problem.decisions, est.choice)}
    name = next(iter(eager))
    assert inserted_cast_time(est.tables, *by_name[name]) > 0


def test_a_fused_chain_keeps_its_middle_values_off_memory() -> None:
    """``relu(x * 2) + 1``: the product and the relu never reach memory; a value a matmul
    reads is still written."""

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = torch.relu(x * 2) + 1
            return self.proj(torch.sigmoid(y))

    gm = autopar.trace(Chain(), (torch.randn(4, 8),))
    fused = fused_bytes(gm)
    assert fused["mul"].written == 128 and fused["mul"].read == 0
    assert fused["relu"].read == 128 and fused["relu"].continues
    assert fused["sigmoid"].written == 0  # the linear reads it: written out


def test_fusing_elementwise_speeds_only_the_elementwise_ops() -> None:
    """Priced as a fusing program (Transformer Engine, torch.compile) a Llama step is faster,
    and only its memory-bound ops got cheaper: matmuls and attention cost the same."""
    gm = trace_model("llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1024,vocab=1000,"
                     "seq=1024", 1, None).gm
    config = PinnedConfig(dp=1, global_batch=1, precision="bf16", recompute="none")
    cluster = load_cluster("1xH100-80GB")
    eager = estimate_graph(gm, cluster, config)
    fused = estimate_graph(gm, cluster, replace(config, fuse_elementwise=True))
    assert fused.prediction.step_time_s < eager.prediction.step_time_s
    for (d, i), (e, j) in zip(zip(fused.problem.decisions, fused.choice),
                              zip(eager.problem.decisions, eager.choice)):
        if d.kind == "op" and d.nodes[0].meta[META_KEY].fwd_flops:  # less their casts
            f_fwd, f_bwd, _ = fused.tables.times(d, d.candidates[i])
            e_fwd, e_bwd, _ = eager.tables.times(e, e.candidates[j])
            f_cast = inserted_cast_time(fused.tables, d, d.candidates[i])
            e_cast = inserted_cast_time(eager.tables, e, e.candidates[j])
            assert f_cast <= e_cast
            assert f_fwd - f_cast == pytest.approx(e_fwd - e_cast, rel=1e-9)


def test_fuse_elementwise_must_be_a_bool() -> None:
    with pytest.raises(AutoparError, match="fuse_elementwise"):
        PinnedConfig(fuse_elementwise="yes")


def test_fp8_linears_pay_for_quantizing() -> None:
    """fp8 linears quantize their input in forward -- once per tensor: q, k and v read one
    copy -- and their output gradient in backward; a fusing program writes fp8 straight
    from the norm that makes the input, and quantizes gradients in one cast-transpose
    kernel (modelled, H100)."""
    gm = trace_model("llama:layers=1,hidden=512,heads=8,kv_heads=8,ffn=1024,vocab=1024,"
                     "seq=512", 1, None).gm
    config = PinnedConfig(dp=1, global_batch=1, precision="fp8", recompute="none")
    cluster = load_cluster("1xH100-80GB")
    costs = {}
    for fuse in (False, True):
        est = estimate_graph(gm, cluster, replace(config, fuse_elementwise=fuse))
        t = est.tables
        costs[fuse] = {d.name: fp8_quantize_times(t, d, d.candidates[i])
                       for d, i in zip(est.problem.decisions, est.choice)
                       if d.kind == "op" and t.fp8_linear(d)}
    eager, fused = costs[False], costs[True]
    projections = [name for name in eager if name.startswith("linear")][:3]  # q, k, v
    assert [eager[n][0] > 0 for n in projections] == [True, False, False]
    assert all(b > 0 for _, b in eager.values())
    assert all(fused[n][1] < eager[n][1] for n in eager)
    assert fused[projections[0]][0] == 0.0  # the norm writes fp8
