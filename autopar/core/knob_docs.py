"""The knob table as text: the markdown table of docs/cli.md and the list in
``autopar.plan``'s docstring, both rendered from :data:`autopar.core.knob_table.KNOBS` so
the documentation says what the code does (tests/test_knob_table.py compares docs/cli.md).

    python -m autopar.core.knob_docs    # print the markdown table

>>> print(knob_list(["cp_layout"]))  # doctest: +NORMALIZE_WHITESPACE
- ``cp_layout`` (default ``'zigzag'``; one of zigzag, contiguous): how a sequence is cut
  over cp: zigzag (2 x cp chunks, rank i holds i and 2cp-1-i: even causal work) or
  contiguous
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable

from autopar.core.knob_table import KINDS, KNOBS, Knob


class _Names(dict):
    """``{name}`` in a help text -> that knob as ``spell`` writes it."""

    def __init__(self, spell: Callable[[Knob], str]):
        super().__init__()
        self.spell = spell

    def __missing__(self, name: str) -> str:
        return self.spell(KNOBS[name])


def help_text(knob: Knob, spell: Callable[[Knob], str]) -> str:
    """The knob's help, each knob it names written by ``spell``."""
    return knob.help.format_map(_Names(spell))


def flag_help(knob: Knob) -> str:
    """The help of the knob's flag (other knobs named by their flags)."""
    return help_text(knob, lambda k: k.cli or k.name)


def values(knob: Knob, python: bool = False) -> str:
    """What values the knob takes, in words: as a flag reads them (and, where Python's
    differ, those too), or with ``python`` as the keyword takes them."""
    listed = ", ".join(map(str, knob.choices))
    if python and knob.python:
        return knob.python + (f" ({listed})" if listed else "")
    if knob.kind == "choice":
        words = f"one of {listed}"
    else:
        words = KINDS[knob.kind] + (f": {listed}" if listed else "")
    return words + (f"; in Python: {knob.python}" if knob.python and not python else "")


def knob_list(names: Iterable[str] | None = None, width: int = 92) -> str:
    """One bullet per knob (``names``, default all), for a docstring: the Python keyword,
    its default and values, and its help (a switch's help says what its flag does)."""
    out = []
    for name in names or KNOBS:
        knob = KNOBS[name]
        text = help_text(knob, lambda k: f"``{k.name}``")
        if knob.kind == "switch":
            head = f"default ``{knob.default!r}``; ``{not knob.default!r}``, the flag ``{knob.cli}``"
        else:
            head = f"default ``{knob.default!r}``; {values(knob, python=True)}"
        out.append(textwrap.fill(f"- ``{knob.name}`` ({head}): {text}", width,
                                 subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(out)


KNOB_LIST = "<knob list>"
"""The line of a docstring that :func:`with_knob_list` replaces."""


def with_knob_list(doc: str | None, names: Iterable[str]) -> str | None:
    """``doc`` with its ``<knob list>`` line replaced by :func:`knob_list` of ``names``,
    indented as that line was (``None`` under ``python -OO``, which drops docstrings)."""
    if doc is None:
        return None
    lines = doc.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == KNOB_LIST)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines[at:at + 1] = [indent + line for line in knob_list(names, 92 - len(indent)).splitlines()]
    return "\n".join(lines) + ("\n" if doc.endswith("\n") else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/cli.md's knob table: one row per knob, keyword and flag side by side."""
    rows = ["| keyword | flag | default | values | plan JSON | what it does |",
            "| --- | --- | --- | --- | --- | --- |"]
    for knob in KNOBS.values():
        flag = f"`{knob.cli}{' ' + knob.metavar if knob.metavar else ''}`" if knob.cli else (
            "(Python only)")
        cells = (f"`{knob.name}`", flag, f"`{knob.default!r}`", values(knob),
                 f"`{knob.json}`" if knob.json else "", flag_help(knob))
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
