"""What a layer keeps for backward under each recomputation mode, modelled vs measured.

Measured with ``autopar.calibrate.live_bytes`` (the bytes of every storage the forward made
that are still alive when it returns) on an HF Llama at two depths: the difference is one
layer's, free of the embedding, the head and the loss. On an H100 at Llama 3 8B's sizes the
per-op policy kept 2.2x what the model said, and full recomputation each layer's input
that it did not count (benchmarks/results/h100_2026-11-26_layers.md); these pin the fix.
"""

from __future__ import annotations

import gc

import pytest
import torch

import autopar
from autopar.calibrate.live_bytes import LiveBytes
from autopar.runtime.parallel_module import find_loss

pytest.importorskip("transformers")

SEQ = 256
SPEC = ("llama:layers={layers},hidden=128,heads=4,kv_heads=2,ffn=448,vocab=512,seq=256,"
        "batch=1,rope_theta=500000")


def _kept(layers: int, mode: str, precision: str = "fp32",
          cluster: str = "1xcpu") -> tuple[float, float]:
    """(modelled, measured) bytes alive after forward beyond the weights."""
    from autopar.models import resolve_model

    spec = resolve_model(SPEC.format(layers=layers))
    torch.manual_seed(0)
    a, k = spec.example_inputs(1, SEQ, "cpu")
    pm = autopar.parallelize(spec.build(), cluster, (a, k), recompute=(mode,),
                            precision=precision)
    la, lk = pm.shard_batch(*a, **k)
    gc.collect()
    with LiveBytes() as live:
        loss = find_loss(pm(*la, **lk))
        kept = live.live
        loss.backward()
    predicted = pm.plan.predicted
    states = predicted["memory"]["params"] + predicted["memory"]["optimizer"]
    return predicted["memory_phases"]["forward_end"] - states, kept


@pytest.fixture(scope="module")
def per_layer() -> dict[str, tuple[float, float]]:
    out = {}
    for mode in ("none", "op", "full", "selective"):
        (p2, m2), (p4, m4) = _kept(2, mode), _kept(4, mode)
        out[mode] = ((p4 - p2) / 2, (m4 - m2) / 2)
    return out


@pytest.mark.parametrize("mode", ["op", "full"])
def test_checkpointed_layers_keep_what_the_model_says(per_layer, mode) -> None:
    """Full recomputation keeps each layer's input (the checkpoint holds its arguments);
    the per-op policy also the outputs it caches, whether or not backward reads them."""
    modelled, measured = per_layer[mode]
    assert measured > 0
    assert modelled == pytest.approx(measured, rel=0.05), (modelled, measured)


def test_no_recomputation_is_modelled_within_fifteen_percent(per_layer) -> None:
    modelled, measured = per_layer["none"]
    assert modelled == pytest.approx(measured, rel=0.15), (modelled, measured)


def test_selective_with_fused_attention_keeps_what_no_recomputation_keeps(per_layer) -> None:
    """Nothing is sequence-squared once attention is fused, so the layer is not
    checkpointed (a checkpoint would cache every other output: more, not less)."""
    assert per_layer["selective"][1] == per_layer["none"][1]
    assert per_layer["selective"][0] == pytest.approx(per_layer["none"][0])


FP8_CPU = """name: cpu-with-fp8
nodes: 1
devices_per_node: 1
device:
  preset: cpu
  peak_tflops: {fp32: 0.1, bf16: 0.1, fp8: 0.2}
"""
"""A CPU said to have fp8 matmuls: autopar's fp8 linears run emulated there, saving the
same one-byte copies they save on a GPU (``autopar.ops.fp8_ops``)."""


def test_fp8_layers_keep_their_fp8_copies(tmp_path) -> None:
    """An fp8 linear keeps fp8 copies of its input and weight, not the bf16 tensors it
    read, and linears reading one input share its copy: a layer keeps less than in bf16,
    and the model says how much (it priced the bf16 tensors, 29% over, before it counted
    the copies)."""
    cluster = tmp_path / "cpu-fp8.yaml"
    cluster.write_text(FP8_CPU, encoding="utf-8")
    (p2, m2), (p4, m4) = (_kept(n, "none", "fp8", str(cluster)) for n in (2, 4))
    (_, b2), (_, b4) = (_kept(n, "none", "bf16") for n in (2, 4))
    modelled, measured = (p4 - p2) / 2, (m4 - m2) / 2
    assert 0 < measured < (b4 - b2) / 2
    assert modelled == pytest.approx(measured, rel=0.10), (modelled, measured)


