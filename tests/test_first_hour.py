"""What a new user meets in the first hour: errors that say the way out in one line, the
plan's text that says what it beat, and ``str(plan)`` that reads as the summary."""

from __future__ import annotations

import pytest

from autopar.cli.main import main
from autopar.core.plan import Plan

SMALL = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,batch=32"


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", SMALL, "--cluster", "4xcpu", "--json", str(out)]) == 0
    return Plan.load(out)


def test_a_family_name_suggests_its_presets(capsys) -> None:
    assert main(["plan", SMALL, "--cluster", "8xh100"]) == 2
    err = capsys.readouterr().err
    assert "did you mean H100-80GB or H100-96GB?" in err, err


def test_a_mesh_that_cannot_be_says_which_can(capsys) -> None:
    assert main(["plan", SMALL, "--cluster", "8xH100-80GB", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "None" not in err and "where: tp" in err, err
    assert "tp = 1, 2, 4, 8" in err and "meshes that do: " in err, err


def test_a_bad_integer_is_one_line_not_the_usage_block(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["plan", SMALL, "--cluster", "2xcpu", "--tp", "x"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and "--tp" in err and "--help" in err, err
    assert len(err.splitlines()) <= 2, err


def test_a_pin_that_fits_no_mesh_is_a_short_error(capsys) -> None:
    assert main(["plan", "gpt2", "--cluster", "8xH100-80GB", "--microbatch", "3"]) == 2
    err = capsys.readouterr().err
    assert "microbatch=3" in err and max(map(len, err.splitlines())) < 600, err


def test_a_device_without_bf16_plans_what_it_runs(capsys) -> None:
    """A V100 has no bf16: the default precision is one it runs, not a refusal."""
    assert main(["plan", SMALL, "--cluster", "2xV100-32GB"]) == 0
    assert ", fp32, adamw" in capsys.readouterr().out


def test_the_help_names_every_built_in_model(capsys) -> None:
    from autopar.models import builtin_names

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in builtin_names():
        assert name in text, name
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_str_of_a_plan_is_its_summary_and_says_what_it_beat(plan: Plan) -> None:
    text = str(plan)
    assert len(text) < 20_000 and text == str(Plan.from_dict(plan.to_dict()))
    for words in ("mesh", "memory per device (modelled)", "step (modelled)",
                  "what the plan beat (modelled", "R whole, S(d) split along dim d"):
        assert words in text, words
    assert "search: " in text and "proven lower bounds" in text
    assert repr(plan).startswith("<Plan ") and len(repr(plan)) < 300
    assert plan.to_json().startswith("{")


def test_the_other_meshes_are_listed_with_their_step_or_why_not(plan: Plan) -> None:
    """Each mesh the search tried besides the plan's: the best setting's step and how much
    slower it is, or why none was priced."""
    lines = str(plan).split("what the plan beat")[1].split("\n\n")[0].splitlines()[1:]
    tried = {(c["pp"], c["dp"], c["tp"]) for c in plan.solver["candidates"]}
    mine = (plan.mesh.get("pp", 1), plan.mesh["dp"], plan.mesh["tp"])
    for pp, dp, tp in tried - {mine}:  # each once, the runner-up's on its own line
        words = (f"pp={pp} " if pp > 1 else "") + f"dp={dp} tp={tp} "
        assert sum(words in line for line in lines) == 1, (words, lines)
    for line in lines:
        assert "slower" in line or "cannot" in line or "does not fit" in line \
            or "validated ground" in line or "runner-up" in line, line


def test_a_step_prints_only_the_communication_its_mesh_has(plan: Plan) -> None:
    step = str(plan).split("step (modelled)")[1].splitlines()[2]
    if plan.mesh["tp"] == 1:
        assert "tp comm" not in step, step
    if plan.mesh["dp"] > 1:
        assert "dp comm" in step, step
    assert "e+0" not in str(plan)
