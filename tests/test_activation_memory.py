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


def _kept(layers: int, mode: str) -> tuple[float, float]:
    """(modelled, measured) bytes alive after forward beyond the weights."""
    from autopar.models import resolve_model

    spec = resolve_model(SPEC.format(layers=layers))
    torch.manual_seed(0)
    a, k = spec.example_inputs(1, SEQ, "cpu")
    pm = autopar.parallelize(spec.build(), "1xcpu", (a, k), recompute=(mode,), precision="fp32")
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
