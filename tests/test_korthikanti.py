"""Activation memory per transformer layer reproduces Korthikanti et al. (MLSys'23).

The anchor (../shared/anchors/korthikanti_activation_formulas.csv) gives, for a GPT layer
with 16-bit activations and 1-byte dropout masks, the bytes kept for backward:

    no parallelism                  sbh (34 + 5as/h)
    tensor parallel                 sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel      sbh (34/t + 5as/(ht))
    tensor parallel + selective     sbh (10 + 24/t)

autopar does not contain these formulas: its number comes from the traced graph (what
autograd saves, measured on fake tensors) and the solver's placements. The GPT here is
Megatron's: explicit softmax attention, dropout 0.1, fp16. The only terms autopar counts and
the paper drops are LayerNorm statistics and the causal mask (see TOL).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from autopar.core.cluster import load_cluster
from autopar.core.placements import Shard
from autopar.models import resolve_model
from autopar.solver.search.pinned import PinnedConfig, estimate_graph
from autopar.trace import trace

ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "anchors" / (
    "korthikanti_activation_formulas.csv")
S, B, H, A, V = 256, 8, 2048, 16, 1024
# The terms autopar counts and the paper leaves out: the causal mask (s^2 one-byte entries,
# whole on every device) and LayerNorm statistics (2 x 2 x s x b per layer): at these sizes
# s^2 / (s b h) = 1.6% of one sbh, at most 0.2% of any configuration's total.
TOL = 2e-3


@pytest.fixture(scope="module")
def gm():
    spec = resolve_model(f"gpt:layers=2,hidden={H},heads={A},vocab={V},seq={S},batch={B},"
                         "math_attention=1,dropout=0.1")
    with torch.device("meta"):
        model = spec.build()
    return trace(model, spec.example_inputs(B, S))


def layer_bytes(gm, t: int, sp: bool, recompute: str, fuse: bool = False) -> float:
    cluster = load_cluster(f"{t}xA100-80GB")
    config = PinnedConfig(tp=t, dp=1, sp=sp, microbatch=B, global_batch=B, recompute=recompute,
                          precision="fp16", layout="megatron", fuse_attention=fuse,
                          precision_overrides=MEGATRON_STORAGE)
    est = estimate_graph(gm, cluster, config)
    values = est.prediction.layer_activations
    assert len(values) == 2 and abs(values[0] - values[1]) < 1e-6
    # autopar's parameters are the fp32 master weights; their 16-bit copies are made once a
    # step and counted beside the weights (buffers), not per layer: Megatron's parameters
    # are 16-bit already, and the paper counts them as parameters
    return values[0]


def test_anchor_lists_the_four_configurations() -> None:
    if not ANCHOR.exists():
        pytest.skip(f"anchor table not found at {ANCHOR} (it lives next to the repository)")
    rows = {r["configuration"] for r in csv.DictReader(ANCHOR.open())}
    assert {"no parallelism", "tensor parallel (baseline)", "tensor + sequence parallel",
            "tensor parallel + selective recompute", "full activation recomputation"} <= rows


SBH = S * B * H
MEGATRON_STORAGE = (("transformer.h", "fp16"),)
"""Megatron-LM stores every activation of a layer in 16 bits (its fused kernels compute
softmax and LayerNorm in fp32 and write 16-bit; its parameters, so the residual stream, are
16-bit). autopar's default policy keeps normalisations, softmax and an fp32 residual stream
as torch.autocast does; the formulas describe Megatron's, so the layers are put in fp16."""


@pytest.mark.parametrize("t", [1, 2, 4])
def test_tensor_parallel_baseline(gm, t: int) -> None:
    expected = SBH * (10 + 24 / t + 5 * A * S / (H * t)) if t > 1 else SBH * (34 + 5 * A * S / H)
    assert layer_bytes(gm, t, sp=False, recompute="none") == pytest.approx(expected, rel=TOL)


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_and_sequence_parallel(gm, t: int) -> None:
    expected = SBH * (34 / t + 5 * A * S / (H * t))
    assert layer_bytes(gm, t, sp=True, recompute="none") == pytest.approx(expected, rel=TOL)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_selective_recompute(gm, t: int) -> None:
    expected = SBH * (10 + 24 / t) if t > 1 else SBH * 34
    assert layer_bytes(gm, t, sp=False, recompute="selective") == pytest.approx(expected, rel=TOL)


@pytest.mark.parametrize("t", [1, 4])
def test_full_recompute_keeps_the_layer_input(gm, t: int) -> None:
    """Full recomputation keeps only each layer's input, 2sbh (whole, without SP)."""
    assert layer_bytes(gm, t, sp=False, recompute="full") == pytest.approx(2 * SBH, rel=TOL)


