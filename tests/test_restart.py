"""A job that loses a rank restarts under ``torchrun --max-restarts 1``, resumes from its
newest complete checkpoint and trains on with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import ROOT, free_port


def _run(tmp: Path, name: str, *flags: str) -> dict[str, dict]:
    out = tmp / f"{name}-out"
    out.mkdir()
    # c10d rendezvous: each restart is a new round, with a store of its own (the static one
    # could hand a restarted rank the dead attempt's addresses)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}",
           str(ROOT / "tests" / "workers" / "restart_worker.py"), "--dir", str(tmp / name),
           *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    env["AUTOPAR_TEST_OUT"] = str(out)
    # its own session, so a hang kills the workers too, not only torchrun's agent
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the job did not finish in 300 s:\n{stderr[-5000:]}")
    assert proc.returncode == 0, stderr[-5000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_last_checkpoint_with_the_same_losses(
        tmp_path: Path) -> None:
    whole = _run(tmp_path, "whole")
    assert set(whole) == {"rank0-attempt0", "rank1-attempt0"}
    killed = _run(tmp_path, "killed", "--kill-rank", "1")
    # the first attempt never finished; the restarted one resumed from step 2
    assert set(killed) == {"rank0-attempt1", "rank1-attempt1"}, killed
    for rank in ("rank0", "rank1"):
        resumed = killed[f"{rank}-attempt1"]
        assert resumed["resumed_from"] == 2
        assert sorted(resumed["losses"]) == ["3", "4", "5"]
        for step, loss in resumed["losses"].items():
            assert loss == pytest.approx(whole[f"{rank}-attempt0"]["losses"][step], rel=1e-5)
