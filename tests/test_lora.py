"""LoRA and QLoRA (autopar.models.lora): exact at init, trains only adapters, merges back to the
original names, NF4 within its resolution, and traces with torch.export."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopar
from autopar.core.errors import AutoparError
from autopar.models.lora import (
    NF4_CODE,
    LoraConfig,
    LoraLinear,
    apply_lora,
    lora_memory_facts,
    merge_lora,
    nf4_dequantize,
    nf4_quantize,
)

IDX = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
TGT = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
# the largest distance from a value in [-1, 1] to its nearest NF4 value: half the widest gap
NF4_HALF_GAP = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2


def _gpt(embd: int = 32, tied: bool = True) -> nn.Module:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=embd,
                         tie_weights=tied))


def _llama() -> nn.Module:
    from autopar.models.hf import build_llama

    torch.manual_seed(0)
    return build_llama(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=96, seq=16)


# name -> (builder, targets, example inputs for autopar.trace, loss of a model or graph)
MODELS = {
    "gpt": (_gpt, ("c_attn", "mlp.c_fc"), (IDX, TGT), lambda m: m(IDX, TGT)[1]),
    "llama": (_llama, ("q_proj", "v_proj", "down_proj"),
              {"input_ids": IDX, "labels": TGT, "use_cache": False},
              lambda m: m(input_ids=IDX, labels=TGT, use_cache=False).loss),
}


def _adapted(name: str, **kw) -> tuple[nn.Module, nn.Module]:
    build, targets, _, _ = MODELS[name]
    original = build()
    return original, apply_lora(copy.deepcopy(original), LoraConfig(rank=4, alpha=8,
                                                                   targets=targets, **kw))


def _needs_bnb() -> None:
    pytest.importorskip("bitsandbytes", reason="quantize='nf4' needs bitsandbytes")


@pytest.mark.parametrize("name", MODELS)
def test_adapted_model_equals_original_at_init(name):
    original, model = _adapted(name)
    loss = MODELS[name][3]
    assert torch.equal(loss(model), loss(original))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and {n.rsplit(".", 1)[-1] for n in trainable} == {"lora_A", "lora_B"}
    adapted = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(adapted) == len(trainable) // 2 == 2 * len(MODELS[name][1])
    assert all(not m.weight.requires_grad and (m.bias is None or not m.bias.requires_grad)
               for m in adapted)
    # base weights keep their names: the original state dict loads, only adapters missing
    fresh = apply_lora(MODELS[name][0](), LoraConfig(rank=4, alpha=8, targets=MODELS[name][1]))
    result = fresh.load_state_dict(original.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert {k.rsplit(".", 1)[-1] for k in result.missing_keys} == {"lora_A", "lora_B"}


@pytest.mark.parametrize("name", MODELS)
def test_training_changes_only_adapters_and_merge_restores_names(name):
    original, model = _adapted(name)
    loss = MODELS[name][3]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        loss(model).backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != n.endswith(("lora_A", "lora_B")), n
    trained = loss(model).detach()
    merged = merge_lora(model)
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    shapes = {k: v.shape for k, v in merged.state_dict().items()}
    assert shapes == {k: v.shape for k, v in original.state_dict().items()}
    torch.testing.assert_close(loss(merged).detach(), trained, rtol=1e-5, atol=0)


def test_nf4_round_trip_is_within_nf4_resolution():
    _needs_bnb()
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    torch.manual_seed(0)
    weight = torch.randn(48, 200) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of all scales
    codes, absmax = nf4_quantize(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (48, 128) and absmax.shape == (48, 4)
    code = torch.tensor(NF4_CODE)
    back = nf4_dequantize(codes, absmax, code, 200, torch.float32)
    padded = nn.functional.pad(weight, (0, 56)).reshape(48, 4, 64)
    torch.testing.assert_close(absmax, padded.abs().amax(-1), rtol=0, atol=0)
    error = nn.functional.pad(back - weight, (0, 56)).reshape(48, 4, 64).abs()
    assert (error <= (NF4_HALF_GAP + 1e-6) * absmax.unsqueeze(-1)).all()
    assert (error / absmax.unsqueeze(-1)).mean() < 0.03  # measured 0.022 for Gaussian blocks
    # the plain-torch dequantization is bitsandbytes' own, bit for bit
    whole = torch.randn(32, 128)
    codes, absmax = nf4_quantize(whole)
    ref_codes, state = quantize_4bit(whole, blocksize=64, quant_type="nf4",
                                     compress_statistics=False)
    assert torch.equal(nf4_dequantize(codes, absmax, code, 128, torch.float32),
                       dequantize_4bit(ref_codes, state))
    # a row block of the buffers is a valid shard: it dequantizes to those rows
    assert torch.equal(nf4_dequantize(codes[8:16], absmax[8:16], code, 128, torch.float32),
                       dequantize_4bit(ref_codes, state)[8:16])


def test_qlora_keeps_a_trained_models_loss_and_trains():
    _needs_bnb()
    model = _gpt(embd=64, tied=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    initial = model(IDX, TGT)[1].item()
    for _ in range(15):
        opt.zero_grad()
        model(IDX, TGT)[1].backward()
        opt.step()
    full = model(IDX, TGT)[1].item()
    assert full < initial - 2.0  # training taught it something for quantization to lose
    config = LoraConfig(rank=4, alpha=8, targets=("c_attn", "c_fc", "c_proj"), quantize="nf4")
    qlora = apply_lora(copy.deepcopy(model), config)
    assert not any(n.endswith(("c_attn.weight", "c_fc.weight")) for n, _ in
                   qlora.named_parameters())
    losses = []
    opt = torch.optim.AdamW([p for p in qlora.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        loss = qlora(IDX, TGT)[1]
        losses.append(loss.item())
        loss.backward()
        opt.step()
    # 4-bit weights keep at least 95% of what training gained (measured: 99.9%)
    assert abs(losses[0] - full) < 0.05 * (initial - full)
    assert losses[-1] < losses[0]
    facts = lora_memory_facts(qlora)
    assert facts.trainable_params == sum(p.numel() for n, p in qlora.named_parameters()
                                         if "lora_" in n)
    assert facts.quantized_weights == 2 * 64 * (3 * 64 + 4 * 64 + 64 + 4 * 64)
    assert facts.quantized_bytes == facts.quantized_weights // 2 + facts.quantized_weights // 16


def test_original_state_dict_loads_into_a_qlora_model():
    _needs_bnb()
    original = _gpt()
    config = LoraConfig(rank=4, alpha=8, targets=("c_fc",), quantize="nf4")
    expected = apply_lora(copy.deepcopy(original), config)
    other = apply_lora(_gpt(), config)
    with torch.no_grad():  # as after to_empty(): nothing of the original left
        for t in [*other.parameters(), *other.buffers()]:
            t.zero_()
    result = other.load_state_dict(original.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert {k.rsplit(".", 1)[-1] for k in result.missing_keys} == {"lora_A", "lora_B"}
    for key, value in expected.state_dict().items():
        if "lora_" not in key:
            assert torch.equal(other.state_dict()[key], value), key
    with torch.no_grad():
        other.load_state_dict(expected.state_dict())
    assert torch.equal(other(IDX, TGT)[1], expected(IDX, TGT)[1])


def test_qlora_plans_on_the_meta_device():
    with torch.device("meta"):
        model = _gpt()
    model = apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("c_attn",), quantize="nf4"))
    layer = model.transformer.h[0].attn.c_attn
    assert layer.weight_nf4.is_meta and layer.weight_nf4.shape == (96, 32)  # 32 -> 64 padded
    assert lora_memory_facts(model).quantized_bytes == 2 * (96 * 32 + 96 * 4)
    spec = autopar.TensorSpec((4, 16), "int64")
    gm = autopar.trace(model, (spec, spec))
    assert gm.meta["autopar"].trainable_params == 2 * 4 * (32 + 96)


@pytest.mark.parametrize("quantize", [None, "nf4"])
@pytest.mark.parametrize("name", MODELS)
def test_trace_matches_eager(name, quantize):
    if quantize:
        _needs_bnb()
    _, model = _adapted(name, quantize=quantize)
    _, _, inputs, loss = MODELS[name]
    gm = autopar.trace(model, inputs)
    assert gm.meta["autopar"].tracer == "torch.export"
    assert gm.meta["autopar"].trainable_params == lora_memory_facts(model).trainable_params
    reads = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert any(t.endswith("lora_A") for t in reads)
    assert any(t.endswith("weight_nf4") for t in reads) == bool(quantize)
    traced = gm(*inputs) if isinstance(inputs, tuple) else gm(**inputs)
    traced = traced[1] if isinstance(traced, tuple) else traced.loss
    torch.testing.assert_close(traced, loss(model), rtol=1e-5, atol=0)


def test_train_also_keeps_named_parameters_trainable():
    model = apply_lora(_llama(), LoraConfig(rank=2, alpha=2, targets=("q_proj",),
                                            train_also=("lm_head", "model.norm.weight")))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"lm_head.weight", "model.norm.weight"} <= trainable
    assert not any("embed_tokens" in n or "q_proj.weight" in n for n in trainable)


def test_unknown_target_is_named_with_the_linears_available():
    with pytest.raises(AutoparError) as info:
        apply_lora(_llama(), LoraConfig(rank=4, alpha=8, targets=("q_proj", "qkv")))
    assert "'qkv'" in str(info.value) and "q_proj" in info.value.fix
    assert info.value.where == "LoraConfig.targets"
    with pytest.raises(AutoparError, match="train_also 'head'"):
        apply_lora(_gpt(), LoraConfig(rank=4, alpha=8, targets=("c_attn",),
                                      train_also=("head",)))


def test_adapting_twice_or_quantizing_a_tied_weight_is_refused():
    model = apply_lora(_gpt(), LoraConfig(rank=4, alpha=8, targets=("c_attn",)))
    with pytest.raises(AutoparError, match="already adapted"):
        apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("c_attn",)))
    with pytest.raises(AutoparError, match="tied to transformer.wte.weight"):
        apply_lora(_gpt(), LoraConfig(rank=4, alpha=8, targets=("lm_head",), quantize="nf4"))


@pytest.mark.parametrize("field, value", [
    ("rank", 0), ("rank", -2), ("rank", 2.5), ("alpha", 0), ("alpha", -1.0),
    ("alpha", float("nan")), ("targets", ()), ("dropout", 1.0), ("quantize", "int4"),
    ("nf4_block_size", 48),
])
def test_bad_config_names_the_field(field, value):
    kw = dict(rank=8, alpha=16, targets=("q_proj",))
    kw[field] = value
    with pytest.raises(AutoparError) as info:
        LoraConfig(**kw)
    assert info.value.where == f"LoraConfig.{field}" and field in str(info.value)
