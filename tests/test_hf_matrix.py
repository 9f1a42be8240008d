"""Hugging Face breadth as a tested contract: every architecture of tests/hf_zoo.py under
every layout either trains exactly like single-device training (fp32, rtol 1e-5, the loss
and every gradient on every rank at each of 3 steps) or is refused at plan time with an
AutoparError naming the op and the reason.

- trace + plan (no processes, one test per architecture): the traced graph trains like the
  model, and the planner plans it;
- dp=2, tp=2, pp=2, ZeRO-3 dp=2 (slow): one torchrun launch per layout runs every
  architecture (tests/workers/hf_matrix.py).

Set ``AUTOPAR_HF_TABLE=README.md`` to write the README's supported-models table from the
results (tests/hf_table.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from tests import hf_table  # noqa: E402
from tests.distributed import run_cases  # noqa: E402
from tests.hf_zoo import ZOO, build  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from grad_check import train_reference  # noqa: E402

KINDS = {arch: kind for arch, (kind, _) in ZOO.items()}
STEPS = 3

# Cells autopar refuses at plan time, and words the refusal must contain (op and reason).
REFUSED: dict[tuple[str, str], tuple[str, ...]] = {}

def judge(arch: str, layout: str, cell: dict) -> str | None:
    """Why ``cell`` breaks the contract, or None."""
    expected = REFUSED.get((arch, layout))
    if expected:
        words = [w for w in expected if w not in cell.get("reason", "")]
        if cell["status"] != "refused" or words:
            return f"expected a refusal naming {expected}, got {cell['status']}: {cell}"
        return None
    if cell["status"] != "equal":
        return f"{cell['status']}: {cell.get('reason') or cell.get('problems')}"
    return None


@pytest.mark.parametrize("arch", list(ZOO))
def test_traces_and_plans(arch: str) -> None:
    model, (args, kwargs) = build(arch)
    try:
        gm = autopar.trace(model, (args, kwargs))
        plan = autopar.plan(gm, "2xcpu")
    except AutoparError as e:
        cell = {"status": "refused", "reason": str(e)}
    else:
        assert Plan.from_json(plan.to_json()) == plan
        plan.check_model(gm.meta["autopar"].fingerprint, type(model).__name__)
        _, ref_losses, ref_grads = train_reference(model, args, kwargs, STEPS)
        _, losses, grads = train_reference(gm, args, kwargs, STEPS)
        problems = [f"losses {losses} != {ref_losses}"] if not all(
            abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, ref_losses)) else []
        for step, (mine, theirs) in enumerate(zip(grads, ref_grads)):
            problems += [f"step {step + 1}: {n}" for n in theirs.keys() | mine.keys()
                         if n not in mine or n not in theirs
                         or not mine[n].allclose(theirs[n], rtol=1e-5, atol=1e-6)]
        cell = {"status": "equal" if not problems else "differs", "problems": problems[:10]}
    hf_table.record("plan", {arch: cell}, KINDS)
    failure = judge(arch, "plan", cell)
    assert failure is None, failure


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "zero3", "tp2_random"])
def test_matches_single_device(layout: str, tmp_path: Path) -> None:
    ranks = run_cases(2, tmp_path, [{"arch": arch} for arch in ZOO], worker="hf_matrix.py",
                      worker_args=("--layout", layout), timeout=600)
    cells, failures = {}, []
    for arch, records in zip(ZOO, zip(*ranks)):
        worst = next((r for r in records if r["status"] != "equal"), records[0])
        cells[arch] = cell = {"status": worst["status"], "reason": worst.get("reason"),
                              "problems": worst.get("problems"), "note": note(layout, worst)}
        failure = judge(arch, layout, cell) or check_layout(layout, worst)
        if failure:
            failures.append(f"{arch} ({layout}, rank {worst['rank']}): {failure}")
    hf_table.record(layout, cells, KINDS)
    assert not failures, "\n".join(failures)


def check_layout(layout: str, r: dict) -> str | None:
    """The plan ran the layout it was asked for (a replicated "tp=2" in name only fails)."""
    if r["status"] != "equal":
        return None
    mesh = r["mesh"]
    wanted = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "zero3": {"dp": 2},
              "tp2_random": {"tp": 2}}[layout]
    if any(mesh.get(axis, 1) != n for axis, n in wanted.items()):
        return f"mesh {mesh}, expected {wanted}"
    if layout == "tp2" and not r["sharded"]:
        told = r["tp_explanation"] or {}
        if not (told.get("why") if isinstance(told, dict) else told):
            return "tp=2 planned, but no weight is sharded, and the plan does not say why"
    if layout == "zero3" and r["zero"] != 3:
        return f"ZeRO stage {r['zero']}, expected 3"
    return None


def note(layout: str, r: dict) -> str | None:
    if r["status"] != "equal":
        return None
    if layout in ("tp2", "tp2_random"):
        return f"{len(r['sharded'])} weights sharded" if r["sharded"] else "no weight sharded"
    if layout == "pp2":
        return r.get("schedule")
    return None