def test_fp8_linears_reading_one_input_share_its_copy() -> None:
    """q, k and v projections of one input quantize it once (and equal numbers come out);
    a write to the input between them makes a fresh copy."""
    from autopar.ops.fp8_ops import fp8_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=g, requires_grad=True)
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    h = x * 1.0
    a, b = fp8_linear(h, w1), fp8_linear(h, w2)
    assert a.grad_fn.saved_tensors[0] is b.grad_fn.saved_tensors[0]
    assert torch.equal(b, fp8_linear(x * 1.0, w2))  # shared or not, the same result
    with torch.no_grad():
        h.mul_(2.0)
    c = fp8_linear(h, w1)
    assert c.grad_fn.saved_tensors[0] is not a.grad_fn.saved_tensors[0]
    assert torch.allclose(c.float(), 2 * a.float(), rtol=0.1, atol=0.1)


def test_fp8_weight_copy_is_shared_by_the_microbatches_of_a_step() -> None:
    """Inside a training step each weight is quantized once (Transformer Engine's caching):
    a pipeline's microbatches in flight keep one fp8 copy, not one each. Outside a step,
    or once the weight is written, it is quantized again."""
    from autopar.ops.fp8_ops import fp8_linear
    from autopar.ops.step_copies import one_weight_copy_per_step

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g, requires_grad=True)
    x1, x2 = (torch.randn(8, 32, generator=g) for _ in range(2))
    with one_weight_copy_per_step():
        a, b = fp8_linear(x1, w), fp8_linear(x2, w)
        assert a.grad_fn.saved_tensors[2] is b.grad_fn.saved_tensors[2]
        with torch.no_grad():
            w.mul_(2.0)
        c = fp8_linear(x1, w)
        assert c.grad_fn.saved_tensors[2] is not a.grad_fn.saved_tensors[2]
        assert torch.allclose(c.float(), 2 * a.float(), rtol=0.1, atol=0.1)
    d, e = fp8_linear(x1, w), fp8_linear(x2, w)
    assert d.grad_fn.saved_tensors[2] is not e.grad_fn.saved_tensors[2]


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_16bit_weight_copy_is_made_once_per_step_and_gradients_are_unchanged(recompute) -> None:
    """Inside a step a weight is cast to bf16 once: microbatches in flight (forwards before
    backwards, as a pipeline runs them) and recomputations share one copy, and every
    gradient is the one per-use casts give."""
    from torch.utils.checkpoint import checkpoint

    from autopar.ops.step_copies import cast_weight, one_weight_copy_per_step
    from autopar.passes.checkpoint_layers import selective_context

    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(32, 16, generator=g, requires_grad=True)
    w2 = torch.randn(16, 32, generator=g, requires_grad=True)
    xs = [torch.randn(4, 8, 16, generator=g).bfloat16() for _ in range(3)]

    def layer(x):
        h = torch.nn.functional.linear(x, cast_weight(w1, torch.bfloat16))
        s = (h @ h.transpose(1, 2)).softmax(-1) @ h  # a seq x seq tensor to recompute
        return torch.nn.functional.linear(s.relu(), cast_weight(w2, torch.bfloat16))

    def run(x):
        if recompute == "none":
            return layer(x)
        extra = {"context_fn": lambda: selective_context(8)} if recompute == "selective" else {}
        return checkpoint(layer, x, use_reentrant=False, **extra)

    def grads(shared: bool) -> list[torch.Tensor]:
        w1.grad = w2.grad = None
        if shared:
            with one_weight_copy_per_step(reads=len(xs)):
                losses = [run(x).float().square().mean() for x in xs]  # all in flight
                assert len(one_weight_copy_per_step.casts) == 2
                for loss in losses:
                    loss.backward()
            assert not one_weight_copy_per_step.casts  # dropped with the step
        else:
            for x in xs:
                run(x).float().square().mean().backward()
        return [w1.grad.clone(), w2.grad.clone()]

    for got, want in zip(grads(True), grads(False)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    with one_weight_copy_per_step(reads=3):
        a = cast_weight(w1, torch.bfloat16)
        assert storage(cast_weight(w1, torch.bfloat16)) == storage(a)
        with torch.no_grad():
            w1.mul_(2.0)  # written: cast again
        b = cast_weight(w1, torch.bfloat16)
        assert storage(b) != storage(a)
        torch.testing.assert_close(b.float(), 2 * a.float(), rtol=1e-2, atol=1e-2)
    with one_weight_copy_per_step(reads=1):  # after its last forward read only its users
        a = cast_weight(w1, torch.bfloat16)   # keep the copy: it goes with them
        entry = one_weight_copy_per_step.casts[(id(w1), torch.bfloat16)]
        assert entry[2] is None and entry[3]() is not None
        del a
        assert entry[3]() is None
