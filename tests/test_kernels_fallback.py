"""Without CUDA and without Triton's interpreter, `autopar.kernels.attention` runs through
PyTorch SDPA with an explicit mask: same conventions, same results as the reference."""

from __future__ import annotations

import logging

import pytest
import torch

from autopar.kernels import (
    AttentionSpec,
    attention,
    backend_for,
    kernel_source,
    reference_attention,
)


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "causal_bottom_right": {"causal": True, "q_offset": 8},
    "window": {"window": (4, 2)},
    "bias": {"bias": True},
    "alibi_causal": {"alibi": True, "causal": True},
    "softcap_bias_causal": {"softcap": 1.5, "bias": True, "causal": True},
}


@pytest.mark.parametrize("name", list(CASES))
def test_fallback_matches_the_reference(name: str) -> None:
    opts = dict(CASES[name])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 21, 16, generator=g, dtype=torch.float64)  # GQA, q_len != k_len
    v = torch.randn(2, 2, 21, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(1, 4, 13, 21, generator=g, dtype=torch.float64) if opts.pop("bias", 0) else None
    slopes = torch.rand(4, generator=g, dtype=torch.float64) if opts.pop("alibi", 0) else None
    assert backend_for(q.float()) == "sdpa"
    results = []
    for fn, dtype in ((attention, torch.float32), (reference_attention, torch.float64)):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        extra = {"bias": None if bias is None else bias.to(dtype),
                 "alibi_slopes": None if slopes is None else slopes.to(dtype)}
        out, lse = fn(*xs, return_lse=True, **extra, **opts)
        # ring attention differentiates through lse too
        lse_weight = torch.linspace(-1, 1, lse.numel(), dtype=lse.dtype).view(lse.shape)
        (out.sum() + (lse.masked_fill(torch.isneginf(lse), 0) * lse_weight).sum()).backward()
        results.append([out, lse, *(x.grad for x in xs)])
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_fallback_lse_does_not_keep_the_scores(causal: bool) -> None:
    """Autograd keeps what the kernels keep (q, k, v, out, lse), never a (q_len, k_len)
    score matrix per head: that is what the memory model prices for a context-parallel
    block, and what a long sequence cannot afford."""
    q, k, v = (torch.randn(1, 4, 256, 16, requires_grad=True) for _ in range(3))
    saved: list[int] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert max(saved) < 256 * 256, f"a tensor of {max(saved)} elements is kept for backward"
    (out.sum() + lse.sum()).backward()
    assert q.grad is not None and k.grad is not None


def test_fallback_is_logged_once(caplog) -> None:
    import autopar.kernels.api as api

    api._fallback_logged = False
    q = torch.randn(1, 2, 5, 8)
    with caplog.at_level(logging.INFO, logger="autopar.kernels.api"):
        attention(q, q, q)
        attention(q, q, q)
    messages = [r.getMessage() for r in caplog.records if "SDPA" in r.getMessage()]
    assert len(messages) == 1 and "TRITON_INTERPRET" in messages[0]


def test_bad_arguments_are_all_listed() -> None:
    q = torch.randn(1, 3, 5, 8)
    k = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError) as info:
        attention(q, k, k, bias=torch.randn(7, 7))
    text = str(info.value)
    assert "head dims differ" in text and "multiple of kv heads" in text and "bias" in text


def test_generated_source_is_printable_and_specialized() -> None:
    pytest.importorskip("triton")
    causal = kernel_source(AttentionSpec(head_dim=80, causal=True, group_size=2), interpret=False)
    plain = kernel_source(AttentionSpec(head_dim=64), interpret=False)
    assert "def _attn_fwd" in causal and "def _attn_bwd_dkdv" in causal and "def _attn_bwd_dq" in causal
    assert causal != plain
    assert "tl.atomic" not in causal  # deterministic backward: no atomics
    compile(causal, "<generated>", "exec")  # valid Python
