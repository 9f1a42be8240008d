"""Launch the multi-process test workers with torchrun, on free ports, and read their results."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = str(ROOT / "tests" / "clusters" / "cpu-fast-links.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(nproc: int, out: Path, cases: list[dict], *, prefix: list[str] | None = None,
              timeout: int = 900, worker: str = "equivalence.py",
              worker_args: tuple[str, ...] = (), path: tuple[str, ...] = (),
              records_per_case: int = 1) -> list[list[dict]]:
    """Run ``cases`` (by ``tests/workers/<worker>``, given ``worker_args`` first) in one
    torchrun launch of ``nproc`` processes; each rank's records, by rank. ``prefix`` wraps
    the launch (``taskset``); ``path`` adds folders to the workers' ``PYTHONPATH``;
    ``records_per_case``: how many records a rank writes for each case."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*(prefix or []), sys.executable, "-m", "torch.distributed.run",
           f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           str(ROOT / "tests" / "workers" / worker), *worker_args]
    for case in cases:
        cmd += ["--case", json.dumps(case)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), *path]),
               AUTOPAR_TEST_OUT=str(out))
    env.pop("TRITON_INTERPRET", None)  # attention runs as it would in a user's CPU job
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    complete = len(results) == nproc and all(len(r) == len(cases) * records_per_case
                                             for r in results)
    assert proc.returncode == 0 and complete, (
        f"workers failed (exit {proc.returncode}):\n"
        + "\n".join(json.dumps(r) for rank in results for r in rank if not r.get("ok"))
        + f"\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return results


def run_pinned(nproc: int, out: Path, cases: list[dict],
               axes: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")) -> list[tuple[dict, dict]]:
    """:func:`run_cases`, each record checked: it ran (``ok``) on the mesh its case pinned
    (every axis of ``axes`` the case names); (case, record) for every rank's records."""
    pairs = []
    for rank in run_cases(nproc, out, cases):
        for case, r in zip(cases, rank):
            assert r["ok"], r
            for axis in axes:
                if axis in case:
                    assert r["mesh"].get(axis, 1) == case[axis], (case, r["mesh"])
            pairs.append((case, r))
    return pairs


def taskset() -> str | None:
    return shutil.which("taskset")
