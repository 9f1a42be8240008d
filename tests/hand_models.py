"""Hand-written models the way users write them, beside the Hugging Face zoo: each stresses
what makes a split batch train differently from the whole one.

- ``sum_loss``: a cross-entropy with ``reduction="sum"`` (a sum over the batch, not a mean);
- ``masked_mean``: a per-token loss averaged over a padding mask by hand (``sum / mask.sum()``);
- ``kl_batchmean``: a KL divergence with ``reduction="batchmean"`` (divided by the traced
  batch size) beside a cross-entropy;
- ``pool_bce``: mean pooling over tokens with ``adaptive_avg_pool1d`` and a multi-label
  binary cross-entropy with logits;
- ``last_token``: a classifier reading each row's last real token (``gather`` of a
  ``[B, 1]`` index, then ``squeeze``);
- ``moe_loop``: a mixture of experts written as the common loop (``hit.any(-1).nonzero()``,
  ``x[rows]``, ``index_add``) with a Switch-style balancing loss; ``moe_histc``: its tokens
  per expert counted with ``histc``;
- ``batch_norm``: convolutions and batch norms in training mode;
- ``shared_layers``: one layer applied three times (ALBERT-style weight sharing);
- ``set_order``: branches built in the order of a ``set`` of strings, which follows each
  process's hash seed (as some Hugging Face models loop over ``set(config.layer_types)``).

Every model but the batch norm one runs its tokens through two transformer blocks (SDPA
attention: context parallelism applies, and pipelines cut between them), and takes a
right-padded batch where it has tokens: labels are -100 on the padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH, HIDDEN = 96, 16, 4, 32
LENGTHS = (16, 11, 7, 13)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _mask() -> torch.Tensor:
    return (torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]).long()


def _labels(seed: int) -> torch.Tensor:
    return _tokens(seed).masked_fill(_mask() == 0, -100)


class _Block(nn.Module):
    """Pre-norm self-attention (SDPA, 4 heads) and an MLP, each with its residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(),
                                 nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, 4, HIDDEN // 4).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, HIDDEN)
        x = x + self.out(att)
        return x + self.mlp(self.norm2(x))


class _Tokens(nn.Module):
    """Embedding and two transformer blocks: [B, S] ids -> [B, S, H]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return h


class SumLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx, labels):
        logits = self.head(self.body(idx))
        # a sum over tokens, scaled as users scale it (not a mean: per-part means are wrong)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="sum") / 64


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx, labels, mask):
        logits = self.head(self.body(idx))
        per_token = F.cross_entropy(logits.view(-1, VOCAB), labels.clamp(min=0).view(-1),
                                    reduction="none")
        weight = mask.view(-1).float()
        return (per_token * weight).sum() / weight.sum()


class KLBatchMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, VOCAB)
        self.prior = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, idx, labels):
        logits = self.head(self.body(idx))
        ce = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        target = torch.softmax(self.prior, -1).expand_as(logits)
        kl = F.kl_div(torch.log_softmax(logits, -1), target, reduction="batchmean")
        return ce + 0.1 * kl


class PoolBCE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, 6)

    def forward(self, idx, labels):
        pooled = F.adaptive_avg_pool1d(self.body(idx).transpose(1, 2), 1).squeeze(-1)
        return F.binary_cross_entropy_with_logits(self.head(pooled), labels)


class LastToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, 5)

    def forward(self, idx, mask, labels):
        h = self.body(idx)
        last = mask.sum(1, keepdim=True) - 1  # [B, 1]
        picked = h.gather(1, last[:, :, None].expand(-1, 1, h.shape[-1])).squeeze(1)
        return F.cross_entropy(self.head(picked), labels)


class LoopMoE(nn.Module):
    """Top-2 routing over 4 experts, the loop most MoE code starts from."""

    def __init__(self, count: str = "one_hot", experts: int = 4) -> None:
        super().__init__()
        self.body = _Tokens()
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN))
            for _ in range(experts))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.count = count

    def forward(self, idx, labels):
        x = self.body(idx)
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), -1)
        weights, chosen = probs.topk(2, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            hit = chosen == e
            rows = hit.any(-1).nonzero()[:, 0]
            w = (weights * hit).sum(-1)[rows, None]
            out = out.index_add(0, rows, w * expert(tokens[rows]))
        experts = len(self.experts)
        if self.count == "histc":
            per_expert = torch.histc(chosen.float(), bins=experts, min=0, max=experts - 1)
            fraction = per_expert / per_expert.sum()
        else:
            fraction = F.one_hot(chosen[:, 0], experts).float().mean(0)
        balance = experts * (fraction * probs.mean(0)).sum()  # Switch Transformer's loss
        logits = self.head(tokens + out)
        return F.cross_entropy(logits, labels.view(-1)) + 0.01 * balance


class ConvBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU())
            for _ in range(2))
        self.head = nn.Linear(8, 5)

    def forward(self, idx, labels):
        h = self.embed(idx).transpose(1, 2)
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.head(h.mean(-1)), labels)


class SharedLayers(nn.Module):
    """One transformer block applied three times (ALBERT's cross-layer sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = _Block()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx, labels):
        h = self.embed(idx)
        for _ in range(3):
            h = self.block(h)
        return F.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))


