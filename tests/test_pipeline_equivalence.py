"""Every pipeline schedule trains exactly like one device: GPipe, 1F1B, interleaved 1F1B with
2 and 4 chunks per rank, and ZB-V, on the nanoGPT-style GPT and HF Llama, with the embedding
tied to the output head and not — every gradient on both ranks at every step, fp32,
rtol 1e-5.

A case of each model and tying runs again on one core (``taskset``) with a CPU-burning
process beside it: with one thread per process the result must not depend on the machine's
load or on how many cores it has, so the losses and gradients must be bit for bit those of
the first run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_cases, taskset

pytest.importorskip("transformers")

SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("interleaved", 4),
             ("zb_v", None)]
CASES = [
    {"model": model, "tied": tied, "pp": 2, "schedule": schedule, "microbatches": 4,
     "layers": 8 if virtual == 4 else 4, **({"virtual_stages": virtual} if virtual else {})}
    for model in ("gpt", "llama") for tied in (True, False) for schedule, virtual in SCHEDULES
]


# one case of each model and tying, each schedule among them (the busy-core rerun)
BUSY = [3, 9, 10, 16]


def check(results: list[list[dict]], cases: list[dict] = CASES) -> None:
    for rank in results:
        for case, r in zip(cases, rank):
            assert r["ok"], r
            assert r["mesh"]["pp"] == 2 and r["schedule"] == case["schedule"], r
            assert r["microbatches"] == 4
            expected_chunks = case.get("virtual_stages") or (2 if case["schedule"] == "zb_v" else 1)
            assert (r["virtual_stages"] or 1) == expected_chunks, r


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    return run_cases(2, tmp_path_factory.mktemp("pipeline"), CASES)


@pytest.mark.slow
def test_every_schedule_matches_single_device(matrix: list[list[dict]]) -> None:
    check(matrix)


@pytest.mark.slow
def test_same_bits_on_one_busy_core(matrix: list[list[dict]], tmp_path: Path) -> None:
    if taskset() is None:
        pytest.skip("taskset is not installed")
    burner = subprocess.Popen([taskset(), "-c", "0", sys.executable, "-c", "while True: pass"])
    try:
        pinned = run_cases(2, tmp_path, [CASES[i] for i in BUSY],
                           prefix=[taskset(), "-c", "0"])
    finally:
        burner.kill()
        burner.wait()
    check(pinned, [CASES[i] for i in BUSY])
    assert {CASES[i]["schedule"] for i in BUSY} == {s for s, _ in SCHEDULES}
    for rank_a, rank_b in zip(matrix, pinned):
        for a, b in zip([rank_a[i] for i in BUSY], rank_b):
            assert a["losses"] == b["losses"] and a["grad_digest"] == b["grad_digest"], (
                a["case"], a["losses"], b["losses"])
