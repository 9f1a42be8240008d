"""Mixed precision executed: ``parallelize(..., precision="bf16")`` computes every matmul in
bf16 through casts the rank program shows, steps fp32 parameters, and trains like
single-device ``torch.autocast`` (``tests/workers/precision.py``)."""

from __future__ import annotations

import pytest

from tests.distributed import FAST, run_cases

pytestmark = pytest.mark.slow

CASES = [
    {"model": "gpt", "dp": 2, "zero": 0, "precision": "bf16"},
    # ZeRO 1-3 keep the fp32 masters in the optimizer (FSDP2's fp32 shards) and compute
    # with 16-bit weights; stage 1 accumulates the microbatches' gradients in fp32
    {"model": "llama", "dp": 2, "zero": 1, "microbatches": 2, "precision": "bf16"},
    {"model": "llama", "dp": 2, "zero": 3, "precision": "bf16", "steps": 5},
    {"model": "llama", "pp": 2, "dp": 1, "microbatches": 2, "precision": "bf16", "steps": 5},
    # tensor parallelism: values are cast before the collectives that move them
    {"model": "llama", "tp": 2, "dp": 1, "precision": "bf16", "steps": 5, "cluster": FAST},
    {"model": "gpt", "tp": 2, "dp": 1, "precision": "bf16", "steps": 5, "cluster": FAST},
    # one 16-bit weight copy a step: a pipeline's measured peak, modelled vs measured
    {"model": "gptwide", "layers": 4, "pp": 2, "dp": 1, "microbatches": 8, "schedule": "1f1b",
     "precision": "bf16", "steps": 1, "memory": True},
    # and ZeRO-2's: 16-bit weights gathered whole, fp32 shards of gradients and masters
    {"model": "gptwide", "layers": 4, "dp": 2, "zero": 2, "microbatches": 4,
     "precision": "bf16", "steps": 1, "memory": True},
]
MEMORY = [i for i, case in enumerate(CASES) if case.get("memory")]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return run_cases(2, tmp_path_factory.mktemp("precision"), CASES, worker="precision.py")


@pytest.mark.parametrize("index", range(len(CASES)))
def test_bf16_tracks_autocast(records, index: int) -> None:
    for rank in records:
        r = rank[index]
        assert r["worst_rel"] <= 1e-2, (r["case"], r["losses"], r["reference"])
        assert r["param_dtypes"] == ["torch.float32"]  # the optimizer steps fp32 masters
        # which the program reads as they are below ZeRO-1, as FSDP2 gathers them (16-bit)
        # from ZeRO-1 on
        assert r["params_word"] == ("bf16" if r["zero"] >= 1 else "fp32"), r["case"]
        assert set(r["matmul_dtypes"]) == {"torch.bfloat16"}, r["matmul_dtypes"]
        assert r["casts"] > 0 and r["bf16_casts"] > 0  # visible in pm.code
        assert len(r["losses"]) == r["case"].get("steps", 20)
        if "tp" in r["case"]:
            assert r["sharded"] > 0  # the layout really splits weights over tp


@pytest.mark.parametrize("index", MEMORY)
def test_bf16_peak_is_as_modelled(records, index: int) -> None:
    """A bf16 step's peak within 10% of its modelled peak, on every rank (every tensor the
    step makes: activations, the step's one 16-bit copy of each fp32 weight or FSDP2's
    gathered 16-bit weights, gradients, temporaries; measured with
    ``autopar.calibrate.live_bytes``): a 1F1B pipeline with 8 microbatches, each stage; and
    ZeRO-2 with the masters in the optimizer. A copy per use, as torch.autocast makes them,
    keeps one per microbatch in flight: the pipeline's first stage, holding two, peaks over
    10% higher."""
    for rank in records:
        m = rank[index]["memory"]
        assert abs(m["measured"] / m["predicted"] - 1) <= 0.10, m
        if m["in_flight"] >= 2:
            assert m["per_use"] >= 1.1 * m["measured"], m