class SetOrder(nn.Module):
    KINDS = ("near", "far", "strided", "dilated")

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, VOCAB)
        self.branch = nn.ModuleDict({k: nn.Linear(HIDDEN, HIDDEN) for k in self.KINDS})

    def forward(self, idx, labels):
        h = self.body(idx)
        made = {kind: torch.relu(self.branch[kind](h)) for kind in set(self.KINDS)}
        h = h + sum(made[kind] for kind in self.KINDS)
        return F.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))


class SlicedKeys(nn.Module):
    """DeepSeek-V2's attention as Hugging Face writes it: keys filled slice by slice into a
    ``new_empty`` buffer (a per-head part and a rotary part shared by the heads, rotated as
    complex numbers). Not in the matrix: tests/test_exact_batches.py plans it."""

    def __init__(self, heads: int = 4, nope: int = 8, rope: int = 4) -> None:
        super().__init__()
        self.heads, self.nope, self.rope = heads, nope, rope
        self.body, self.head = _Tokens(), nn.Linear(HIDDEN, VOCAB)
        self.q = nn.Linear(HIDDEN, heads * (nope + rope), bias=False)
        self.kv = nn.Linear(HIDDEN, heads * 2 * (nope + rope), bias=False)
        self.rot = nn.Linear(HIDDEN, rope, bias=False)

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[2]
        angles = torch.arange(s)[:, None] * torch.ones(self.rope // 2)
        turn = torch.polar(torch.ones(s, self.rope // 2), angles)[None, None]
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * turn).flatten(3)

    def forward(self, idx, labels):
        h = self.body(idx)
        b, s, _ = h.shape
        q = self.q(h).view(b, s, self.heads, -1).transpose(1, 2)
        q = torch.cat([q[..., :self.nope], self._rotated(q[..., self.nope:])], dim=-1)
        kv = self.kv(h).view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope + self.rope:]
        k_rot = self._rotated(self.rot(h).view(b, 1, s, self.rope)).expand(-1, self.heads, -1, -1)
        key = kv.new_empty(b, self.heads, s, self.nope + self.rope)
        key[..., :self.nope].copy_(k_nope)
        key[..., self.nope:].copy_(k_rot)
        y = F.scaled_dot_product_attention(q, key, v, is_causal=True)
        h = h + y.transpose(1, 2).reshape(b, s, -1)[..., :HIDDEN]
        return F.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))


def _built(model: Callable[[], nn.Module], *inputs: torch.Tensor):
    def build():
        torch.manual_seed(0)
        return model(), (tuple(inputs), {})
    return build


MODELS: dict[str, Callable[[], tuple]] = {
    "sum_loss": _built(SumLoss, _tokens(1), _labels(2)),
    "masked_mean": _built(MaskedMean, _tokens(1), _labels(2), _mask()),
    "kl_batchmean": _built(KLBatchMean, _tokens(1), _labels(2)),
    "pool_bce": _built(PoolBCE, _tokens(1), (torch.rand(BATCH, 6, generator=torch.Generator()
                                                        .manual_seed(3)) > 0.5).float()),
    "last_token": _built(LastToken, _tokens(1), _mask(), torch.tensor([0, 3, 1, 4])),
    "moe_loop": _built(LoopMoE, _tokens(1), _labels(2)),
    "moe_histc": _built(lambda: LoopMoE("histc"), _tokens(1), _labels(2)),
    "batch_norm": _built(ConvBatchNorm, _tokens(1), torch.tensor([0, 3, 1, 4])),
    "shared_layers": _built(SharedLayers, _tokens(1), _labels(2)),
    "set_order": _built(SetOrder, _tokens(1), _labels(2)),
}
