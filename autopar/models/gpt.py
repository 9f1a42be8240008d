"""A nanoGPT-style GPT: the "ordinary model" autopar parallelizes.

The architecture is that of Karpathy's nanoGPT ``model.py``: token and learned position
embeddings, pre-LayerNorm blocks with a fused ``c_attn`` projection, causal
``scaled_dot_product_attention``, a GELU MLP, and an ``lm_head`` tied to the token
embedding. Nothing here knows about parallelism: autopar traces this model and decides.

Every weight is initialized in place, so the model builds under ``torch.device("meta")``
without allocating, which is how a 175B-parameter GPT is planned on a laptop::

    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=2048, vocab_size=51200, n_layer=96, n_head=96,
                              n_embd=12288))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import ModelSpecError


@dataclass(frozen=True)
class GPTConfig:
    """GPT hyperparameters, checked on creation so a bad size fails here, not in a matmul."""

    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2; False is a bit faster
    tie_weights: bool = True  # lm_head shares its weight with the token embedding
    # "sdpa": fused scaled_dot_product_attention (flash-style). "math": the explicit
    # matmul -> scale -> mask -> softmax -> dropout -> matmul of nanoGPT's slow path, GPT-2
    # and 2021-era Megatron, which materializes the attention scores.
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelSpecError(
                    f"GPTConfig.{name} must be a positive integer, got {value!r}",
                    where=f"GPTConfig.{name}",
                    fix=f"pass {name} as an int >= 1",
                )
        if self.n_embd % self.n_head:
            raise ModelSpecError(
                f"GPTConfig.n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head})",
                where="GPTConfig.n_embd",
                fix="choose n_embd as a multiple of n_head (each head gets n_embd // n_head)",
            )
        if self.attention not in ("sdpa", "math"):
            raise ModelSpecError(
                f"GPTConfig.attention must be 'sdpa' or 'math', got {self.attention!r}",
                where="GPTConfig.attention",
                fix="use 'sdpa' (fused) or 'math' (explicit softmax)",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelSpecError(
                f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}",
                where="GPTConfig.dropout",
                fix="use 0.0 for pretraining, or e.g. 0.1 when finetuning",
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.math = config.attention == "math"
        if self.math:
            self.attn_dropout = nn.Dropout(config.dropout)
            causal = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
            self.register_buffer("causal", causal.view(1, 1, config.block_size,
                                                       config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.math:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        else:
            dropout_p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model; ``forward`` returns ``(logits, loss)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the residual
        # stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position and, given ``targets``, their mean cross-entropy."""
        _, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
