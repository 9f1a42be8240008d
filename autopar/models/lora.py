"""LoRA and QLoRA: a model transform applied before autopar traces the model.

>>> import torch
>>> from autopar.models.gpt import GPT, GPTConfig
>>> from autopar.models.lora import LoraConfig, apply_lora, merge_lora
>>> model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
>>> model = apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("c_attn",)))
>>> sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad})
['lora_A', 'lora_B']
>>> plain = merge_lora(model)   # nn.Linear again, W + (alpha / rank) * B @ A

Each targeted ``nn.Linear`` becomes a :class:`LoraLinear` that keeps the frozen base
weight under its original name (``<path>.weight``), so a state dict of the original model
loads into the adapted one with ``strict=False``; every other parameter is frozen too, as
peft does. ``lora_B`` starts at zero, so the adapted model computes exactly what the
original did.

QLoRA (``quantize="nf4"``) stores the frozen weight as 4-bit NormalFloat codes with one
absmax scale per block of 64 (Dettmers et al. 2023, no double quantization). The codes are
computed by **bitsandbytes**, the QLoRA authors' own library (``quantize_4bit``, whose CPU
backend quantizes NF4 as of 0.50.2). torchao 0.18 was the other candidate: its NF4 tensor
works on CPU too, but it always double-quantizes the scales, its module moved
(``torchao.dtypes.nf4tensor`` is gone), and its weight is a tensor subclass that
``torch.export`` records through ``export.access_subclass_inner_tensor`` ops, which
autopar's passes cannot shard. Here the codes and scales are plain buffers (``weight_nf4``: uint8, two codes a byte,
high nibble first, rows padded to whole blocks; ``weight_absmax``: one float per block), and
``forward`` dequantizes them with ordinary torch ops, so the exported graph holds plain aten
ops that the sharding rules know, and a row or block slice of the buffers is a valid shard.
The dequantization is checked bit for bit against ``bitsandbytes.functional.dequantize_4bit``
in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import AutoparError

__all__ = ["LoraConfig", "LoraFacts", "LoraLinear", "apply_lora", "lora_memory_facts",
           "merge_lora", "nf4_dequantize", "nf4_quantize"]

QUANTIZE = (None, "nf4")
NF4_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts
# The 16 NF4 values (QLoRA paper, appendix E; bitsandbytes ``get_4bit_type("nf4")``).
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
            0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)


@dataclass(frozen=True)
class LoraConfig:
    """Which ``nn.Linear`` modules to adapt, and how; checked on creation."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names or dotted name suffixes ("q_proj", "attn.c_attn")
    dropout: float = 0.0  # on the adapter's input only, as peft's lora_dropout
    quantize: str | None = None  # "nf4": QLoRA's 4-bit frozen base weights
    train_also: tuple[str, ...] = ()  # name suffixes of other parameters kept trainable
    nf4_block_size: int = 64

    def __post_init__(self) -> None:
        for name in ("targets", "train_also"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(v, str) and v.strip(".") for v in value):
                _config_error(name, getattr(self, name), "a tuple of module names such as "
                              "('q_proj', 'v_proj')")
            object.__setattr__(self, name, value)
        if not self.targets:
            _config_error("targets", self.targets, "name at least one nn.Linear, e.g. 'q_proj'")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            _config_error("rank", self.rank, "pass an int >= 1 (8 or 16 are usual)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not self.alpha > 0 or not math.isfinite(self.alpha):
            _config_error("alpha", self.alpha, "pass a positive number (often 2 * rank)")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            _config_error("dropout", self.dropout, "pass a float in [0, 1)")
        if self.quantize not in QUANTIZE:
            _config_error("quantize", self.quantize, "pass None or 'nf4'")
        if self.nf4_block_size not in NF4_BLOCK_SIZES:
            _config_error("nf4_block_size", self.nf4_block_size,
                          f"use one of {', '.join(map(str, NF4_BLOCK_SIZES))} (QLoRA uses 64)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _config_error(field: str, value: object, fix: str) -> None:
    raise AutoparError(f"LoraConfig.{field} is invalid: {value!r}",
                       where=f"LoraConfig.{field}", fix=fix)


def nf4_quantize(weight: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of a 2-D weight: codes ``uint8 [out, padded_in // 2]``, absmax
    ``float32 [out, padded_in // block_size]``. Each row is zero-padded to whole blocks so no
    block spans two rows (zero has an exact NF4 code), which keeps row shards valid."""
    try:
        from bitsandbytes.functional import quantize_4bit
    except ImportError as error:
        raise AutoparError("quantize='nf4' needs bitsandbytes, which is not installed",
                           where="LoraConfig.quantize",
                           fix="pip install 'autopar[qlora]' (bitsandbytes>=0.50)") from error
    out_features, in_features = weight.shape
    padded = F.pad(weight.detach(), (0, -in_features % block_size))
    codes, state = quantize_4bit(padded.contiguous(), blocksize=block_size, quant_type="nf4",
                                 compress_statistics=False)
    return (codes.reshape(out_features, -1),
            state.absmax.float().reshape(out_features, -1))


def nf4_dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                   in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight the codes stand for, in plain torch ops (traceable, shardable by rows)."""
    high = codes // 16
    low = codes - high * 16
    index = torch.stack((high, low), dim=-1).reshape(codes.shape[0], -1).long()
    if absmax.dtype != code.dtype:  # no-op casts would be graph nodes too
        absmax = absmax.to(code.dtype)
    weight = (code[index].reshape(*absmax.shape, -1) * absmax.unsqueeze(-1))
    weight = weight.reshape(codes.shape[0], -1)
    if weight.shape[1] != in_features:
        weight = weight[:, :in_features]
    return weight if weight.dtype == dtype else weight.to(dtype)


class LoraLinear(nn.Module):
    """``base(x) + dropout(x) @ A.T @ B.T * (alpha / rank)``, the base weight frozen.

    The base weight is ``weight`` (a frozen parameter) or, quantized, the buffers
    ``weight_nf4``/``weight_absmax`` (a state dict's ``weight`` is quantized on load)."""

    def __init__(self, linear: nn.Linear, config: LoraConfig):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.rank = config.rank
        self.scale = config.scale
        self.quantized = config.quantize == "nf4"
        self.block_size = config.nf4_block_size
        weight = linear.weight
        kw = dict(device=weight.device, dtype=weight.dtype)
        if self.quantized:
            self._register_nf4(weight)
            self.register_load_state_dict_pre_hook(_quantize_on_load)
        else:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(),
                                                                    requires_grad=False)
        self.lora_A = nn.Parameter(torch.empty(config.rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, config.rank, **kw))
        if not self.lora_A.is_meta:
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # peft's init of A
        self.lora_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()

    def _register_nf4(self, weight: torch.Tensor) -> None:
        padded = self.in_features + (-self.in_features % self.block_size)
        if weight.is_meta:  # planning a large model: shapes only, nothing to quantize
            codes = torch.empty(self.out_features, padded // 2, dtype=torch.uint8, device="meta")
            absmax = torch.empty(self.out_features, padded // self.block_size, device="meta")
        else:
            codes, absmax = nf4_quantize(weight, self.block_size)
        self.register_buffer("weight_nf4", codes)
        self.register_buffer("weight_absmax", absmax)
        self.register_buffer("nf4_code", torch.tensor(NF4_CODE, device=weight.device),
                             persistent=False)

    def base_weight(self) -> torch.Tensor:
        """The frozen weight the layer computes with: dequantized when quantized, in the
        adapter's dtype (which follows ``model.to(dtype)`` as the uint8 codes cannot)."""
        if not self.quantized:
            return self.weight
        return nf4_dequantize(self.weight_nf4, self.weight_absmax, self.nf4_code,
                              self.in_features, self.lora_A.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.base_weight(), self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return base + update * self.scale

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing ``W + scale * B @ A`` (frozen, like the base)."""
        w = self.base_weight().detach()
        delta = (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scale
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=w.device, dtype=w.dtype)
        linear.weight = nn.Parameter((w.float() + delta).to(w.dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        kind = f", nf4 block {self.block_size}" if self.quantized else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, scale={self.scale:g}{kind}")


def _quantize_on_load(module: LoraLinear, state_dict: dict, prefix: str, *_: object) -> None:
    """Accept the original model's ``<path>.weight`` by quantizing it into the buffers, and
    refill the (non-persistent) code table, which ``to_empty`` leaves uninitialized."""
    if not module.nf4_code.is_meta:
        with torch.no_grad():
            module.nf4_code.copy_(torch.tensor(NF4_CODE))
    weight = state_dict.pop(prefix + "weight", None)
    if weight is not None:
        codes, absmax = nf4_quantize(weight, module.block_size)
        state_dict[prefix + "weight_nf4"] = codes
        state_dict[prefix + "weight_absmax"] = absmax


def apply_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Replace the targeted ``nn.Linear`` modules by :class:`LoraLinear` and freeze every
    other parameter (bar ``config.train_also``), in place; returns ``model``."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen: dict[str, nn.Linear] = {}
    for target in config.targets:
        hits = {n: m for n, m in linears.items() if _matches(n, target)}
        if not hits:
            raise _no_target(model, target, linears)
        chosen.update(hits)
    if config.quantize:
        _check_not_shared(model, chosen)
    model.requires_grad_(False)
    for name, linear in chosen.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                LoraLinear(linear, config))
    for module in model.modules():  # adapters of an earlier apply_lora stay trainable
        if isinstance(module, LoraLinear):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)
    _keep_trainable(model, config.train_also)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place: each :class:`LoraLinear` becomes
    an ``nn.Linear`` under its original name, so the state dict has the original model's
    names and shapes. ``requires_grad`` flags stay as :func:`apply_lora` left them."""
    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]
    for name, module in adapted:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module.merged())
    return model


@dataclass(frozen=True)
class LoraFacts:
    """What the memory model needs: frozen weights have no gradient or optimizer state."""

    trainable_params: int
    frozen_params: int  # parameters with requires_grad=False (bytes: their own dtype)
    quantized_weights: int  # weight elements stored as NF4 codes (buffers, not parameters)
    quantized_bytes: int  # bytes of those codes and their absmax scales


def lora_memory_facts(model: nn.Module) -> LoraFacts:
    """Count trainable, frozen and quantized weights of a model (adapted or not)."""
    params = list(model.parameters())
    quantized = [m for m in model.modules() if isinstance(m, LoraLinear) and m.quantized]
    return LoraFacts(
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        frozen_params=sum(p.numel() for p in params if not p.requires_grad),
        quantized_weights=sum(m.in_features * m.out_features for m in quantized),
        quantized_bytes=sum(b.numel() * b.element_size() for m in quantized
                            for b in (m.weight_nf4, m.weight_absmax)),
    )


def _matches(name: str, target: str) -> bool:
    target = target.strip(".")
    return name == target or name.endswith("." + target)


def _keep_trainable(model: nn.Module, suffixes: tuple[str, ...]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for suffix in suffixes:
        hits = [p for n, p in params.items()
                if _matches(n, suffix) or _matches(n.rpartition(".")[0], suffix)]
        if not hits:
            modules = sorted({n.rpartition(".")[0].rsplit(".", 1)[-1] for n in params} - {""})
            raise AutoparError(
                f"train_also '{suffix}' matches no parameter of {type(model).__name__}",
                where="LoraConfig.train_also",
                fix=f"name parameters or their modules by name or dotted suffix; "
                    f"modules here include {_some(modules)}")
        for p in hits:
            p.requires_grad_(True)


def _check_not_shared(model: nn.Module, chosen: dict[str, nn.Linear]) -> None:
    """A tied weight (GPT's lm_head and wte) cannot be quantized for one user only."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for path, linear in chosen.items():
        shared = [n for n in names[id(linear.weight)] if n != f"{path}.weight"]
        if shared:
            raise AutoparError(
                f"cannot quantize '{path}.weight' to NF4: it is tied to {', '.join(shared)}",
                where=f"LoraConfig.targets ({path})",
                fix="leave the tied layer out of targets, or untie the weights first")


def _no_target(model: nn.Module, target: str, linears: dict[str, nn.Linear]) -> AutoparError:
    adapted = [n for n, m in model.named_modules()
               if isinstance(m, LoraLinear) and _matches(n, target)]
    if adapted:
        return AutoparError(f"LoRA target '{target}' is already adapted ({adapted[0]}, ...)",
                            where="LoraConfig.targets",
                            fix="apply_lora once per target; merge_lora undoes it")
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    example = f" (e.g. '{next(iter(linears))}')" if linears else ""
    return AutoparError(
        f"LoRA target '{target}' matches no nn.Linear in {type(model).__name__}",
        where="LoraConfig.targets",
        fix=f"name nn.Linear modules by name or dotted suffix; the model's nn.Linear names "
            f"are {_some(leaves)}{example}" if linears else "this model has no nn.Linear")


def _some(names: list[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") or "(none)"
