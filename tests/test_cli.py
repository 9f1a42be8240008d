"""The command line: each subcommand runs, prints labelled numbers, writes valid JSON."""

from __future__ import annotations

import pytest

from autopar.cli.main import main
from autopar.plan import Plan

SMALL = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,batch=8"
FAST = "tests/clusters/cpu-fast-links.yaml"


def test_plan_prints_summary_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", SMALL, "--cluster", "2xcpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for words in ("mesh", "memory per device (modelled)", "step (modelled)", "solver",
                  "tokens/s", "headroom"):
        assert words in text
    plan = Plan.load(out)
    assert plan.mesh == {"dp": 2, "tp": 1}
    assert plan.predicted["label"] == "modelled"


def test_plan_with_pinned_tp_shows_sharded_layers(capsys) -> None:
    assert main(["plan", SMALL, "--cluster", FAST, "--dp", "2", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "dp=2 x tp=2" in text
    assert "transformer.h" in text and "S(" in text


def test_inspect_lists_layers(capsys) -> None:
    assert main(["inspect", SMALL]) == 0
    text = capsys.readouterr().out
    assert "transformer.h.0" in text and "fwd FLOPs" in text and "activations" in text
    assert "1 more identical" in text


def test_cluster_show(capsys) -> None:
    assert main(["cluster", "show", "16x8xA100-80GB"]) == 0
    text = capsys.readouterr().out
    assert "world size" in text and "128" in text and "A100-80GB" in text


def test_emit_prints_the_rank_program(capsys) -> None:
    assert main(["emit", SMALL, "--cluster", FAST, "--dp", "2", "--tp", "2", "--rank", "3"]) == 0
    text = capsys.readouterr().out
    assert "rank 3 of 4" in text and "{'dp': 1, 'tp': 1}" in text
    assert "def forward" in text
    assert "redistribute" in text or "grad_all_reduce" in text


def test_emit_with_a_saved_plan(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", SMALL, "--cluster", "2xcpu", "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(["emit", SMALL, "--cluster", "2xcpu", "--plan", str(out)]) == 0
    assert "def forward" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_runs_and_matches(capsys) -> None:
    assert main(["demo", "--steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "single device vs 2 gloo processes" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) >= 3
