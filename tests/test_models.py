"""The model zoo: built-ins resolve, models build on meta, train, and export; errors say why."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from autopar.core.errors import ModelSpecError
from autopar.models import GPT, GPTConfig, builtin_names, hf, resolve_model

TINY_GPT = "gpt:layers=2,hidden=32,heads=4,vocab=97,seq=16,batch=4"
TINY_HF = {
    "gpt2-hf": "gpt2hf:layers=2,hidden=32,heads=4,vocab=97,seq=16",
    "llama": "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=97,seq=16",
    "mixtral": "mixtral:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=97,seq=16,experts=4",
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def all_meta(model: torch.nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def loss_of(out) -> torch.Tensor:
    return out[1] if isinstance(out, tuple) else out["loss"]


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_resolves(name: str) -> None:
    spec = resolve_model(name)
    assert spec.name == name
    assert spec.family in {"gpt", "llama", "mixtral", "deepseek"}
    assert spec.default_batch > 0 and spec.default_seq == spec.config["seq"]
    assert resolve_model(name.upper()) == spec  # names are case-insensitive


@pytest.mark.parametrize(
    "name, billions",
    [
        ("gpt2", 0.124),
        ("gpt3-175b", 174.6),
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.55),
        ("mixtral-8x7b", 46.70),
        # DeepSeek-V3's published 671B (its multi-token-prediction module is not built)
        ("deepseek-v3", 671.03),
    ],
)
def test_builtin_sizes_on_meta(name: str, billions: float) -> None:
    if name in ("llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3"):
        pytest.importorskip("transformers")
    with torch.device("meta"):
        model = resolve_model(name).build()
    assert all_meta(model)
    assert n_params(model) / 1e9 == pytest.approx(billions, rel=0.005)


def test_builtin_batches_follow_the_papers() -> None:
    tokens = {
        n: resolve_model(n).default_batch * resolve_model(n).default_seq
        for n in ("gpt-125m", "gpt3-175b", "llama3-70b")
    }
    assert tokens == {"gpt-125m": 2**19, "gpt3-175b": 1536 * 2048, "llama3-70b": 2**22}


def test_gpt_trains_one_step() -> None:
    torch.manual_seed(0)
    spec = resolve_model(TINY_GPT)
    model = spec.build()
    args, kwargs = spec.example_inputs(4, 16, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, loss = model(*args, **kwargs)
    assert loss.shape == () and math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.log(97), rel=0.1)  # small init: near uniform
    loss.backward()
    before = model.lm_head.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.lm_head.weight)
    assert model.transformer.wte.weight is model.lm_head.weight  # still tied
    _, loss2 = model(*args, **kwargs)
    assert loss2.item() < loss.item()


def test_gpt_without_targets_returns_no_loss() -> None:
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8))
    logits, loss = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, 11) and loss is None


def test_gpt_builds_on_meta_and_exports() -> None:
    spec = resolve_model(TINY_GPT)
    with torch.device("meta"):
        assert all_meta(spec.build())
    model = spec.build()
    args, kwargs = spec.example_inputs(2, 16, device="cpu")
    ep = torch.export.export(model, args, kwargs, strict=False)
    _, want = model(*args, **kwargs)
    _, got = ep.module()(*args, **kwargs)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", list(TINY_HF))
def test_hf_builds_on_meta_and_exports(family: str) -> None:
    pytest.importorskip("transformers")
    spec = resolve_model(TINY_HF[family])
    assert spec.family == family
    with torch.device("meta"):
        assert all_meta(spec.build())
    meta_args, meta_kwargs = spec.example_inputs(2, 16)
    assert meta_args == () and meta_kwargs["input_ids"].is_meta
    assert meta_kwargs["input_ids"].dtype == torch.long and meta_kwargs["use_cache"] is False

    torch.manual_seed(0)
    model = spec.build()
    assert model.config.use_cache is False
    args, kwargs = spec.example_inputs(2, 16, device="cpu")
    assert int(kwargs["input_ids"].max()) < 97
    ep = torch.export.export(model, args, kwargs, strict=False)
    torch.testing.assert_close(loss_of(ep.module()(*args, **kwargs)), model(**kwargs).loss)


def test_hf_configs_use_transformers5_fields() -> None:
    pytest.importorskip("transformers")
    with torch.device("meta"):
        llama = hf.build_llama(layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=97, seq=16)
        gpt2 = hf.build_gpt2(layers=1, hidden=32, heads=4, vocab=97, seq=16)
        moe = hf.build_mixtral(layers=1, hidden=32, heads=4, ffn=64, vocab=97, seq=16, top_k=1)
    assert llama.config.rope_parameters["rope_theta"] == 500000.0
    assert llama.config._attn_implementation == "sdpa"
    assert gpt2.config._attn_implementation == "eager"
    assert (gpt2.config.attn_pdrop, gpt2.config.resid_pdrop, gpt2.config.embd_pdrop) == (0, 0, 0)
    assert (moe.config.num_local_experts, moe.config.num_experts_per_tok) == (8, 1)
    assert moe.config.num_key_value_heads == 4  # kv_heads defaults to heads
    with pytest.raises(ModelSpecError, match="invalid LlamaConfig(.|\n)*not a multiple"):
        hf.build_llama(layers=1, hidden=33, heads=4, ffn=64, vocab=97, seq=16)


def test_hf_without_transformers_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ModelSpecError, match=r"autopar\[hf\]"):
        resolve_model("llama3-8b").build()


def test_parametric_specs_parse() -> None:
    spec = resolve_model("gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048")
    assert spec.family == "gpt" and spec.default_seq == 2048
    assert spec.default_batch == 256  # no batch= given: about 0.5M tokens
    assert spec.config["bias"] is True and spec.config["tie"] is True
    spec = resolve_model(
        "GPT: layers=2, hidden=32, heads=4, vocab=97, seq=16, bias=0, tie=0, dropout=0.1, batch=3"
    )
    assert (spec.config["bias"], spec.config["tie"], spec.config["dropout"]) == (False, False, 0.1)
    assert spec.default_batch == 3
    model = spec.build()
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert model.transformer.ln_f.bias is None
    spec = resolve_model(
        "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,"
        "vocab=128256,seq=8192,rope_theta=1e6"
    )
    assert spec.family == "llama" and spec.config["rope_theta"] == 1e6
    assert spec.config == resolve_model("llama3-70b").config | {"rope_theta": 1e6}
    spec = resolve_model("mixtral:layers=2,hidden=32,heads=4,ffn=64,vocab=97,seq=16,top_k=1")
    assert (spec.config["experts"], spec.config["top_k"], spec.config["kv_heads"]) == (8, 1, 4)
    assert resolve_model(TINY_HF["gpt2-hf"]).family == "gpt2-hf"


def test_example_inputs_shapes_and_limits() -> None:
    spec = resolve_model(TINY_GPT)
    (idx, targets), kwargs = spec.example_inputs(3, 8)
    assert idx.is_meta and idx.shape == (3, 8) and idx.dtype == torch.long and kwargs == {}
    a, _ = spec.example_inputs(3, 8, device="cpu")
    b, _ = spec.example_inputs(3, 8, device="cpu")
    assert torch.equal(a[0], b[0])  # seeded: every rank builds the same global batch
    with pytest.raises(ModelSpecError, match="exceeds the 16 learned positions"):
        spec.example_inputs(3, 32)
    with pytest.raises(ModelSpecError, match="batch must be a positive integer"):
        spec.example_inputs(0, 8)


def test_unknown_name_suggests_and_lists_forms() -> None:
    with pytest.raises(ModelSpecError) as err:
        resolve_model("llama3-7b")
    text = str(err.value)
    assert "unknown model 'llama3-7b'" in text
    assert "did you mean 'llama3-70b' or 'llama3-8b'?" in text
    assert all(name in text for name in builtin_names())
    assert "gpt:layers=N" in text and "llama:" in text and "file.py:make_model" in text
    with pytest.raises(ModelSpecError, match="unknown model family 'gtp'(.|\n)*'gpt'"):
        resolve_model("gtp:layers=2")


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("gpt:layers=2,hiden=32,heads=4,vocab=97,seq=16", "unknown key 'hiden'"),
        ("gpt:layers=two,hidden=32,heads=4,vocab=97,seq=16", "key 'layers' must be an integer"),
        ("gpt:layers=2,hidden=32,heads=4,vocab=97", "missing key 'seq'"),
        ("gpt:layers=2,hidden=32,heads=5,vocab=97,seq=16", "hidden=32 is not divisible by heads"),
        ("gpt:layers=2,hidden=32,heads=4,vocab=97,seq=16,bias=yes", "key 'bias' must be 0 or 1"),
        ("gpt:layers=2,layers=3", "key 'layers' is given twice"),
        ("llama:layers=2,hidden=32,heads=4,kv_heads=3,ffn=64,vocab=97,seq=16", "kv_heads=3"),
        ("mixtral:layers=2,hidden=32,heads=4,ffn=64,vocab=97,seq=16,top_k=9", "top_k=9 exceeds"),
    ],
)
def test_bad_spec_key_names_the_key(spec: str, problem: str) -> None:
    with pytest.raises(ModelSpecError) as err:
        resolve_model(spec)
    text = str(err.value)
    assert problem in text
    assert "required keys layers, hidden, heads" in text  # lists what is allowed


def test_gpt_config_validates() -> None:
    with pytest.raises(ModelSpecError, match="n_embd .* not divisible by n_head"):
        GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=3, n_embd=8)
    with pytest.raises(ModelSpecError, match="dropout must be in"):
        GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8, dropout=1.0)
    with pytest.raises(ModelSpecError, match="n_layer must be a positive integer"):
        GPTConfig(block_size=8, vocab_size=11, n_layer=0, n_head=2, n_embd=8)


FACTORY_FILE = """
import torch
from torch import nn

