"""The command line's flags: each knob's flag made from its row of the knob table
(:mod:`autopar.core.knob_table`: spelling, help text, choices, default), so ``plan``,
``estimate``, ``emit`` and ``inspect`` spell and explain it the same way.

Values are checked by argparse types, so a bad value is an argparse error (exit 2) that
names the flag, before any model is traced. Old spellings (``--dtype``, ``--batch``,
``--schedule zero-bubble``) still work and print a deprecation line to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autopar.core.errors import AutoparError
from autopar.core.knob_docs import flag_help
from autopar.core.knob_table import KNOBS, Knob
from autopar.core.knobs import PRECISIONS, RECOMPUTE_MODES, schedule_name, zero_stages

# --- value types --------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An integer >= 1 (degrees, sizes, counts)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_int_up_to(limit: int, why: str) -> Callable[[str], int]:
    """``positive_int`` with an upper bound (``why`` says where the bound comes from)."""

    def convert(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected at most {limit} ({why}), got {value}")
        return value

    convert.__name__ = "positive_int"
    return convert


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A finite number >= 0 (a fraction: 0.1 is 10%)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite fraction >= 0, got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file autopar may write: its folder exists and is writable, and it is no folder.
    Checked before any tracing or solving, so a typo does not cost a solve."""
    path = Path(os.path.expanduser(text))  # "~nobody" stays as written
    folder = path.parent
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a NUL byte, which no file name can")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"'{text}' is a directory; give a file name in it")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"directory '{folder}' does not exist (create it first, or write elsewhere)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory '{folder}' is not writable")
    return text


def _knob(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser in :mod:`autopar.core.knobs`: its errors become argparse
    errors, and its deprecation warnings lines on stderr."""

    def convert(text: str) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            try:
                value = parse(text)
            except AutoparError as err:
                raise argparse.ArgumentTypeError(f"{err.what} ({err.fix})") from None
        for warning in caught:
            print(str(warning.message), file=sys.stderr)
        return value

    convert.__name__ = parse.__name__
    return convert


def _stage_list(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        stages = ()
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise AutoparError(f"{text!r} is not a list of ZeRO stages", where="--zero",
                           fix="give stages 0-3 separated by commas, e.g. 0,3")
    return zero_stages(stages, where="--zero")


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    if not all(modes) or any(m not in RECOMPUTE_MODES for m in modes):
        raise AutoparError(f"{text!r} is not a list of recomputation modes", where="--recompute",
                           fix=f"give modes from {', '.join(RECOMPUTE_MODES)} separated by "
                           "commas, e.g. none,full")
    return tuple(dict.fromkeys(modes))


schedule = _knob(schedule_name)
stage_list = _knob(_stage_list)
mode_list = _knob(_mode_list)


def _layer_modes(text: str) -> tuple[str, ...]:
    """One recomputation mode per layer (repeats kept)."""
    modes = tuple(m.strip() for m in text.split(","))
    if not all(modes) or any(m not in RECOMPUTE_MODES for m in modes):
        raise AutoparError(f"{text!r} is not one recomputation mode per layer",
                           where="--recompute-layers",
                           fix=f"give a mode from {', '.join(RECOMPUTE_MODES)} for each layer, "
                           "separated by commas, e.g. full,full,none,none")
    return modes


layer_modes = _knob(_layer_modes)


class _Renamed(argparse.Action):
    """An old spelling of a flag: stores into the new flag's value and says so on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"autopar: {option_string} is deprecated; use {self.new} (same meaning)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def _renamed(p: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    p.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=_Renamed, new=new,
                   **kwargs)


def precision_override(text: str) -> tuple[str, str]:
    """``NODE=DTYPE`` (NODE an fx node name or a module path)."""
    key, eq, word = text.partition("=")
    if not eq or not key.strip() or word.strip() not in PRECISIONS:
        raise argparse.ArgumentTypeError(
            f"expected NODE=DTYPE with DTYPE one of {', '.join(PRECISIONS)}, got {text!r}")
    return key.strip(), word.strip()


