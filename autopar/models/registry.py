"""Resolve a MODEL argument into a ModelSpec: what to build and how to call it.

Three forms, so the CLI can plan any model without the user writing a script:

- a built-in name: ``gpt2``, ``llama3-70b``, ... (see :func:`builtin_names`);
- a parametric spec: ``gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048``, or
  ``llama:...``, ``mixtral:...``, ``gpt2hf:...`` (run ``autopar`` with a bad key to see the
  keys each takes);
- a factory in a Python file: ``path/to/model.py:make_model``, where ``make_model()``
  returns a module, or ``(module, example_args, example_kwargs)``.

``ModelSpec.build()`` constructs in the current device context; wrap it in
``torch.device("meta")`` to plan a model far larger than memory.

Sizes are bounded (``autopar.models.spec.SPEC_LIMITS``): far above any published model, low
enough that a typo such as ``layers=100000`` fails at once instead of tracing for hours.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from autopar.core.errors import ModelSpecError
from autopar.models import hf
from autopar.models.factory import resolve_factory
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.moe import ROUTINGS
from autopar.models.spec import SPEC_LIMITS, Device, InputsFn, ModelSpec, check_batch_and_seq


def builtin_names() -> list[str]:
    """The built-in model names, smallest family first."""
    return list(_BUILTINS)


def resolve_model(text: str) -> ModelSpec:
    """Turn a built-in name, a parametric spec or ``file.py:factory`` into a ModelSpec."""
    if not isinstance(text, str):
        raise ModelSpecError(f"a model is named by text, got {type(text).__name__} {text!r}",
                             where="model name", fix="pass a built-in name such as 'gpt2', a spec "
                             "such as 'gpt:layers=2,...', or 'path/to/file.py:factory'")
    text = text.strip()
    path_text, colon, func_name = text.rpartition(":")
    if colon and path_text.endswith(".py"):
        return resolve_factory(path_text, func_name, text)
    if colon and os.path.isfile(path_text):
        raise ModelSpecError(
            f"model file '{path_text}' is not a Python file",
            where=text,
            fix="name a .py file and its factory function: path/to/model.py:make_model",
        )
    if text.endswith(".py"):
        raise ModelSpecError(
            f"model file '{text}' names no factory function",
            where=text,
            fix=f"name the function that builds the model: {text}:make_model",
        )
    name = text.lower()
    if name in _BUILTINS:
        return _resolve_spec(_BUILTINS[name], name=name)
    if ":" in text:
        return _resolve_spec(text, name=text)
    raise _unknown(name, f"unknown model '{text}'")


# --- built-ins --------------------------------------------------------------------------

# Each built-in is a parametric spec, so both forms take exactly one path.
_BUILTINS: dict[str, str] = {
    # GPT-2 124M. Published vocabulary 50257 (nanoGPT pads to 50304 for faster matmuls; we
    # keep the published size so parameter counts match the paper). Batch 512 x 1024 tokens:
    # GPT-2 paper (Radford et al. 2019, section 2.3).
    "gpt2": "gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024,batch=512",
    "gpt2-xl": "gpt:layers=48,hidden=1600,heads=25,vocab=50257,seq=1024,batch=512",
    # GPT-3 Small, 125M: 256 x 2048 = 0.5M tokens (Brown et al. 2020, Table 2.1).
    "gpt-125m": "gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=2048,batch=256",
    # GPT-3 175B: 1536 x 2048 = 3.2M tokens (Brown et al. 2020, Table 2.1). Vocab 51200 is
    # 50257 padded as in Megatron-LM. Dense attention (GPT-3 alternates dense and sparse).
    "gpt3-175b": "gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048,batch=1536",
    # Llama 3: ~4M-token batches (Llama 3 paper, Dubey et al. 2024, section 3.4.1);
    # 512 x 8192 = 4.2M tokens. RoPE base 500000.
    "llama3-8b": "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,"
    "seq=8192,batch=512,rope_theta=500000",
    "llama3-70b": "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,"
    "seq=8192,batch=512,rope_theta=500000",
    # Mixtral 8x7B (Jiang et al. 2024), RoPE base 1e6. Its batch size is not published;
    # 1024 x 4096 = 4.2M tokens matches the Llama-class batches above.
    "mixtral-8x7b": "mixtral:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,"
    "seq=4096,batch=1024,experts=8,top_k=2,rope_theta=1000000",
    # DeepSeek-V3 671B (DeepSeek-AI 2024, arXiv:2412.19437, Table/section 4.2): 61 layers (3
    # dense), hidden 7168, 128 heads of MLA, 256 routed experts of 2048 + 1 shared, top 8;
    # sequences of 4096, batch 15360 (the batch-size schedule's final value).
    "deepseek-v3": "deepseek:layers=61,hidden=7168,heads=128,ffn=18432,vocab=129280,seq=4096,"
    "batch=15360,experts=256,top_k=8,expert_ffn=2048,shared_experts=1,dense_layers=3,"
    "q_lora=1536,kv_lora=512",
}

# --- parametric specs -------------------------------------------------------------------

_REQUIRED = object()


def _sizes(*names: str) -> dict[str, tuple[type, Any]]:
    return {k: (int, None if k == "kv_heads" else _REQUIRED) for k in names}


# key -> (type, default); _REQUIRED has no default, batch=None means about 0.5M tokens.
_KEYS: dict[str, dict[str, tuple[type, Any]]] = {
    "gpt": {
        **_sizes("layers", "hidden", "heads", "vocab", "seq"),
        "batch": (int, None),
        "dropout": (float, 0.0),
        "bias": (bool, True),
        "tie": (bool, True),
        "math_attention": (bool, False),
    },
    "gpt2hf": {
        **_sizes("layers", "hidden", "heads", "vocab", "seq"),
        "batch": (int, None),
        "dropout": (float, 0.0),
    },
    "llama": {
        **_sizes("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"),
        "batch": (int, None),
        "rope_theta": (float, 500000.0),
    },
}
_KEYS["deepseek"] = {
    **_sizes("layers", "hidden", "heads", "ffn", "vocab", "seq"),
    "batch": (int, None),
    "experts": (int, 256),
    "top_k": (int, 8),
    "expert_ffn": (int, 2048),
    "shared_experts": (int, 1),
    "dense_layers": (int, 3),
    "q_lora": (int, 1536),
    "kv_lora": (int, 512),
}
# autopar's own MoE GPT (autopar.models.moe), in one of its three routing styles
_KEYS["moe"] = {
    **_sizes("layers", "hidden", "heads", "vocab", "seq"),
    "batch": (int, None),
    "experts": (int, 8),
    "top_k": (int, 2),
    "expert_ffn": (int, None),
    "shared_experts": (int, 0),
    "routing": (str, "sorted"),
    "aux_loss": (float, 0.01),
}
_KEYS["mixtral"] = {
    **_KEYS["llama"],
    "rope_theta": (float, 1e6),
    "experts": (int, 8),
    "top_k": (int, 2),
}

# A spec without batch= gets about half a million tokens per step, GPT-3 Small's batch.
_DEFAULT_BATCH_TOKENS = 2**19


def _resolve_spec(text: str, *, name: str) -> ModelSpec:
    """Parse ``family:key=value,...``; every problem names the key and lists the keys."""
    prefix, _, body = text.partition(":")
    prefix = prefix.strip().lower()
    if prefix not in _FAMILIES:
        raise _unknown(prefix, f"unknown model family '{prefix}' in '{text}'")
    raw: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or not value.strip():
            raise _key_error(text, prefix, f"'{item}' is not key=value")
        if key not in _KEYS[prefix]:
            raise _key_error(text, prefix, f"unknown key '{key}' for a {prefix} spec")
        if key in raw:
            raise _key_error(text, prefix, f"key '{key}' is given twice")
        raw[key] = value.strip()
    return _FAMILIES[prefix](name, _check_values(text, prefix, raw))


def _check_values(text: str, prefix: str, raw: Mapping[str, str]) -> dict[str, Any]:
    """Convert and range-check every key, filling in defaults."""
    values: dict[str, Any] = {}
    for key, (kind, default) in _KEYS[prefix].items():
        if key not in raw:
            if default is _REQUIRED:
                raise _key_error(text, prefix, f"missing key '{key}'")
            values[key] = default
            continue
        values[key] = _convert(text, prefix, key, kind, raw[key])
    if values["hidden"] % values["heads"]:
        raise _key_error(
            text, prefix, f"hidden={values['hidden']} is not divisible by heads={values['heads']}"
        )
    if "kv_heads" in values and values["kv_heads"] is None:
        values["kv_heads"] = values["heads"]  # plain multi-head attention
    if "kv_heads" in values and values["heads"] % values["kv_heads"]:
        raise _key_error(
            text,
            prefix,
            f"heads={values['heads']} is not divisible by kv_heads={values['kv_heads']}",
        )
    if "top_k" in values and values["top_k"] > values["experts"]:
        raise _key_error(
            text, prefix, f"top_k={values['top_k']} exceeds experts={values['experts']}"
        )
    if values["batch"] is None:
        values["batch"] = max(1, _DEFAULT_BATCH_TOKENS // values["seq"])
    check_batch_and_seq(values["batch"], values["seq"], f"model spec '{text}'")
    return values


_PATTERNS = {
    int: re.compile(r"[0-9]+"),
    float: re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"),
    bool: re.compile(r"[01]"),
    str: re.compile(r"[a-z_]+"),
}
_WANTED = {int: "an integer", float: "a number", bool: "0 or 1", str: "a word"}


def _convert(text: str, prefix: str, key: str, kind: type, value: str) -> Any:
    """One value, in plain ASCII digits (no ``1_000``, ``inf`` or ``nan``), within range."""
    if not _PATTERNS[kind].fullmatch(value):
        raise _key_error(text, prefix, f"key '{key}' must be {_WANTED[kind]}, got '{value}'")
    if kind is bool:
        return value == "1"
    if kind is str:
        if key == "routing" and value not in ROUTINGS:
            raise _key_error(text, prefix, f"key 'routing' must be one of {', '.join(ROUTINGS)}, "
                             f"got '{value}'")
        return value
    if kind is int:
        limit = SPEC_LIMITS[key]
        digits = value.lstrip("0")
        if len(digits) > len(str(limit)) or int(value) > limit:
            shown = value if len(value) <= 24 else f"{value[:12]}...({len(value)} digits)"
            raise _key_error(text, prefix, f"key '{key}' must be at most {limit}, got {shown}",
                             fix=f"use {key} <= {limit}: autopar's limits (SPEC_LIMITS) are far "
                             "above any published model and keep tracing time and tensor sizes "
                             "bounded")
        if int(value) <= 0:
            raise _key_error(text, prefix, f"key '{key}' must be positive, got {int(value)}")
        return int(value)
    converted = float(value)
    if not math.isfinite(converted):
        raise _key_error(text, prefix, f"key '{key}' must be a finite number, got '{value}'")
    if key == "dropout" and not 0.0 <= converted < 1.0:
        raise _key_error(text, prefix, f"key 'dropout' must be in [0, 1), got {converted}")
    if key == "aux_loss" and converted < 0:
        raise _key_error(text, prefix, f"key 'aux_loss' must be >= 0, got {converted}")
    if key == "rope_theta" and converted <= 0:
        raise _key_error(text, prefix, f"key 'rope_theta' must be positive, got {converted}")
    return converted


def _key_error(text: str, prefix: str, what: str, fix: str | None = None) -> ModelSpecError:
    keys = _KEYS[prefix]
    required = [k for k, (_, d) in keys.items() if d is _REQUIRED]
    optional = [k for k, (_, d) in keys.items() if d is not _REQUIRED]
    return ModelSpecError(
        what,
        where=f"model spec '{text}'",
        fix=fix or f"a {prefix} spec takes required keys {', '.join(required)}; "
        f"optional {', '.join(optional)}",
    )


def _unknown(name: str, what: str) -> ModelSpecError:
    close = difflib.get_close_matches(name.lower(), [*_BUILTINS, *_KEYS], n=2)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    forms = [
        f"{p}:" + ",".join(f"{k}=N" for k, (_, d) in keys.items() if d is _REQUIRED)
        for p, keys in _KEYS.items()
    ]
    lines = [
        hint,
        f"built-in models: {', '.join(_BUILTINS)}",
        *(f"or a spec: {form}" for form in forms),
        "or a factory: path/to/file.py:make_model",
    ]
    return ModelSpecError(what, where="model name", fix="\n         ".join(filter(None, lines)))


# --- families ---------------------------------------------------------------------------


def _gpt_spec(name: str, v: dict[str, Any]) -> ModelSpec:
    config = GPTConfig(
        block_size=v["seq"],
        vocab_size=v["vocab"],
        n_layer=v["layers"],
        n_head=v["heads"],
        n_embd=v["hidden"],
        dropout=v["dropout"],
        bias=v["bias"],
        tie_weights=v["tie"],
        attention="math" if v["math_attention"] else "sdpa",
    )

    def inputs(batch: int, seq: int, device: Device) -> tuple[tuple, dict]:
        _check_positions(name, seq, v["seq"])
        return _token_ids(batch, seq, v["vocab"], device, 2), {}

    return _spec(name, "gpt", v, partial(GPT, config), inputs)


def _gpt2hf_spec(name: str, v: dict[str, Any]) -> ModelSpec:
    build = partial(
        hf.build_gpt2,
        layers=v["layers"],
        hidden=v["hidden"],
        heads=v["heads"],
        vocab=v["vocab"],
        seq=v["seq"],
        dropout=v["dropout"],
    )

    def inputs(batch: int, seq: int, device: Device) -> tuple[tuple, dict]:
        _check_positions(name, seq, v["seq"])
        return _hf_inputs(batch, seq, device, vocab=v["vocab"])

    return _spec(name, "gpt2-hf", v, build, inputs)


def _llama_spec(name: str, v: dict[str, Any], family: str = "llama") -> ModelSpec:
    sizes = {
        k: v[k]
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "rope_theta")
    }
    if family == "mixtral":
        build = partial(hf.build_mixtral, **sizes, experts=v["experts"], top_k=v["top_k"])
    else:
        build = partial(hf.build_llama, **sizes)
    # RoPE positions are computed, not learned, so any sequence length traces.
    return _spec(name, family, v, build, partial(_hf_inputs, vocab=v["vocab"]))


def _deepseek_spec(name: str, v: dict[str, Any]) -> ModelSpec:
    build = partial(hf.build_deepseek_v3, **{k: v[k] for k in (
        "layers", "hidden", "heads", "ffn", "vocab", "seq", "experts", "top_k", "expert_ffn",
        "shared_experts", "dense_layers", "q_lora", "kv_lora")})
    return _spec(name, "deepseek", v, build, partial(_hf_inputs, vocab=v["vocab"]))


def _moe_spec(name: str, v: dict[str, Any]) -> ModelSpec:
    from autopar.models.moe import MoEConfig, MoEGPT

    config = MoEConfig(block_size=v["seq"], vocab_size=v["vocab"], n_layer=v["layers"],
                       n_head=v["heads"], n_embd=v["hidden"], experts=v["experts"],
                       top_k=v["top_k"], expert_ffn=v["expert_ffn"] or 4 * v["hidden"],
                       shared_experts=v["shared_experts"], routing=v["routing"],
                       aux_loss_coef=v["aux_loss"])

    def inputs(batch: int, seq: int, device: Device) -> tuple[tuple, dict]:
        _check_positions(name, seq, v["seq"])
        return _token_ids(batch, seq, v["vocab"], device, 2), {}

    return _spec(name, "moe", v, partial(MoEGPT, config), inputs)


_FAMILIES: dict[str, Callable[[str, dict[str, Any]], ModelSpec]] = {
    "gpt": _gpt_spec,
    "gpt2hf": _gpt2hf_spec,
    "llama": _llama_spec,
    "mixtral": partial(_llama_spec, family="mixtral"),
    "deepseek": _deepseek_spec,
    "moe": _moe_spec,
}


def _spec(
    name: str, family: str, v: dict[str, Any], build: Callable[[], nn.Module], inputs: InputsFn
) -> ModelSpec:
    config = {k: val for k, val in v.items() if k != "batch"}
    return ModelSpec(
        name=name,
        family=family,
        config=MappingProxyType(config),
        default_batch=v["batch"],
        default_seq=v["seq"],
        build=build,
        inputs_fn=inputs,
    )


def _check_positions(name: str, seq: int, max_seq: int) -> None:
    if seq > max_seq:
        raise ModelSpecError(
            f"sequence length {seq} exceeds the {max_seq} learned positions of model {name}",
            where=f"model {name}",
            fix=f"use seq <= {max_seq}, or a spec with seq={seq}",
        )


def _token_ids(batch: int, seq: int, vocab: int, device: Device, count: int) -> tuple:
    """``count`` int64 tensors of token ids; seeded, so identical on every rank."""
    if torch.device(device).type == "meta":
        return tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(count))
    gen = torch.Generator().manual_seed(0)
    return tuple(
        torch.randint(0, vocab, (batch, seq), generator=gen).to(device) for _ in range(count)
    )


def _hf_inputs(batch: int, seq: int, device: Device, *, vocab: int) -> tuple[tuple, dict]:
    # HF shifts labels inside its loss, so labels are the input ids themselves (a separate
    # tensor: export does not like the same tensor passed as two inputs).
    ids, labels = _token_ids(batch, seq, vocab, device, 2)
    if torch.device(device).type != "meta":
        labels = ids.clone()
    return (), {"input_ids": ids, "labels": labels, "use_cache": False}
