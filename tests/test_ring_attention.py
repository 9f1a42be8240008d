"""Ring attention (context parallelism's attention) over 2, 4 and 8 simulated ranks equals
the unsharded generated kernel: outputs, log-sum-exp and dQ/dK/dV, in fp32 under Triton's
interpreter, for causal and non-causal masks, GQA and sliding windows, with contiguous and
zigzag sharding."""

import pytest
import torch

from autopar.kernels import attention, shard_pieces, simulate_ring_attention

pytest.importorskip("triton")

TOL = 1e-5
SEQ = 32

CASES = {  # name: (query heads, kv heads, mask options)
    "full": (2, 2, {}),
    "causal": (2, 2, {"causal": True}),
    "causal_gqa": (4, 1, {"causal": True}),
    "sliding_window": (2, 1, {"causal": True, "window": (5, 0)}),
    "two_sided_window": (2, 2, {"window": (4, 3)}),
    "alibi_causal": (2, 2, {"causal": True, "alibi": True}),
}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(fn, q, k, v, do, dl, **kw):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*xs, **kw)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    ((out * do).sum() + (finite * dl).sum()).backward()
    return [out, finite] + [x.grad for x in xs]


# Every property at every shard count, the rest at 4 (the interpreter is slow). Zigzag
# balances causal work; without a causal mask it would change nothing.
PARAMS = [(case, cp, zigzag) for cp in (2, 4, 8) for case, zigzag in (
    ("full", False), ("causal_gqa", True), ("sliding_window", False),
    ("two_sided_window", False))]
PARAMS += [("causal", 4, False), ("causal", 4, True), ("alibi_causal", 4, True),
           ("sliding_window", 4, True)]


@pytest.mark.parametrize(("case", "cp", "zigzag"), PARAMS)
def test_ring_equals_the_unsharded_kernel(case, cp, zigzag):
    heads, kv_heads, opts = CASES[case]
    opts = dict(opts)
    g = torch.Generator().manual_seed(cp * 10 + zigzag)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(heads, generator=g) * 0.5
    q = torch.randn(1, heads, SEQ, 16, generator=g)
    k, v = (torch.randn(1, kv_heads, SEQ, 16, generator=g) for _ in range(2))
    do, dl = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)

    def whole(q, k, v, **kw):
        return attention(q, k, v, return_lse=True, **kw)

    def ring(q, k, v, **kw):
        return simulate_ring_attention(q, k, v, cp=cp, zigzag=zigzag, **kw)

    expected = _run(whole, q, k, v, do, dl, **opts)
    got = _run(ring, q, k, v, do, dl, **opts)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert (a - b).abs().max().item() <= TOL, f"{name} differs"


def test_zigzag_gives_every_rank_the_same_causal_work():
    """Rank i holds chunks i and 2cp-1-i: the keys its queries see add up alike."""
    cp, seq = 4, 64

    def visible(pieces):  # (query, key) pairs a causal mask keeps
        return sum(s + i + 1 for s, n in pieces for i in range(n))

    work = {visible(shard_pieces(seq, cp, r, zigzag=True)) for r in range(cp)}
    plain = [visible(shard_pieces(seq, cp, r)) for r in range(cp)]
    assert len(work) == 1 and plain[-1] > 3 * plain[0]


@pytest.mark.parametrize(("seq", "zigzag", "needed"), [(10, False, "4"), (12, True, "8")])
def test_a_sequence_that_does_not_split_is_refused(seq, zigzag, needed):
    x = torch.randn(1, 1, seq, 8)
    with pytest.raises(ValueError, match=f"divisible by {needed}"):
        simulate_ring_attention(x, x, x, cp=4, zigzag=zigzag, causal=True)


@pytest.mark.parametrize("case", ["sliding_window", "two_sided_window", "causal_gqa"])
def test_the_sdpa_fallback_ring_matches_too(case, monkeypatch):
    """Without Triton's interpreter a CPU call runs SDPA with a mask; a block in which some
    queries see no key must not turn their gradients into NaN when merged."""
    monkeypatch.delenv("TRITON_INTERPRET")
    heads, kv_heads, opts = CASES[case]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, heads, SEQ, 16, generator=g)
    k, v = (torch.randn(1, kv_heads, SEQ, 16, generator=g) for _ in range(2))
    do, dl = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)
    expected = _run(lambda *x, **kw: attention(*x, return_lse=True, **kw), q, k, v, do, dl,
                    **opts)
    got = _run(lambda *x, **kw: simulate_ring_attention(*x, cp=4, zigzag=True, **kw),
               q, k, v, do, dl, **opts)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert (a - b).abs().max().item() <= TOL, f"{name} differs"
