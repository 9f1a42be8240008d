"""A small mixture-of-experts GPT, with its routing written in each of the three ways models
write it, so autopar is checked on all three:

- ``"loop"``: a loop over experts, each picking its tokens with ``torch.where`` (a
  ``nonzero``) and adding its output back with ``index_add`` (Hugging Face's older MoE
  layers, Megatron's ``SequentialMLP``);
- ``"dense"``: GShard-style one-hot dispatch and combine tensors with a capacity per
  expert, every expert computed with einsum on its slots (Mesh-TensorFlow, GShard, Switch);
- ``"sorted"``: tokens sorted by expert, counted with ``histc``, and run through one
  grouped matmul, as torchtitan and Hugging Face's Mixtral, Qwen-MoE and DeepSeek-V3 do
  (``autopar.ops.moe_ops.grouped_mm``: ``torch._grouped_mm`` where it runs).

Routing is top-k over a softmax of the router logits (computed in fp32), the k weights
renormalised (Mixtral). The training loss adds, as the model writes them:

- the load-balancing loss of Switch/GShard, ``experts * sum_e f_e * P_e`` with ``f_e`` the
  fraction of routed (token, choice) pairs that picked expert ``e`` and ``P_e`` its mean
  router probability — both means over the whole batch, so a product of batch statistics;
- optionally the router z-loss of ST-MoE, the mean squared log-sum-exp of the logits;
- optionally DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
  scores only to choose experts, nudged after every forward by ``bias_update_rate`` toward
  the experts that got fewer tokens than the mean.

>>> import torch
>>> model = MoEGPT(MoEConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16,
...                          experts=4, top_k=2, expert_ffn=32, routing="loop"))
>>> idx = torch.randint(0, 32, (2, 8))
>>> logits, loss = model(idx, idx)
>>> logits.shape, loss.ndim
(torch.Size([2, 8, 32]), 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import ModelSpecError
from autopar.models.gpt import CausalSelfAttention, GPTConfig
from autopar.ops.moe_ops import grouped_mm

ROUTINGS = ("loop", "dense", "sorted")


@dataclass(frozen=True)
class MoEConfig:
    """Sizes and routing of an MoE GPT, checked on creation."""

    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    experts: int = 4
    top_k: int = 2
    expert_ffn: int = 64
    shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek, Qwen-MoE)
    routing: str = "sorted"
    # dense routing only: slots per expert = ceil(capacity_factor * top_k * seq / experts);
    # None keeps every token (slots = seq).
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "experts",
                     "top_k", "expert_ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelSpecError(f"MoEConfig.{name} must be a positive integer, got {value!r}",
                                     where=f"MoEConfig.{name}", fix=f"pass {name} as an int >= 1")
        if self.top_k > self.experts:
            raise ModelSpecError(
                f"MoEConfig.top_k ({self.top_k}) exceeds experts ({self.experts})",
                where="MoEConfig.top_k", fix="each token picks at most every expert once: "
                "choose top_k <= experts")
        if self.routing not in ROUTINGS:
            raise ModelSpecError(f"MoEConfig.routing must be one of {ROUTINGS}, got "
                                 f"{self.routing!r}", where="MoEConfig.routing",
                                 fix="pick 'loop', 'dense' or 'sorted'")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ModelSpecError(f"MoEConfig.capacity_factor must be > 0, got "
                                 f"{self.capacity_factor!r}", where="MoEConfig.capacity_factor",
                                 fix="use e.g. 1.25, or None to keep every token")
        if self.n_embd % self.n_head:
            raise ModelSpecError(f"MoEConfig.n_embd ({self.n_embd}) is not divisible by n_head "
                                 f"({self.n_head})", where="MoEConfig.n_embd",
                                 fix="choose n_embd as a multiple of n_head")

    def attention_config(self) -> GPTConfig:
        return GPTConfig(block_size=self.block_size, vocab_size=self.vocab_size,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         bias=False)


class Router(nn.Module):
    """Top-k routing: ``(indices, weights, aux)`` for tokens ``x`` of shape (..., n_embd)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.n_embd, config.experts, bias=False)
        if config.bias_update_rate:
            self.register_buffer("expert_bias", torch.zeros(config.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        if c.bias_update_rate:
            indices = torch.topk(probs + self.expert_bias, c.top_k, dim=-1).indices
            top = probs.gather(-1, indices)
        else:
            top, indices = torch.topk(probs, c.top_k, dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
        chosen = F.one_hot(indices, c.experts).float()  # (..., k, E)
        tokens = chosen.reshape(-1, c.top_k, c.experts)
        aux = x.new_zeros((), dtype=torch.float32)
        if c.aux_loss_coef:
            f = tokens.mean(dim=(0, 1))  # fraction of (token, choice) pairs per expert
            p = probs.reshape(-1, c.experts).mean(dim=0)  # mean router probability
            aux = aux + c.aux_loss_coef * c.experts * (f * p).sum()
        if c.z_loss_coef:
            aux = aux + c.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        if c.bias_update_rate and self.training:
            with torch.no_grad():
                load = tokens.sum(dim=(0, 1))
                self.expert_bias.add_(c.bias_update_rate * torch.sign(load.mean() - load))
        return indices, weights, aux


class StackedExperts(nn.Module):
    """Every expert's weights stacked on dim 0, in a module of their own (as torchtitan and
    Hugging Face hold them): ZeRO-3 with expert parallelism shards this module over the ranks
    holding the same experts, apart from the router and the shared experts."""

    def __init__(self, experts: int, n_embd: int, ffn: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(experts, n_embd, ffn).normal_(std=0.02))
        self.w_out = nn.Parameter(torch.empty(experts, ffn, n_embd).normal_(std=0.02))


class MoE(nn.Module):
    """Routed experts (GELU MLPs), plus ``shared_experts`` always-on ones folded into one
    wider MLP, as DeepSeek-V3 writes them."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = Router(config)
        e, m, f = config.experts, config.n_embd, config.expert_ffn
        if config.routing == "loop":
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(m, f, bias=False), nn.GELU(), nn.Linear(f, m, bias=False))
                for _ in range(e))
        else:
            self.experts = StackedExperts(e, m, f)
        if config.shared_experts:
            width = config.shared_experts * f
            self.shared = nn.Sequential(nn.Linear(m, width, bias=False), nn.GELU(),
                                        nn.Linear(width, m, bias=False))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices, weights, aux = self.router(x)
        route = {"loop": self._loop, "dense": self._dense, "sorted": self._sorted}
        out = route[self.config.routing](x, indices, weights)
        if self.config.shared_experts:
            out = out + self.shared(x)
        return out, aux

    def _loop(self, x, indices, weights):
        m = x.shape[-1]
        flat = x.reshape(-1, m)
        idx = indices.reshape(-1, self.config.top_k)
        w = weights.reshape(-1, self.config.top_k)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            y = expert(flat[token]) * w[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y)
        return out.view_as(x)

    def _dense(self, x, indices, weights):
        c = self.config
        b, t, m = x.shape
        slots = t if c.capacity_factor is None else min(
            t, math.ceil(c.capacity_factor * c.top_k * t / c.experts))
        # (b, t*k, E): which expert each (token, choice) picked; its place in that expert's
        # queue, counted within the sequence in token order; kept if within capacity.
        picked = F.one_hot(indices.reshape(b, t * c.top_k), c.experts).to(x.dtype)
        place = torch.cumsum(picked, dim=1) * picked - 1
        kept = picked * (place < slots).to(x.dtype)
        dispatch = kept.unsqueeze(-1) * F.one_hot(place.clamp(min=0).long(), slots).to(x.dtype)
        combine = dispatch * weights.reshape(b, t * c.top_k, 1, 1)
        tokens = x.repeat_interleave(c.top_k, dim=1)  # (b, t*k, m): each choice's token
        queued = torch.einsum("bsec,bsm->becm", dispatch, tokens)
        hidden = F.gelu(torch.einsum("becm,emf->becf", queued, self.experts.w_in))
        done = torch.einsum("becf,efm->becm", hidden, self.experts.w_out)
        return torch.einsum("bsec,becm->bsm", combine, done).reshape(b, t, c.top_k, m).sum(2)

    def _sorted(self, x, indices, weights):
        c = self.config
        m = x.shape[-1]
        flat = x.reshape(-1, m)
        experts = indices.reshape(-1)
        order = torch.argsort(experts, stable=True)
        token = order // c.top_k
        counts = torch.histc(experts.float(), bins=c.experts, min=0, max=c.experts - 1)
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        hidden = F.gelu(grouped_mm(flat[token], self.experts.w_in, offsets))
        done = grouped_mm(hidden, self.experts.w_out, offsets)
        done = done * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token, done).view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config.attention_config())
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux


class MoEGPT(nn.Module):
    """A GPT whose MLPs are mixtures of experts; ``forward`` returns ``(logits, loss)``, the
    loss being cross-entropy plus every layer's balancing and z-losses."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.h:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss + aux
