"""The chunked cross-entropy is torch's cross-entropy, in value and gradient, and keeps one
log-sum-exp a token instead of the [tokens, vocab] log-softmax."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import autopar.ops.loss_ops as loss_ops
from autopar.ops.loss_ops import chunked_cross_entropy

CASES = list(itertools.product(("mean", "sum", "none"), (0.0, 0.1), (False, True)))


@pytest.mark.parametrize("reduction,smoothing,weighted", CASES)
def test_chunked_cross_entropy_equals_torch(monkeypatch, reduction, smoothing, weighted):
    monkeypatch.setattr(loss_ops, "CHUNK_ELEMENTS", 40)  # 3 tokens a block: many blocks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(17, 13, generator=g, dtype=torch.float64)
    target = torch.randint(0, 13, (17,), generator=g)
    target[[0, 5, 16]] = -100
    weight = torch.rand(13, generator=g, dtype=torch.float64) if weighted else None
    upstream = torch.randn(17 if reduction == "none" else (), generator=g, dtype=torch.float64)
    results = []
    for fn in (chunked_cross_entropy, F.cross_entropy):
        logits = x.clone().requires_grad_()
        loss = fn(logits, target, weight=weight, reduction=reduction,
                  label_smoothing=smoothing)
        (loss * upstream).sum().backward()
        results.append((loss.double(), logits.grad))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-6)


def test_bf16_logits_get_a_bf16_gradient_and_an_fp32_loss():
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 32, (8,))
    loss = chunked_cross_entropy(x, t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(x.float(), t), rtol=1e-5, atol=1e-5)
    loss.backward()
    assert x.grad.dtype == torch.bfloat16


def test_no_tokens_by_vocab_float_buffer_is_kept(monkeypatch):
    monkeypatch.setattr(loss_ops, "CHUNK_ELEMENTS", 1024)
    x = torch.randn(256, 512, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 512, (256,))
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: kept.append(s) or s, lambda s: s):
        chunked_cross_entropy(x, t)
    big = [s for s in kept if s.numel() >= x.numel() and s.data_ptr() != x.data_ptr()]
    assert not big, f"kept {[(tuple(s.shape), s.dtype) for s in big]} beside the logits"


def test_unsupported_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"\(2, 3, 5\).*class indices"):
        chunked_cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction 'avg'"):
        chunked_cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long),
                              reduction="avg")


LLAMA = "llama:layers=1,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"


def _emitted(capsys, *extra: str) -> str:
    from autopar.cli.main import main

    assert main(["emit", LLAMA, "--cluster", "2xcpu", "--dp", "2", "--global-batch", "2",
                 *extra]) == 0
    return capsys.readouterr().out


def test_the_program_computes_the_loss_chunked_reading_the_logits_before_the_fp32_cast(capsys):
    """Hugging Face casts the logits to fp32 before its loss; the program's loss reads them
    before the cast (and upcasts a block at a time), so no fp32 [tokens, vocab] copy takes
    part in backward. The cast itself stays: the model returns its fp32 logits."""
    text = _emitted(capsys)
    loss_line = next(line for line in text.splitlines() if "chunked_cross_entropy(" in line)
    logits = loss_line.split("chunked_cross_entropy(")[1].split(",")[0]
    producer = next(line for line in text.splitlines() if line.strip().startswith(f"{logits} ="))
    assert "reshape" in producer and "linear" in producer, producer
    assert "aten.cross_entropy_loss" not in text


def test_no_chunked_loss_keeps_torchs_cross_entropy(capsys):
    text = _emitted(capsys, "--no-chunked-loss")
    assert "aten.cross_entropy_loss" in text and "chunked_cross_entropy" not in text


VOCAB_PARALLEL_CASES = [{"reduction": r, "label_smoothing": e}
                        for r in ("mean", "sum", "none") for e in (0.0, 0.1)]


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_equals_one_device(tmp_path) -> None:
    """Logits split by class over 2 gloo ranks: each rank's loss is the whole loss, and its
    gradient slice the same slice of the whole gradient."""
    from tests.distributed import run_cases

    results = run_cases(2, tmp_path, VOCAB_PARALLEL_CASES, worker="vocab_parallel_loss.py",
                        timeout=300)
    assert len(results) == 2 and all(len(r) == len(VOCAB_PARALLEL_CASES) for r in results)
    for rank in results:
        for record in rank:
            assert record["ok"], record


_NO_KERNEL = {"slice", "unsqueeze", "squeeze", "expand", "view", "detach", "t", "alias"}


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Ops that launch a kernel, ``logsumexp`` counted as the kernels it launches."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in _NO_KERNEL:
            self.count += loss_ops.LOGSUMEXP_KERNELS if name == "logsumexp" else 1
        return func(*args, **(kwargs or {}))


def _kernels(blocks: int, dtype: torch.dtype, smoothing: float) -> tuple[int, int]:
    logits = torch.randn(4 * blocks, 16, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 16, (4 * blocks,), generator=torch.Generator().manual_seed(0))
    with _Kernels() as forward:
        loss = chunked_cross_entropy(logits, target, label_smoothing=smoothing)
    with _Kernels() as backward:
        loss.backward()
    return forward.count, backward.count


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_plan_prices_the_kernels_each_block_launches(monkeypatch, dtype, smoothing):
    """block_passes (what the plan's step time charges per block) follows the code: the
    kernels one more block of tokens adds, in forward and in backward."""
    monkeypatch.setattr(loss_ops, "CHUNK_ELEMENTS", 64)  # 4 tokens of 16 classes a block
    (f2, b2), (f5, b5) = _kernels(2, dtype, smoothing), _kernels(5, dtype, smoothing)
    passes = loss_ops.block_passes(torch.finfo(dtype).bits // 8, smoothing > 0)
    assert ((f5 - f2) / 3, (b5 - b2) / 3) == (passes.forward_kernels, passes.backward_kernels)
