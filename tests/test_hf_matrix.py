"""Breadth as a tested contract: every architecture of tests/hf_zoo.py (Hugging Face models
with padded batches and masked-LM labels) and tests/hand_models.py (losses, pooling,
routing and batch norm as users write them), under every layout, either trains exactly like
single-device training (fp32, rtol 1e-5, the loss and every gradient on every rank at each
of 3 steps) or is refused at plan time with an AutoparError naming the reason.

Layouts: ``trace`` (the traced graph itself trains like the model), ``auto`` (the solver's
own plan for 2 CPU processes), dp=2, tp=2, pp=2, ZeRO-3 dp=2, cp=2, and
tp=2 on a random layout. One torchrun launch runs every architecture under every layout,
building, training on one device and tracing each architecture once
(tests/workers/hf_matrix.py); each kind of model is judged by its own test.

``AUTOPAR_HF_ZOO=all`` runs every model of the zoo, not only ``hf_zoo.MATRIX``. Set
``AUTOPAR_HF_TABLE=docs/models.md`` to write the supported-models table of docs/models.md
from the results (tests/hf_table.py).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from tests import hand_models, hf_table  # noqa: E402
from tests.distributed import run_cases  # noqa: E402
from tests.hf_zoo import MATRIX, ZOO  # noqa: E402

LONGEST = True  # scheduled first (tests/conftest.py): one launch of several minutes

LAYOUTS = ("trace", "auto", "dp2", "tp2", "pp2", "zero3", "cp2", "tp2_random")
ARCHS = list(ZOO) if os.environ.get("AUTOPAR_HF_ZOO") == "all" else list(MATRIX)
KINDS = {**{arch: ZOO[arch][0] for arch in ARCHS},
         **{f"hand:{name}": "hand-written" for name in hand_models.MODELS}}
GROUPS = sorted(set(KINDS.values()))

# Cells autopar refuses at plan time, and words the refusal must contain (what and why).
# Every other cell must train equal to one device.
_NO_SEQUENCE = ("cp=2", "no sequence dimension")  # pixels, audio: no token input to split
_EAGER = ("cp=2", "eager chain")  # attention written as matmul, softmax, matmul
_UNSEEN = ("cp=2", "no attention was recognised")
REFUSED: dict[tuple[str, str], tuple[str, ...]] = {
    **{(arch, "cp2"): _NO_SEQUENCE for arch in (
        "vit", "deit", "swin", "convnext", "resnet", "poolformer", "wav2vec2", "whisper")},
    **{(arch, "cp2"): _EAGER for arch in ("gemma2", "bloom", "t5_pad", "mt5")},
    **{(arch, "cp2"): _UNSEEN for arch in ("deberta_v2", "funnel", "gpt_oss",
                                           "hand:batch_norm")},
    ("deepseek_v3", "cp2"): ("cp=2", "k and v shapes differ"),  # MLA: head dims differ
    ("albert", "pp2"): ("pp=2", "applies module", "more than once"),
    ("hand:shared_layers", "pp2"): ("pp=2", "applies module 'block' more than once"),
}


def judge(arch: str, layout: str, cell: dict) -> str | None:
    """Why ``cell`` breaks the contract, or None."""
    expected = REFUSED.get((arch, layout))
    if expected:
        words = [w for w in expected if w not in (cell.get("reason") or "")]
        if cell["status"] != "refused" or words:
            return f"expected a refusal naming {expected}, got {cell['status']}: {cell}"
        return None
    if cell["status"] != "equal":
        return f"{cell['status']}: {cell.get('reason') or cell.get('problems')}"
    return check_layout(layout, cell)


def check_layout(layout: str, r: dict) -> str | None:
    """The plan ran the layout it was asked for (a replicated "tp=2" in name only fails)."""
    if layout in ("trace", "auto"):
        return None
    mesh = r["mesh"]
    wanted = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "zero3": {"dp": 2},
              "cp2": {"cp": 2}, "tp2_random": {"tp": 2}}[layout]
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
        return f"{r.get('schedule')}, {r['microbatches']} microbatches"
    if layout == "cp2":
        return r.get("cp_algorithm")
    if layout == "auto":
        return " x ".join(f"{a}{n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
    return None


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[dict]]:
    """Every cell, by (architecture, layout): each rank's record. One launch for all of
    them (a launch costs its processes' imports); each kind is judged by its own test."""
    ranks = run_cases(2, tmp_path_factory.mktemp("hf"), [{"arch": arch} for arch in KINDS],
                      worker="hf_matrix.py", worker_args=("--layouts", ",".join(LAYOUTS)),
                      timeout=2400, records_per_case=len(LAYOUTS))
    return {(records[0]["arch"], records[0]["layout"]): list(records)
            for records in zip(*ranks)}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the first case makes the matrix: its one launch, many minutes
@pytest.mark.parametrize("group", GROUPS)
def test_matches_single_device(group: str, matrix: dict) -> None:
    cells: dict[str, dict[str, dict]] = {}
    failures = []
    for (arch, layout), records in matrix.items():
        if KINDS[arch] != group:
            continue
        worst = next((r for r in records if r["status"] != "equal"), records[0])
        cell = {**worst, "note": note(layout, worst)}
        cells.setdefault(layout, {})[arch] = cell
        failure = judge(arch, layout, cell)
        if failure:
            failures.append(f"{arch} ({layout}, rank {worst['rank']}): {failure}")
    for layout, by_arch in cells.items():
        hf_table.record(layout, by_arch, KINDS)
    assert not failures, "\n".join(failures)
