"""The generated attention kernels against the fp64 reference, run by Triton's interpreter.

Sizes are tiny (the interpreter runs each program in numpy) but every length is ragged with
respect to the interpreter's 32-wide blocks, so masking and multi-block loops are exercised.
fp32 must match the fp64 reference within 1e-4; fp16/bf16 must be within twice the error of
the same math done eagerly by PyTorch in that dtype (FlashAttention's criterion).
"""

import pytest
import torch

from autopar.kernels import (
    attention,
    backend_for,
    dropout_keep_mask,
    merge_partials,
    reference_attention,
)

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Triton's interpreter for these tests only (the kernels read the variable when they are
    built and launched, so it must not leak into other tests or the processes they start)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

FP32_TOL = 1e-4


def _inputs(b, h, kvh, m, n, d, *, seed=0, bias_shape=None, bias_grad=True, alibi=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, m, d, generator=g)
    k = torch.randn(b, kvh, n, d, generator=g)
    v = torch.randn(b, kvh, n, d, generator=g)
    do = torch.randn(b, h, m, d, generator=g)
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g)
    slopes = None
    if alibi == "head":
        slopes = torch.rand(h, generator=g) * 0.5
    elif alibi == "batch_head":
        slopes = torch.rand(b, h, generator=g) * 0.5
    return q, k, v, do, bias, slopes


def _run(fn, dtype, q, k, v, do, bias, slopes, bias_grad, **kw):
    """Output, lse and gradients of fn on inputs cast to dtype, all returned as fp64."""
    xs = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().to(dtype, copy=True).requires_grad_(bias_grad)
    out, lse = fn(*xs, bias=b, alibi_slopes=slopes, return_lse=True, **kw)
    (out.to(torch.float64) * do.to(torch.float64)).sum().backward()
    grads = [x.grad for x in xs] + ([b.grad] if b is not None and bias_grad else [])
    return [out.double(), lse.double()] + [g.double() for g in grads]


def _finite(t):
    return torch.where(torch.isinf(t), torch.zeros_like(t), t)


def _max_err(a, b):
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "-inf (empty rows) differ"
    return (_finite(a) - _finite(b)).abs().max().item()


NAMES = ["out", "lse", "dq", "dk", "dv", "dbias"]

# (b, h, kv_heads, q_len, k_len, head_dim, options): each feature alone, then the
# combinations that share code paths (causal x GQA x odd head dim x ragged x dropout x bias).
FP32_CASES = {
    "plain": (2, 2, 2, 48, 48, 64, {}),
    "causal_ragged": (1, 2, 2, 37, 37, 32, {"causal": True}),
    "causal_q_ne_k_top_left": (1, 2, 2, 37, 53, 32, {"causal": True}),
    "causal_bottom_right": (1, 2, 2, 21, 53, 32, {"causal": True, "q_offset": 32}),
    "gqa_causal_d80": (1, 4, 2, 37, 45, 80, {"causal": True}),
    "mqa_d96": (2, 4, 1, 33, 40, 96, {}),
    "gqa_causal_d112": (1, 4, 2, 35, 35, 112, {"causal": True}),
    "head_dim_8": (1, 2, 2, 40, 33, 8, {"causal": True}),
    "window": (1, 2, 2, 50, 45, 32, {"window": (8, 4)}),
    "window_causal": (1, 2, 1, 50, 50, 32, {"window": (8, 0), "causal": True}),
    "window_right_only": (1, 2, 2, 40, 40, 16, {"window": (-1, 5)}),
    "scale": (1, 2, 2, 40, 40, 32, {"scale": 0.3}),
    "bias_full_grad_causal": (2, 2, 2, 37, 45, 32, {"causal": True, "bias": (2, 2, 37, 45)}),
    "bias_bcast_grad_gqa": (2, 4, 2, 37, 45, 24, {"bias": (1, 4, 1, 45)}),
    "bias_2d_grad_window": (1, 2, 2, 40, 40, 32, {"bias": (40, 40), "window": (6, 6)}),
    "bias_no_grad": (1, 2, 2, 40, 40, 32, {"bias": (1, 1, 40, 40), "bias_grad": False}),
    "alibi_causal": (1, 2, 2, 37, 45, 32, {"causal": True, "alibi": "head"}),
    "alibi_batch_gqa": (2, 4, 1, 37, 45, 40, {"alibi": "batch_head"}),
    "alibi_and_bias": (1, 2, 2, 33, 33, 32, {"alibi": "head", "bias": (1, 2, 33, 33)}),
    "dropout": (2, 2, 2, 37, 45, 32, {"dropout_p": 0.25, "seed": 1234}),
    "dropout_causal_gqa_d80": (1, 4, 2, 37, 45, 80, {"dropout_p": 0.3, "seed": 7, "causal": True}),
    "dropout_bias_window_64bit_seed": (
        1, 2, 2, 40, 40, 32,
        {"dropout_p": 0.1, "seed": 2**40 + 3, "bias": (1, 2, 40, 40), "window": (10, 3)}),
    # soft-capping (Gemma-2): caps small enough that tanh bends the scores
    "softcap": (1, 2, 2, 37, 45, 32, {"softcap": 1.0, "scale": 1.0}),
    "softcap_bias_grad_causal_gqa": (
        2, 4, 2, 37, 45, 24, {"softcap": 2.0, "scale": 0.5, "causal": True, "bias": (2, 4, 37, 45)}),
    "softcap_dropout_window": (
        1, 2, 1, 40, 40, 32, {"softcap": 1.5, "scale": 0.8, "dropout_p": 0.2, "seed": 5,
                              "window": (9, 2)}),
}


