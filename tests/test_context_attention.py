"""Context-parallel attention on 2 gloo processes equals one device: the all-gather K/V
algorithm, contiguous and zigzag shards, causal, GQA and a sliding window."""

from pathlib import Path

import pytest

from tests.distributed import run_cases

CASES = [{"causal": False}, {"causal": True}, {"causal": True, "zigzag": True},
         {"causal": True, "zigzag": True, "kv_heads": 1},
         {"causal": True, "window": [5, 0], "kv_heads": 2}]


@pytest.mark.slow
def test_all_gather_kv_attention_equals_one_device(tmp_path: Path) -> None:
    results = run_cases(2, tmp_path, CASES, worker="context_attention.py", timeout=300)
    for rank in results:
        for record in rank:
            assert record["ok"], record
