"""Context-parallel attention on 2 and 4 gloo processes equals one device, outputs, lse and
dQ/dK/dV: the all-gather K/V and ring algorithms, contiguous and zigzag shards, causal, GQA
and a sliding window (all-gather)."""

from pathlib import Path

import pytest

from tests.distributed import run_cases

CASES = [{"causal": False}, {"causal": True}, {"causal": True, "zigzag": True},
         {"causal": True, "zigzag": True, "kv_heads": 1},
         {"causal": True, "window": [5, 0], "kv_heads": 2},
         {"algorithm": "ring", "causal": False},
         {"algorithm": "ring", "causal": True, "zigzag": True, "kv_heads": 2}]
RING_CASES = [{"algorithm": "ring", "causal": True, "zigzag": True, "kv_heads": 2},
              {"algorithm": "ring", "causal": True}]


def _assert_all_equal_one_device(ranks: int, tmp_path: Path, cases: list[dict]) -> None:
    results = run_cases(ranks, tmp_path, cases, worker="context_attention.py", timeout=300)
    assert len(results) == ranks and all(len(r) == len(cases) for r in results)
    for rank in results:
        for record in rank:
            assert record["ok"], record


@pytest.mark.slow
def test_all_gather_kv_attention_equals_one_device(tmp_path: Path) -> None:
    _assert_all_equal_one_device(2, tmp_path, CASES)


@pytest.mark.slow
def test_ring_kv_attention_over_4_ranks_equals_one_device(tmp_path: Path) -> None:
    _assert_all_equal_one_device(4, tmp_path, RING_CASES)