def _case(name, dtype):
    b, h, kvh, m, n, d, opts = FP32_CASES[name]
    opts = dict(opts)
    bias_shape = opts.pop("bias", None)
    bias_grad = opts.pop("bias_grad", True)
    alibi = opts.pop("alibi", None)
    q, k, v, do, bias, slopes = _inputs(b, h, kvh, m, n, d, bias_shape=bias_shape, alibi=alibi,
                                        seed=len(name))
    args = (q, k, v, do, bias, slopes, bias_grad)
    ours = _run(attention, dtype, *args, **opts)
    ref = _run(reference_attention, torch.float64, *args, **opts)
    return ours, ref, args, opts


def test_backend_is_the_interpreter():
    assert backend_for(torch.zeros(1)) == "interpreter"


@pytest.mark.parametrize("name", list(FP32_CASES))
def test_fp32_matches_fp64_reference(name):
    ours, ref, _, _ = _case(name, torch.float32)
    for what, a, r in zip(NAMES, ours, ref):
        assert _max_err(a, r) < FP32_TOL, f"{name}: {what} error {_max_err(a, r):.2e}"


LOWP_CASES = ["gqa_causal_d80", "bias_full_grad_causal", "alibi_causal",
              "dropout_causal_gqa_d80", "window", "softcap_bias_grad_causal_gqa"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", LOWP_CASES)
def test_low_precision_within_twice_eager_error(name, dtype):
    ours, ref, args, opts = _case(name, dtype)
    eager = _run(reference_attention, dtype, *args, **opts)
    eps = 1e-3 if dtype == torch.float16 else 8e-3
    for what, a, e, r in zip(NAMES, ours, eager, ref):
        if what == "lse":  # the kernels' lse is fp32 whatever the inputs: compare it as such
            assert _max_err(a, r) < 1e-2
            continue
        ours_err, eager_err = _max_err(a, r), _max_err(e, r)
        assert ours_err <= 2 * eager_err + eps, (
            f"{name} {dtype}: {what} error {ours_err:.2e} vs eager {eager_err:.2e}")


BOUND_MASKS = {
    "causal": {"causal": True},
    "causal_window": {"causal": True, "window": (5, 0)},
    "window": {"window": (3, 7)},
    "right_only": {"window": (-1, 2)},
    "left_only": {"window": (9, -1)},
}


def _edge_offsets(opts):
    """q_offsets one either side of where a window edge meets a block edge (blocks of 32)."""
    left, right = opts.get("window", (-1, -1))
    if opts.get("causal"):
        right = 0
    edges = ([-right] if right >= 0 else []) + ([left] if left >= 0 else [])
    return sorted({-31, 33} | {e + d for e in edges for d in (-1, 0, 1)})


@pytest.mark.parametrize("mask,q_offset", [(m, o) for m, opts in BOUND_MASKS.items()
                                           for o in _edge_offsets(opts)])
def test_block_skipping_bounds(mask, q_offset):
    # The key/query block ranges each kernel loops over are rounded to whole blocks, which
    # hides most off-by-one errors; these offsets put a window edge right at a block edge.
    opts = BOUND_MASKS[mask]
    q, k, v, do, _, _ = _inputs(1, 1, 1, 45, 70, 16, seed=q_offset + 100)
    ours = _run(attention, torch.float32, q, k, v, do, None, None, False, q_offset=q_offset, **opts)
    ref = _run(reference_attention, torch.float64, q, k, v, do, None, None, False,
               q_offset=q_offset, **opts)
    for what, a, r in zip(NAMES, ours, ref):
        assert _max_err(a, r) < FP32_TOL, what


def test_rows_that_see_no_key_give_zero_and_neg_inf_lse():
    # window (2, 0) top-left with q_len > k_len: queries 12.. see nothing; q_offset -5 too
    for opts in ({"window": (2, 0), "causal": True}, {"causal": True, "q_offset": -5}):
        q, k, v, do, _, _ = _inputs(1, 2, 2, 40, 10, 16)
        ours = _run(attention, torch.float32, q, k, v, do, None, None, False, **opts)
        ref = _run(reference_attention, torch.float64, q, k, v, do, None, None, False, **opts)
        assert torch.isneginf(ours[1]).any()
        assert all(torch.isfinite(t).all() for t in ours[2:])
        for what, a, r in zip(NAMES, ours, ref):
            assert _max_err(a, r) < FP32_TOL, f"{opts}: {what}"
        assert ours[0][torch.isneginf(ours[1])].abs().max() == 0


def test_bool_mask_and_non_contiguous_inputs():
    b, s, h, d = 2, 37, 2, 32
    x = torch.randn(3, b, s, h, d)
    q, k, v = (t.transpose(1, 2) for t in x)  # (b, h, s, d) views with SDPA's usual strides
    assert not q.is_contiguous()
    mask = torch.rand(b, 1, s, s) > 0.3
    mask[..., 0] = True
    out = attention(q, k, v, bias=mask)
    ref = reference_attention(q.double(), k.double(), v.double(), bias=mask)
    assert (out.double() - ref).abs().max() < FP32_TOL


def test_dropout_kernels_use_the_reference_mask_forward_and_backward():
    # Equal scores make P uniform; v = identity then reads the forward mask out of the
    # output, and dO = identity reads the backward (dK/dV kernel) mask out of dV.
    b, h, n, p, seed = 2, 2, 32, 0.3, 99
    q = torch.zeros(b, h, n, n, requires_grad=True)
    k = torch.zeros(b, h, n, n)
    v = torch.eye(n).expand(b, h, n, n).clone().requires_grad_()
    out = attention(q, k, v, dropout_p=p, seed=seed)
    out.backward(torch.eye(n).expand(b, h, n, n))
    keep = dropout_keep_mask(seed, b, h, n, n, p)
    assert torch.equal(out > 0, keep)
    assert torch.allclose(out[keep], torch.full_like(out[keep], 1 / (n * (1 - p))))
    assert torch.equal(v.grad > 0, keep.transpose(-1, -2))
    # same seed, same output; another seed, another mask; None draws from torch's generator
    assert torch.equal(attention(q, k, v, dropout_p=p, seed=seed), out)
    assert not torch.equal(attention(q, k, v, dropout_p=p, seed=seed + 1), out)
    torch.manual_seed(5)
    first = attention(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    assert torch.equal(attention(q, k, v, dropout_p=p), first)


def test_reference_dropout_mask_keeps_one_minus_p():
    keep = dropout_keep_mask(3, 2, 4, 64, 64, 0.2)
    assert abs(keep.float().mean().item() - 0.8) < 0.01
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_merging_two_halves_of_the_keys_is_full_attention(causal):
    b, h, kvh, m, n, d = 1, 4, 2, 40, 40, 32
    q, k, v, do, _, _ = _inputs(b, h, kvh, m, n, d, seed=11)
    split = 17
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    full, full_lse = attention(*xs, causal=causal, return_lse=True)
    full.backward(do)
    full_grads = [x.grad for x in xs]

    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = ys
    o1, l1 = attention(qq, kk[:, :, :split], vv[:, :, :split], causal=causal, return_lse=True)
    # the second half's keys start at position `split`: queries sit `split` earlier
    o2, l2 = attention(qq, kk[:, :, split:], vv[:, :, split:], causal=causal, return_lse=True,
                       q_offset=-split)
    out, lse = merge_partials(o1, l1, o2, l2)
    assert (out - full).abs().max() < 1e-5
    assert (lse - full_lse).abs().max() < 1e-5
    out.backward(do)  # gradients flow through both partial lse's into the kernels
    for g, fg in zip((y.grad for y in ys), full_grads):
        assert (g - fg).abs().max() < FP32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("d", [128, 256])
def test_large_head_dims(d):
    q, k, v, do, bias, _ = _inputs(1, 2, 1, 24, 40, d, bias_shape=(1, 2, 24, 40))
    opts = {"causal": True, "dropout_p": 0.2, "seed": 1, "q_offset": 16}
    ours = _run(attention, torch.float32, q, k, v, do, bias, None, True, **opts)
    ref = _run(reference_attention, torch.float64, q, k, v, do, bias, None, True, **opts)
    for what, a, r in zip(NAMES, ours, ref):
        assert _max_err(a, r) < FP32_TOL, what
