"""One table of knobs (autopar/core/knob_table.py): the docs, the flags, ``autopar.plan`` and
``PlanOptions`` all say what it says."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest

from autopar.api.planning import plan
from autopar.cli import flags
from autopar.cli.main import build_parser
from autopar.core.knob_docs import flag_help, markdown_table
from autopar.core.knob_table import KNOBS, OPTION_KNOBS
from autopar.solver.options import PlanOptions

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# PlanOptions holds these as autopar.plan resolves them: a precision word, parsed pairs
RESOLVED = {"precision": "fp32", "precision_overrides": (), "constraints": ()}


def test_docs_knob_table_is_the_rendered_table() -> None:
    text = DOCS.read_text()
    section = text.split("<!-- knobs -->\n")[1].split("\n<!-- /knobs -->")[0]
    assert section == markdown_table(), (
        "docs/cli.md's knob table is stale: paste `python -m autopar.core.knob_docs` between "
        "<!-- knobs --> and <!-- /knobs -->")


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["plan", "emit", "estimate"])
def test_flags_take_help_and_choices_from_the_table(command: str) -> None:
    actions = {opt: a for a in _commands()[command]._actions for opt in a.option_strings}
    seen = 0
    for knob in KNOBS.values():
        action = actions.get(knob.cli) if knob.cli else None
        if action is None:
            continue
        seen += 1
        assert action.help == flag_help(knob).replace("%", "%%"), knob.name
        assert action.dest == flags.dest(knob), knob.name
        if knob.kind == "choice":
            assert tuple(action.choices) == knob.choices, knob.name
    assert seen >= 15


def test_plan_keywords_are_the_knobs_with_the_tables_defaults() -> None:
    keywords = {name: p.default for name, p in inspect.signature(plan).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "model_name"}
    assert set(keywords) <= set(KNOBS)
    for name, default in keywords.items():
        assert default == KNOBS[name].default, name
        assert f"``{name}``" in plan.__doc__, name


def test_plan_options_fields_are_the_checked_knobs() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    assert set(fields) == {knob.name for knob in OPTION_KNOBS}
    for name, default in fields.items():
        assert default == RESOLVED.get(name, KNOBS[name].default), name


def test_a_knob_check_says_what_where_and_fix() -> None:
    from autopar.core.errors import AutoparError

    with pytest.raises(AutoparError) as e:
        PlanOptions(cp_layout="spiral")
    assert (e.value.what, e.value.where, e.value.fix) == (
        "unknown cp_layout 'spiral'", "PlanOptions.cp_layout", "use one of zigzag, contiguous")
