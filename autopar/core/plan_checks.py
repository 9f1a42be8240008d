"""The rules one value of a plan's JSON must satisfy, and the combinators that build them:
the vocabulary :mod:`autopar.core.plan_fields` writes the schema table in."""

from __future__ import annotations

import difflib
import math
import reprlib
from collections.abc import Callable
from typing import Any, NoReturn

from autopar.core.errors import AutoparError, PlanError
from autopar.core.placements import parse_placement

MAX_INT = 2**53  # JSON numbers beyond this are not exact in most readers
MAX_DIM = 64  # tensor dimensions a Shard placement may name
REPLAN = "re-plan with autopar plan MODEL --cluster ... --json FILE rather than editing a plan"

Check = Callable[[Any, str], None]
"""A rule: raises PlanError naming ``where`` unless the value satisfies it."""


def show(value: Any) -> str:
    """``value`` as an error message quotes it: short, and a huge integer by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


def fail(where: str, expected: str, value: Any, fix: str = REPLAN) -> NoReturn:
    """Raise the PlanError saying the field at ``where`` must be ``expected``."""
    raise PlanError(f"{where} must be {expected}, got {show(value)}", where=where, fix=fix)


def field_path(where: str, key: str) -> str:
    """The path of field ``key`` inside the object at ``where``."""
    return f"{where}.{key}" if where else key


# --- field rules ---------------------------------------------------------------------------
def _range(kind: str, lo: float, hi: float, limit: float) -> str:
    if hi < limit:
        return f"{kind} from {lo:g} to {hi:g}"
    return {0: f"{kind} >= 0", 1: f"a positive {kind.split()[-1]}"}.get(lo, f"{kind} >= {lo:g}")


def integer(lo: int = 0, hi: int = MAX_INT, fix: str = REPLAN) -> Check:
    def check(value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            expected = _range("an integer", lo, hi, MAX_INT)
            if isinstance(value, int) and value > hi:
                expected += f" and at most {hi:,}"
            fail(where, expected, value, fix)
    return check


def number(lo: float = 0.0, hi: float = math.inf) -> Check:
    def check(value: Any, where: str) -> None:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or not lo <= value <= hi):
            fail(where, _range("a finite number", lo, hi, math.inf), value)
    return check


def text(empty: bool = False) -> Check:
    def check(value: Any, where: str) -> None:
        if isinstance(value, str) and (empty or value.strip()):
            try:
                value.encode("utf-8")  # a lone surrogate ("\ud800") cannot be printed
                return
            except UnicodeEncodeError:
                pass
        fail(where, "a string" if empty else "a non-empty string", value)
    return check


def one_of(values: tuple, fix: str = REPLAN) -> Check:
    def check(value: Any, where: str) -> None:
        if not any(type(value) is type(v) and value == v for v in values):  # 3.0 is not 3
            fail(where, f"one of {', '.join(map(repr, values))}", value, fix)
    return check


def flag(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        fail(where, "true or false", value)


def nullable(rule: Check) -> Check:
    def check(value: Any, where: str) -> None:
        if value is not None:
            rule(value, where)
    return check


def plain(value: Any, where: str) -> None:
    """Text, a flag, null, a finite number, or a list of them (descriptive entries)."""
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        at = f"{where}[{i}]" if isinstance(value, list) else where
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            text(empty=True)(item, at)
        else:
            number(-math.inf)(item, at)


def list_of(rule: Check, length: int | None = None) -> Check:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, list):
            fail(where, "a list", value)
        if length is not None and len(value) != length:
            fail(where, f"a list of {length} items", value)
        for i, item in enumerate(value):
            rule(item, f"{where}[{i}]")
    return check


def map_of(rule: Check) -> Check:
    """An object from names (node names, parameter FQNs) to ``rule``."""
    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            fail(where, "an object", value)
        for key, item in value.items():
            text()(key, f"{where} key")
            rule(item, field_path(where, key))
    return check


def obj(required: dict[str, Check], optional: dict[str, Check] | None = None,
        extra: Check | None = None) -> Check:
    """An object with ``required`` keys, maybe ``optional`` ones, and other keys only when
    ``extra`` says what they hold."""
    optional = optional or {}

    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            fail(where, "a JSON object", value)
        for key, rule in required.items():
            if key not in value:
                at = field_path(where, key)
                raise PlanError(f"the plan lacks field {at!r}", where=at, fix=REPLAN)
            rule(value[key], field_path(where, key))
        for key, item in value.items():
            if key in required:
                continue
            rule = optional.get(key, extra)
            if rule is None:
                known = [*required, *optional]
                close = difflib.get_close_matches(str(key), known, n=1)
                raise PlanError(
                    f"unknown field {field_path(where, str(key))!r} in the plan",
                    where=field_path(where, str(key)),
                    fix=(f"did you mean {close[0]!r}? " if close else "")
                    + f"fields here: {', '.join(known)}; {REPLAN}")
            text()(key, f"{where} key")
            rule(item, field_path(where, key))
    return check


def placement(value: Any, where: str) -> None:
    """A placement in the canonical form ``str(placement)`` writes (R, P, S(0), S(2)g3)."""
    expected = "a placement: R, P, P(avg), S(dim) or S(dim)gK"
    if not isinstance(value, str) or len(value) > 32:
        fail(where, expected, value)
    try:
        parsed = parse_placement(value)
        ok = str(parsed) == value and getattr(parsed, "dim", 0) < MAX_DIM
    except (AutoparError, ValueError):
        ok = False
    if not ok:
        fail(where, expected, value)


def empty_or(rule: Check) -> Check:
    def check(value: Any, where: str) -> None:
        if value != {}:
            rule(value, where)
    return check


def anything(value: Any, where: str) -> None:
    """Checked elsewhere (the cluster's other fields, by the cluster loader)."""