def make_mlp():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, (torch.randn(4, 8),), {}

def make_bare():
    return nn.Linear(8, 1)

def not_a_model():
    return 42
"""


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(FACTORY_FILE))
    return path


def test_custom_factory(factory_file) -> None:
    spec = resolve_model(f"{factory_file}:make_mlp")
    assert spec.family == "custom" and spec.config["factory"] == "make_mlp"
    assert (spec.default_batch, spec.default_seq) == (4, 8)
    with torch.device("meta"):
        assert all_meta(spec.build())
    (x,), kwargs = spec.example_inputs(10, 8, device="cpu")
    assert x.shape == (10, 8) and not x.is_meta and kwargs == {}
    (x,), _ = spec.example_inputs(2, 8)
    assert x.shape == (2, 8) and x.is_meta
    model = spec.build()
    assert model(*spec.example_inputs(4, 8, device="cpu")[0]).shape == (4, 1)
    with pytest.raises(ModelSpecError, match="sequence length is fixed by its factory"):
        spec.example_inputs(4, 16)


def test_custom_factory_errors(factory_file, tmp_path) -> None:
    with pytest.raises(ModelSpecError, match="has no function 'make_gpt'(.|\n)*make_mlp"):
        resolve_model(f"{factory_file}:make_gpt")
    with pytest.raises(ModelSpecError, match="nowhere.py' not found"):
        resolve_model(f"{tmp_path}/nowhere.py:make")
    with pytest.raises(ModelSpecError, match="names no factory function"):
        resolve_model(str(factory_file))
    with pytest.raises(ModelSpecError, match="factory returned int, not a module"):
        resolve_model(f"{factory_file}:not_a_model")
    bare = resolve_model(f"{factory_file}:make_bare")
    assert isinstance(bare.build(), torch.nn.Linear)
    with pytest.raises(ModelSpecError, match="returned only a module"):
        bare.example_inputs(1, 1)