def _solve_budget(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count or 'none', got {text!r}")
    return value


def constraint(text: str) -> str:
    """A constraint's text, read now so a typo fails before tracing (autopar.core.constraints)."""
    from autopar.core.constraints import parse_constraint

    try:
        parse_constraint(text)
    except AutoparError as e:
        raise argparse.ArgumentTypeError(f"{e.what}; {e.fix}") from None
    return text


# --- knobs: each flag made from its row of the knob table ----------------------------------

TYPES: dict[str, Callable[[str], Any]] = {
    "count": positive_int, "schedule": schedule, "stages": stage_list, "modes": mode_list,
    "layer_modes": layer_modes, "override": precision_override, "seconds": positive_seconds,
    "solves": _solve_budget, "fraction": fraction, "constraint": constraint,
}
"""The argparse type that reads each kind of knob value (``choice`` and ``switch`` need none)."""

_APPENDED = ("override", "constraint")  # kinds whose flag is repeatable


def dest(knob: Knob) -> str:
    """Where argparse stores the knob: under its name for a switch (``--no-fuse-attention``)
    and ``--precision-override``, else under the flag's words (``args.time_limit``)."""
    if knob.kind in ("switch", "override"):
        return knob.name
    return knob.cli.lstrip("-").replace("-", "_")


def cli_default(knob: Knob) -> Any:
    """The knob's default as the flag writes it (a list comma-separated, as typed)."""
    if isinstance(knob.default, tuple):
        return ",".join(map(str, knob.default))
    return knob.default


TABLE_DEFAULT: Any = object()
"""``add_knob``'s default: the knob table's."""


def add_knob(p: argparse.ArgumentParser, name: str, default: Any = TABLE_DEFAULT) -> None:
    """The flag of knob ``name`` (and its old spelling, if any), its help, choices and
    default from the knob table; ``default`` (as typed on the command line) replaces the
    table's where a command has its own (``estimate``: ``--tp 1``)."""
    knob = KNOBS[name]
    kwargs: dict[str, Any] = {"dest": dest(knob)}
    if knob.kind == "choice":
        kwargs["choices"] = knob.choices
    elif knob.kind == "switch":  # the flag turns the default over
        kwargs["action"] = "store_false" if knob.default else "store_true"
    else:
        kwargs["type"] = TYPES[knob.kind]
    if knob.kind in _APPENDED:
        kwargs["action"] = "append"
    if knob.kind != "switch":
        kwargs["default"] = cli_default(knob) if default is TABLE_DEFAULT else default
    if knob.metavar:
        kwargs["metavar"] = knob.metavar
    p.add_argument(knob.cli, help=flag_help(knob).replace("%", "%%"), **kwargs)
    if knob.old_flag:
        _renamed(p, knob.old_flag, knob.cli,
                 **{k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar")})


def add_knobs(p: argparse.ArgumentParser, *names: str, **defaults: Any) -> None:
    """``add_knob`` for each of ``names``, in order; ``defaults``: name -> the flag's default
    where the command's is not the table's."""
    for name in names:
        add_knob(p, name, defaults.get(name, TABLE_DEFAULT))


# --- flags that are no knob ------------------------------------------------------------------

MODEL_HELP = (  # the built-in names spelled out: the registry imports torch (tests/test_cli.py)
    "built-in name (gpt2, gpt2-xl, gpt-125m, gpt3-175b, llama3-8b, llama3-70b, mixtral-8x7b, "
    "deepseek-v3), "
    "a spec such as gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024, or "
    "path/to/file.py:factory (returning (model, example_args, example_kwargs))"
)


def add_model(p: argparse.ArgumentParser) -> None:
    """MODEL, and the batch and sequence it is traced with."""
    p.add_argument("model", help=MODEL_HELP)
    add_knob(p, "global_batch")
    p.add_argument("--seq", type=positive_int, default=None, metavar="N",
                   help="sequence length (default: the model's)")


def add_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="a shorthand (8xH100-80GB, 16x8xA100-80GB, 2xcpu) or a .yaml/.json file")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=output_file, metavar="FILE",
                   help="also write the result as JSON to FILE")


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no live progress (tracing, the mesh being solved, the best plan so "
                   "far); it shows only on a terminal anyway")


SHARED_FLAGS = ("--global-batch", "--seq", "--cluster", "--dp", "--tp", "--pp", "--cp", "--ep",
                "--dp-replicate",
                "--cp-algorithm", "--cp-layout", "--microbatch",
                "--schedule", "--virtual-stages", "--recompute", "--precision", "--zero",
                "--optimizer", "--no-fuse-attention", "--json")
"""Flags ``plan`` and ``estimate`` both take (tests check their help texts are the same)."""


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless it has none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and "%(default)" not in text
                and not any(default is v for v in (None, False, True, argparse.SUPPRESS))):
            text += f" (default: {default})".replace("%", "%%")
        return text
