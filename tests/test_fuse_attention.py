"""The fuse-attention pass: every attention site of nanoGPT, HF GPT-2 (eager) and HF Llama
(SDPA) becomes one kernel call, and the fused model trains like the unfused one — with the
generated Triton kernels (run by Triton's interpreter) and through the SDPA fallback."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopar
from autopar.analysis.attention_sites import find_attention_sites
from autopar.passes import FuseAttention, PassContext, PassManager, program_passes
from autopar.runtime.parallel_module import find_loss


def _gpt(attention: str):
    from autopar.models import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                          attention=attention))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ((idx, idx.roll(1, 1)), {})


def _hf(name: str):
    pytest.importorskip("transformers")
    from autopar.models.hf import build_gpt2, build_llama

    if name == "gpt2":
        model = build_gpt2(layers=2, hidden=32, heads=4, vocab=64, seq=16)
    else:
        model = build_llama(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq=16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ((), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})


_TOKENS = dict(vocab_size=64, max_position_embeddings=16)
_DECODER = dict(_TOKENS, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, use_cache=False)
# Eager attention as HF writes it, one tiny model per variant: (class, config, fields, inputs).
HF_EAGER = {
    # soft-capped scores, sliding window on alternate layers, GQA; weights large enough
    # that the cap bends the scores (a fusion without it then misses by far)
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        _DECODER, num_key_value_heads=2, head_dim=8, sliding_window=8,
        attn_logit_softcapping=1.0, query_pre_attn_scalar=8, initializer_range=0.5), "lm"),
    # ALiBi through baddbmm on (batch * heads) scores
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(
        vocab_size=64, hidden_size=32, n_layer=2, n_head=4, use_cache=False), "lm"),
    # relative position bias, no 1/sqrt(d) scaling; encoder, decoder and cross attention
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    # in-place scaling (/=), one kv head broadcast by matmul
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        use_cache=False), "lm"),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(
        _DECODER, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0), "lm"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_DECODER, hidden_dropout=0.0), "lm"),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_DECODER, resid_pdrop=0.0), "lm"),
    "bert": ("BertForMaskedLM", "BertConfig", dict(
        _DECODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "masked"),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(
        _TOKENS, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
        use_cache=False, forced_eos_token_id=None), "seq2seq"),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=10,
        hidden_dropout_prob=0.0), "image"),
}
SITES = {"t5": 6, "bart": 6}  # encoder, decoder and cross attention; 2 elsewhere
# What the plan says of every site of these variants (the score transforms found).
DESCRIBED = {"gemma2": "softcap 1, GQA 2", "bloom": "2 biases, (batch*heads) layout",
             "t5": "2 biases", "falcon": "causal, GQA 4"}


def _hf_eager(name: str):
    transformers = pytest.importorskip("transformers")
    cls, config, fields, kind = HF_EAGER[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(getattr(transformers, config)(**fields),
                                                    attn_implementation="eager").train()
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        return model, ((), {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                            "labels": torch.randint(0, 10, (2,), generator=g)})
    ids = torch.randint(3, 64, (2, 16), generator=g)
    labels = torch.randint(3, 64, (2, 16), generator=g)
    if kind == "masked":
        return model, ((), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                            "labels": labels})
    kwargs = {"input_ids": ids, "labels": ids.clone() if kind == "lm" else labels}
    return model, ((), {**kwargs, **({} if kind == "masked" else {"use_cache": False})})


MODELS = {
    "nanogpt-sdpa": lambda: _gpt("sdpa"),
    "nanogpt-math": lambda: _gpt("math"),
    "hf-gpt2-eager": lambda: _hf("gpt2"),
    "hf-llama-sdpa": lambda: _hf("llama"),
    **{f"hf-{name}-eager": (lambda name=name: _hf_eager(name)) for name in HF_EAGER},
}
PATTERN = {"nanogpt-sdpa": "sdpa", "hf-llama-sdpa": "sdpa"}  # the others are eager
# The generated kernels (in Triton's interpreter) take seconds per site: the variants whose
# kernel options differ from the ones above (soft-capping, summed biases, flat layout,
# in-place scaling) run both ways by default, the rest through the SDPA fallback only.
INTERPRETED = {"nanogpt-sdpa", "nanogpt-math", "hf-gpt2-eager", "hf-llama-sdpa",
               "hf-gemma2-eager", "hf-bloom-eager", "hf-t5-eager", "hf-falcon-eager"}
CASES = [pytest.param(name, backend, marks=[pytest.mark.slow] if (
    backend == "interpreter" and name not in INTERPRETED) else [])
    for name in MODELS for backend in ("interpreter", "sdpa")]


def _loss_and_grads(module: nn.Module, inputs) -> tuple[float, dict[str, torch.Tensor]]:
    args, kwargs = inputs
    loss = find_loss(module(*args, **kwargs))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _fused_program(model: nn.Module, inputs):
    plan = autopar.plan(model, "1xcpu", inputs, recompute=("none",))
    gm = autopar.trace(model, inputs)
    program, results = PassManager(program_passes(plan)).run(gm, PassContext(plan, {"tp": 0}))
    return plan, program, results


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_fused_model_matches_unfused(name: str, backend: str, monkeypatch) -> None:
    if backend == "interpreter":
        pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "interpreter" else "0")
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    reference = copy.deepcopy(model)
    plan, program, results = _fused_program(model, inputs)

    # Every site was found when planning, recorded fused, and rewritten into a kernel call.
    sites = SITES.get(name.split("-")[1], 2)
    assert len(plan.attention) == sites, plan.attention
    assert all(e["fused"] and e["pattern"] == PATTERN.get(name, "eager")
               for e in plan.attention), plan.attention
    if name.split("-")[1] in DESCRIBED:
        assert all(DESCRIBED[name.split("-")[1]] in e["what"] for e in plan.attention), (
            plan.attention)
    fused = [r for r in results if r.pass_name == "fuse-attention"][0]
    assert sum(c.startswith("fused") for c in fused.changes) == sites, fused.changes
    calls = [n for m in program.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes if n.target is autopar.kernels.attention]
    assert len(calls) == sites
    assert "autopar_kernels_api_attention(" in program.code or any(
        "autopar_kernels_api_attention(" in m.code for m in program.modules()
        if isinstance(m, torch.fx.GraphModule))
    assert not any("softmax" in str(n.target) or "scaled_dot_product" in str(n.target)
                   for m in program.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes)

    ref_loss, ref_grads = _loss_and_grads(reference, inputs)
    loss, grads = _loss_and_grads(program, inputs)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert grads.keys() == ref_grads.keys() and grads  # the program keeps the model's names
    for fqn, g in grads.items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, f=fqn: f"{f}: {m}")


def test_kernel_calls_in_the_sites_own_layers() -> None:
    """nanoGPT's math attention keeps a causal buffer: the site becomes causal=True with no
    mask (the kernel skips blocks above the diagonal)."""
    model, inputs = _gpt("math")
    gm = autopar.trace(model, inputs)
    sites = find_attention_sites(gm)
    assert [s.fusable for s in sites] == [True, True]
    assert all(s.causal and s.bias is None and s.scale == pytest.approx(32 ** -0.5 * 2)
               for s in sites)


class _ReturnsProbabilities(nn.Module):
    """Attention whose probabilities are also returned (HF's output_attentions)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1)
        return (probs @ v).sum() + probs.sum()


def test_site_whose_probabilities_are_used_elsewhere_is_kept_with_the_reason() -> None:
    model = _ReturnsProbabilities()
    plan = autopar.plan(model, "1xcpu", torch.randn(2, 5, 8))
    assert len(plan.attention) == 1
    entry = plan.attention[0]
    assert not entry["fused"] and "used elsewhere" in entry["reason"]


def test_fusion_can_be_turned_off() -> None:
    model, inputs = _gpt("sdpa")
    plan = autopar.plan(model, "1xcpu", inputs, fuse_attention=False)
    assert plan.attention and not any(e["fused"] for e in plan.attention)
    assert all("turned off" in e["reason"] for e in plan.attention)
    assert not any(isinstance(p, FuseAttention) for p in program_passes(plan))


def test_fused_eager_attention_is_modelled_like_sdpa() -> None:
    """Planned with fusion, nanoGPT's explicit (math) attention is predicted like its SDPA
    twin — the same kernel runs, all its tiles — while unfused it keeps and moves the s x s tensors
    (modelled, GPT-2-small layers at sequence 2048 on A100s)."""
    from autopar.cli.load import trace_model

    def predicted(attention: str, fuse: bool) -> tuple[float, float]:
        traced = trace_model(f"gpt:layers=2,hidden=768,heads=12,vocab=50304,seq=2048,batch=16"
                             f"{attention}", None, None)
        plan = autopar.plan(traced.gm, "8xA100-80GB", global_batch=16, precision="bf16",
                            fuse_attention=fuse, dp=8, recompute=("none",))
        return plan.predicted["step_time_s"], plan.predicted["peak_memory_bytes"]

    sdpa_time, sdpa_memory = predicted("", True)
    fused_time, fused_memory = predicted(",math_attention=1", True)
    eager_time, eager_memory = predicted(",math_attention=1", False)
    # The SDPA twin says is_causal, so its kernel skips the tiles above the diagonal; the
    # eager twin's tril mask reaches the kernel as a keep-mask, and every tile runs.
    assert sdpa_time < fused_time < 1.5 * sdpa_time
    assert fused_memory == pytest.approx(sdpa_memory, rel=0.01)
    assert eager_time > fused_time and eager_memory > 1.2 * fused_memory


def test_causal_sdpa_with_a_traced_mask_keeps_only_its_log_sum_exp() -> None:
    """HF Llama hands SDPA a (batch, 1, seq, seq) causal mask; the fused program runs the
    kernel with causal=True, so a layer keeps one log-sum-exp per query row, not the float
    copy of the mask PyTorch's CPU kernel keeps: the attention's own memory grows with the
    sequence, not its square (modelled, H100)."""
    from autopar.cli.load import trace_model
    from autopar.core.cluster import load_cluster
    from autopar.solver.search.pinned import PinnedConfig, estimate_graph

    def kept(seq: int) -> float:
        traced = trace_model(f"llama:layers=1,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=256,"
                             f"seq={seq}", 1, None)
        est = estimate_graph(traced.gm, load_cluster("1xH100-80GB"), PinnedConfig(
            dp=1, global_batch=1, precision="bf16", recompute="none"))
        sdpa = [(d, d.candidates[i]) for d, i in zip(est.problem.decisions, est.choice)
                if "scaled_dot_product" in d.facts.target]
        assert len(sdpa) == 1 and est.problem.causal_attention
        d, s = sdpa[0]
        return est.tables.own_activation(d, s), est.tables.kept_extras(d)

    (short, (floats, lse)), (long, _) = kept(1024), kept(4096)
    assert floats == 0 and lse == 4 * 4 * 1024  # fp32, one per head and query row
    assert long == pytest.approx(4 * short, rel=1e-6)


class _FinfoMinMask(nn.Module):
    """Eager attention masking with the dtype's lowest value instead of -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x, keep):
        q, k, v = self.proj(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / 2.0
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        return (torch.softmax(scores, dim=-1) @ v).sum()


def test_mask_filled_with_the_lowest_value_is_attention() -> None:
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    gm = autopar.trace(_FinfoMinMask(), (torch.randn(2, 5, 8), keep))
    (site,) = find_attention_sites(gm)
    assert site.fusable and site.pattern == "eager" and site.scale == 0.5
    assert site.bias is not None and site.bias.op == "placeholder"  # the keep-mask input


def test_the_cost_model_prices_no_op_the_fused_program_erases() -> None:
    """HF Llama builds its causal mask from positions (``le``/``eq`` over seq² pairs, with
    export's metadata assertions on them); fusing erases it for ``causal=True``. The cost
    model must charge none of those ops: at a million tokens they were 8% of a step."""
    from autopar.solver.pricing.fusion import Fusion

    model, inputs = _hf("llama")
    plan = autopar.plan(model, "1xcpu", inputs, recompute=("none",))
    gm = autopar.trace(model, inputs)
    program, _ = PassManager([FuseAttention()]).run(copy.deepcopy(gm),
                                                    PassContext(plan, {"tp": 0}))
    kept = {n.name for n in program.graph.nodes}
    fusion = Fusion.of(gm)
    erased = {n.name for n in gm.graph.nodes
              if n.op == "call_function" and n.name not in kept} - fusion.site_nodes
    targets = {str(n.target) for n in gm.graph.nodes if n.name in erased}
    assert {"aten.le.Tensor", "aten.eq.Tensor"} <= targets  # the mask's comparisons
    assert erased <= fusion.dead_nodes


def test_grouped_keys_are_kept_as_the_kernel_reads_them() -> None:
    """HF Llama repeats its grouped keys and values to every query head before SDPA; the
    fused kernel reads them grouped, so what it keeps for backward is the grouped tensor
    (a quarter of the repeated one with 2 kv heads of 8), and the repeat runs no kernel."""
    from autopar.cli.load import trace_model
    from autopar.core.cluster import load_cluster
    from autopar.core.placements import Replicate
    from autopar.solver.search.pinned import PinnedConfig, estimate_graph

    traced = trace_model("llama:layers=1,hidden=256,heads=8,kv_heads=2,ffn=512,vocab=256,"
                         "seq=256", 1, None)
    est = estimate_graph(traced.gm, load_cluster("1xH100-80GB"), PinnedConfig(
        dp=1, global_batch=1, precision="bf16", recompute="none"))
    problem, tables = est.problem, est.tables
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    repeated = [(name, arg) for name, arg in problem.not_run.items()
                if problem.decisions[problem.decision_of[name]].facts.shapes[0][1] == 8]
    assert repeated  # the expanded keys and values
    for name, arg in repeated:
        d = problem.decisions[problem.decision_of[name]]
        key = (d.index, 0)
        grouped = tables.value_bytes(problem.value_key(nodes[arg]))
        assert tables.saved_bytes(key, Replicate()) == grouped == tables.value_bytes(key) / 4
        assert tables.times(d, d.candidates[0]) == (0.0, 0.0, 0.0)
