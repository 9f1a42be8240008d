"""The command line: each subcommand runs, prints labelled numbers, writes valid JSON."""

from __future__ import annotations

import json

import pytest

from autopar.cli.main import main
from autopar.core.plan import Plan

SMALL = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,batch=8"
FAST = "tests/clusters/cpu-fast-links.yaml"


def test_plan_prints_summary_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    # batch 32: enough work that two devices win (at batch 8 the ~4 ms step gains less from a
    # second device than averaging the loss over two costs, and the plan uses one)
    model = SMALL.replace("batch=8", "batch=32")
    assert main(["plan", model, "--cluster", "2xcpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for words in ("mesh", "memory per device (modelled)", "step (modelled)", "solver",
                  "tokens/s", "headroom", "attention 2 of 2 sites fused"):
        assert words in text
    plan = Plan.load(out)
    assert plan.mesh == {"dp": 2, "tp": 1}
    assert plan.predicted["label"] == "modelled"


def test_version_prints_the_package_version(capsys) -> None:
    import autopar

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {autopar.__version__}"


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
    # attention runs as the generated fused kernel, one call per layer
    assert text.count("autopar_kernels_api_attention(") == 2
    assert "# pass fuse-attention: 2 change(s)" in text


def test_emit_with_a_saved_plan(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", SMALL, "--cluster", "2xcpu", "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(["emit", SMALL, "--cluster", "2xcpu", "--plan", str(out)]) == 0
    assert "def forward" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_runs_and_matches(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the demo keeps its refitted profile
    assert main(["demo", "--steps", "3", "--preset"]) == 0  # no measuring first
    text = capsys.readouterr().out
    assert "measuring it first" not in text and "planned with the cpu preset" in text
    assert "single device vs 2 gloo processes" in text
    assert "predicted" in text and "measured" in text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("step ") and "|diff|" in line]
    assert len(rows) == 3 and "largest |diff| over 3 steps" in text, text
    # predicted and measured on one basis (one step), the single device's step beside them
    assert "step time, one step" in text and "one device" in text, text
    assert "what the plan beat" in text and "next: " in text, text
    assert len(text.strip().splitlines()) <= 40, text


def test_plan_with_pipeline_shows_stages_and_keeps_them_in_json(tmp_path, capsys) -> None:
    out = tmp_path / "pp.json"
    model = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32,batch=8"
    assert main(["plan", model, "--cluster", "2xcpu", "--pp", "2", "--microbatches", "4",
                 "--schedule", "1f1b", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline (modelled)  1f1b" in text and "4 microbatches" in text and "bubble" in text
    assert "embedding,0-" in text and ",head" in text
    plan = Plan.load(out)
    assert plan.mesh["pp"] == 2
    pipe = plan.pipeline
    assert pipe["schedule"] == "1f1b" and pipe["microbatches"] == 4
    assert 0 < pipe["bubble_fraction"] < 1
    # The stages' layers cover the model's 4 layers exactly once, in order.
    spans = [c["layers"] for c in pipe["chunks"]]
    assert spans[0][0] == 0 and spans[-1][1] == 3
    assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))
    assert [s["rank"] for s in pipe["stages"]] == [0, 1]
    assert all(s["memory_bytes"] > 0 and s["time_per_microbatch_s"] > 0 for s in pipe["stages"])
    # Written out and read back, the plan is the same data.
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


# --- one vocabulary, one exit-status convention -----------------------------------------------


def _flags_of(command: str) -> dict:
    import argparse

    from autopar.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: a for a in sub.choices[command]._actions for opt in a.option_strings}


@pytest.mark.parametrize("other", ["estimate", "emit"])
def test_shared_flags_are_explained_in_the_same_words(other: str) -> None:
    from autopar.cli.flags import SHARED_FLAGS

    plan, theirs = _flags_of("plan"), _flags_of(other)
    for flag in SHARED_FLAGS:
        if flag not in theirs:
            assert other == "emit" and flag == "--json"  # emit prints; it writes no JSON
            continue
        a, b = plan[flag], theirs[flag]
        assert (a.help, a.type, a.choices, a.metavar, a.dest) == (
            b.help, b.type, b.choices, b.metavar, b.dest), flag


def test_old_spellings_still_work_and_say_so(tmp_path, capsys) -> None:
    out = tmp_path / "e.json"
    model = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
    code = main(["estimate", model, "--cluster", "8xA100-80GB", "--tp", "2", "--pp", "2",
                 "--microbatch", "2", "--dtype", "fp32", "--batch", "8", "--schedule",
                 "zero-bubble", "--json", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    assert "--dtype is deprecated; use --precision" in err
    assert "--batch is deprecated; use --global-batch" in err
    assert "'zero-bubble' is deprecated; use 'zb_v'" in err
    assumptions = json.loads(out.read_text())["assumptions"]
    assert (assumptions["precision"], assumptions["global_batch"], assumptions["schedule"],
            assumptions["virtual_stages"]) == ("fp32", 8, "zb_v", 2)  # ZB-V: two chunks a rank


def test_plan_takes_the_optimizer(tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", SMALL, "--cluster", "2xcpu", "--optimizer", "sgd", "--zero", "0",
                 "--recompute", "none", "--json", str(out)]) == 0
    assert Plan.load(out).training["optimizer"] == "sgd"


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys) -> None:
    import autopar.cli.main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert main(["cluster", "show", "2xcpu"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "autopar: interrupted (Ctrl-C) during cluster"


def test_output_into_a_closed_pipe_is_a_quiet_exit() -> None:
    """``autopar ... | head -1``: the reader goes away; autopar exits 0 without a word."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "autopar.cli.main", "cluster", "show",
                             "16x8xH100-80GB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before autopar writes anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert err.decode() == ""
