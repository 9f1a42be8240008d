"""Every layout the planner may pick trains like one device, not only the one it prefers.

The solver's choice among layouts of about the same modelled cost moves with the cost model
and with CP-SAT's tie-breaking; a layout the runtime ran wrong stayed hidden until a solver
setting changed which tie won (a rotary table split on tp along the sequence that cp then
sliced: ``passes/insert_collectives.redistribution_steps``). Here the planner plans under a
scrambled cost model (each op and each redistribution priced at a fixed pseudo-random
multiple, ``tests/workers/plan_edits.scrambled_costs``): every constraint still holds, the
preferences move, and half or more of the nodes change strategy. Each plan must then train
exactly as one device does (every loss and gradient, every rank and step). The scrambles
are fixed by seed, so every run checks the same layouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import FAST, run_pinned

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LAUNCHES = {
    "2ranks": (2, [
        *[{"model": "gpt", "tp": 2, "cluster": FAST, "scramble": s} for s in (1, 2)],
        *[{"model": "llama", "tp": 2, "cluster": FAST, "scramble": s} for s in (1, 2)],
    ]),
    "4ranks": (4, [
        *[{"model": "llama", "cp": 2, "tp": 2, "cluster": FAST, "scramble": s}
          for s in (1, 2, 3)],
        {"model": "gpt", "cp": 2, "tp": 2, "cluster": FAST, "scramble": 1},
        {"model": "llama", "dp": 2, "tp": 2, "zero": 3, "cluster": FAST, "scramble": 1},
        {"model": "gpt", "dp": 2, "tp": 2, "recompute": "full", "cluster": FAST, "scramble": 1},
        {"model": "llama", "pp": 2, "tp": 2, "microbatches": 4, "cluster": FAST, "scramble": 1},
    ]),
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_scrambled_layouts_match_single_device(launch: str, tmp_path: Path) -> None:
    nproc, cases = LAUNCHES[launch]
    for case, r in run_pinned(nproc, tmp_path, cases):
        assert r["sharded"], ("expected tensor-parallel weights", case)
