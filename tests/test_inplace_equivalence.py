"""T5 and BART with tp=2 train exactly as on one device (fp32, every loss and every
gradient on every rank at every step, rtol 1e-5), and so does a buffer written in place
while split by heads.

Both write their shifted labels into a new buffer in place; autopar once placed the buffer
whole and the written slice split, and T5 trained silently wrong (tests/test_inplace.py has
the mechanism). One torchrun launch runs both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import ROOT, free_port

pytest.importorskip("transformers")


CASES = [{"model": "t5", "tp": 2}, {"model": "bart", "tp": 2},
         {"model": "head_buffer", "tp": 2}]  # last: it patches the solver in the worker


@pytest.mark.slow
def test_encoder_decoders_tp2_match_single_device(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", str(ROOT / "tests" / "workers" / "encoder_decoders.py"),
           *(json.dumps(c) for c in CASES)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AUTOPAR_TEST_OUT=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(ranks) == 2
    for records in ranks:
        assert [r["case"] for r in records] == CASES
        for r in records:
            assert r["ok"], r
            assert r["mesh"]["tp"] == 2 and r["grads_checked"] >= 6, r
            assert r["sharded"], ("tp=2 sharded no weight", r["case"])
        assert records[2]["buffers"] == {"new_empty": "S(2)"}, records[2]  # split by heads
