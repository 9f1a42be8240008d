"""fp16 dynamic loss scaling inside ``train_step`` (``tests/workers/loss_scale.py``): an
overflow on one rank skips the step on every rank, leaves parameters and optimizer state
bit-identical, halves the scale, and training then follows ``torch.amp.GradScaler``'s."""

from __future__ import annotations

import pytest

from tests.distributed import run_cases

pytestmark = pytest.mark.slow

OVERFLOW = 2
CASES = [
    {"tp": 2, "dp": 1, "overflow": OVERFLOW},  # gradients differ per rank (tp shards)
    {"dp": 2, "zero": 3, "overflow": OVERFLOW, "direct": True},  # DTensor shards
]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return run_cases(2, tmp_path_factory.mktemp("loss_scale"), CASES, worker="loss_scale.py")


@pytest.mark.parametrize("index", range(len(CASES)))
def test_overflow_on_one_rank_skips_everywhere(records, index: int) -> None:
    for rank in records:
        r = rank[index]
        steps, ref = r["steps"], r["reference"]
        assert [s["skipped"] for s in steps] == ref["skipped"]
        assert steps[OVERFLOW]["skipped"] and r["skipped_steps"] == 1
        assert steps[OVERFLOW]["unchanged"]  # parameters and optimizer state, bit for bit
        assert steps[OVERFLOW]["ran"] in (False, None)
        assert all(not s["unchanged"] for i, s in enumerate(steps) if i != OVERFLOW)
        assert [s["scale"] for s in steps] == ref["scales"]  # halved, then grown
        assert steps[OVERFLOW]["scale"] == steps[OVERFLOW - 1]["scale"] / 2
        for got, want in zip([s["loss"] for s in steps], ref["losses"]):
            assert got == pytest.approx(want, rel=1e-3)