@pytest.mark.parametrize("t", [1, 4])
def test_fused_attention_keeps_what_selective_recomputation_keeps(gm, t: int) -> None:
    """The fused kernel never writes scores, probabilities or the dropout mask (5as²b bytes
    per layer): fused attention keeps exactly what selective recomputation keeps."""
    fused = layer_bytes(gm, t, False, "none", fuse=True)
    unfused = layer_bytes(gm, t, False, "none")
    assert fused == pytest.approx(layer_bytes(gm, t, False, "selective"), rel=1e-9)
    assert unfused - fused == pytest.approx(5 * A * S * S * B / t, rel=0.01)


def test_megatron_layout_splits_every_weight_matrix() -> None:
    """A pinned Megatron layout shards every weight matrix across tp (column- or row-parallel,
    the embedding by vocabulary), even where the solver's own fastest layout would keep some
    whole (GQA's k/v under ZeRO-3): the memory a published tp run had, not a guess above it."""
    spec = resolve_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32")
    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(4, 32))
    config = PinnedConfig(tp=2, dp=2, sp=True, microbatch=2, global_batch=4, zero=3,
                          layout="megatron")
    est = estimate_graph(gm, load_cluster("4xH100-80GB"), config)
    matrices = [d for d in est.problem.decisions
                if d.kind == "param" and len(d.facts.shapes[0]) >= 2]
    # q, k, v, o, gate, up, down in each of 2 layers (one decision per repeated weight)
    assert sum(d.count for d in matrices) >= 2 * 7
    whole = [d.name for d in matrices
             if not any(isinstance(p, Shard) for p in d.candidates[est.choice[d.index]].outputs)]
    assert whole == []


@pytest.mark.parametrize("sp", [True, False])
def test_megatron_layout_on_llama_pairs_linears_and_splits_the_stream(sp: bool) -> None:
    """HF Llama pinned to Megatron's layout: the attention output and MLP down projections
    are row-parallel (their inputs arrive split, their partial sums go into the residual
    stream), q/k/v/gate/up column-parallel, and the residual stream and its RMSNorms --
    written out of elementwise ops -- stay whole, or split along the sequence with sp.
    (A norm's weight path says "norm" too: it once stood in for the stream's shape, and the
    layout was left to the solver.)"""
    from autopar.core.graph_facts import META_KEY
    from autopar.core.placements import Replicate

    spec = resolve_model("llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=512,"
                         "seq=128")
    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(1, 128))  # one sequence: tp cannot split batch
    config = PinnedConfig(tp=4, dp=1, sp=sp, microbatch=1, global_batch=1, layout="megatron")
    est = estimate_graph(gm, load_cluster("4xH100-80GB"), config)
    stream = (1, 128, 256)
    chosen = {d.name: (d, d.candidates[i]) for d, i in zip(est.problem.decisions, est.choice)}
    rows = cols = adds = 0
    for d, s in chosen.values():
        facts = d.facts
        if d.kind != "op" or facts.layer is None:
            continue
        if facts.target == "aten.linear.default":
            feeds_stream = any(u.meta[META_KEY].target == "aten.add.Tensor"
                               and u.meta[META_KEY].shapes[0] == stream for u in d.nodes[0].users)
            weight = s.inputs[1]
            assert weight == (Shard(1) if feeds_stream else Shard(0)), d.name
            rows, cols = rows + feeds_stream, cols + (not feeds_stream)
        elif facts.shapes and facts.shapes[0] == stream and (
                facts.target == "aten.add.Tensor" or facts.module_type.endswith("RMSNorm")):
            assert s.outputs[0] == (Shard(1) if sp else Replicate()), d.name
            adds += facts.target == "aten.add.Tensor"
    assert (rows, cols, adds) == (2, 5, 2)  # per repeated layer: one decision for all


def test_megatron_layout_never_gathers_a_weight_for_a_large_microbatch() -> None:
    """With 16 x 8,192 tokens a microbatch (torchtitan's Llama 3 70B 2D run), gathering a
    q/k/v or gate/up weight over tp is cheaper than gathering the layer's input, and the
    pinned "megatron" estimate once priced that program instead (whole weights, whole fp8
    copies of them). Megatron's linears read their weights split: column-parallel q, k, v,
    gate and up, row-parallel o and down."""
    spec = resolve_model("llama:layers=2,hidden=8192,heads=64,kv_heads=8,ffn=28672,"
                         "vocab=128256,seq=8192")
    with torch.device("meta"):
        model = spec.build()
    gm = trace(model, spec.example_inputs(16, 8192))
    config = PinnedConfig(tp=8, dp=1, sp=True, microbatch=16, global_batch=16, zero=3,
                          precision="fp8", recompute="full", layout="megatron")
    est = estimate_graph(gm, load_cluster("8xH100-80GB"), config)
    weights = sorted(str(d.candidates[i].inputs[1])
                     for d, i in zip(est.problem.decisions, est.choice)
                     if d.kind == "op" and d.facts.layer is not None
                     and d.facts.target == "aten.linear.default")
    assert weights == ["S(0)"] * 5 + ["S(1)"] * 2
