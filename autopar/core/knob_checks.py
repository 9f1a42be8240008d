"""What a planning knob's value may be: one small check per kind of value.

Each check takes the knob's name and value and returns the value as the plan uses it
(normalised: a schedule's one name, a tuple for a list) or raises an :class:`AutoparError`
saying what is wrong, where (``PlanOptions.<name>``) and what to pass instead. The table of
knobs (:mod:`autopar.core.knob_table`) names each knob's check; ``PlanOptions`` runs them.

>>> one_of(("zigzag", "contiguous"))("cp_layout", "zigzag")
'zigzag'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from autopar.core.constraints import Constraint
from autopar.core.errors import AutoparError
from autopar.core.knobs import (
    OFFLOADS_RUNNABLE,
    PRECISIONS,
    RECOMPUTE_MODES,
    schedule_name,
    zero_stages,
)

Check = Callable[[str, Any], Any]
"""``check(name, value) -> value``, normalised; raises AutoparError when it is no value of
the knob."""


def positive_or_none(name: str, value: Any) -> Any:
    """A degree, size or count: ``None`` (the solver chooses) or an integer >= 1."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise AutoparError(
            f"{name} must be a positive integer, got {value!r}",
            where=f"PlanOptions.{name}",
            fix=f"pass {name}=None to let the solver choose, or a positive int",
        )
    return value


def one_of(choices: tuple[str, ...], none_chooses: bool = False) -> Check:
    """A name from ``choices`` (or ``None``, chosen by cost, with ``none_chooses``)."""
    tail = ", or None to choose by cost" if none_chooses else ""

    def check(name: str, value: Any) -> Any:
        if not (none_chooses and value is None) and value not in choices:
            raise AutoparError(f"unknown {name} {value!r}", where=f"PlanOptions.{name}",
                               fix=f"use one of {', '.join(choices)}{tail}")
        return value

    return check


def boolean(name: str, value: Any) -> Any:
    """True or False, nothing else (not 0, 1 or "no")."""
    if not isinstance(value, bool):
        raise AutoparError(f"{name} must be True or False, got {value!r}",
                           where=f"PlanOptions.{name}", fix=f"pass {name}=True or False")
    return value


def schedule(name: str, value: Any) -> Any:
    """A pipeline schedule's one name (old spellings warn), or ``None``."""
    return None if value is None else schedule_name(value)


def stages(name: str, value: Any) -> tuple[int, ...]:
    """ZeRO stages to choose from: one stage or a non-empty tuple of them."""
    return zero_stages(value, where=f"PlanOptions.{name}")


def precision_overrides(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    """Node name or module path -> dtype word, as sorted pairs."""
    overrides = tuple(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(overrides, tuple) or any(
            not isinstance(o, tuple) or len(o) != 2 or not isinstance(o[0], str)
            for o in overrides):
        raise AutoparError(
            f"precision_overrides must map node names or module paths to dtypes, got "
            f"{value!r}", where="PlanOptions.precision_overrides",
            fix='e.g. precision_overrides={"lm_head": "fp32"}')
    for key, word in overrides:
        if word not in PRECISIONS:
            raise AutoparError(f"unknown precision {word!r} for {key!r}",
                               where=f"precision_overrides[{key!r}]",
                               fix=f"use one of {', '.join(PRECISIONS)}")
    return tuple(sorted(overrides))


def offloads(name: str, value: Any) -> tuple[str, ...]:
    """Offload modes the planner may use: one, or a non-empty tuple of them."""
    offload = (value,) if isinstance(value, str) else tuple(value)
    if not offload or any(o not in OFFLOADS_RUNNABLE for o in offload):
        raise AutoparError(
            f"offload must be one or more of {', '.join(OFFLOADS_RUNNABLE)}, got "
            f"{value!r}", where="PlanOptions.offload",
            fix='e.g. offload="none", or offload=("none", "optimizer+params")')
    return tuple(dict.fromkeys(offload))


def recompute_modes(name: str, value: Any) -> Any:
    """The recomputation modes the solver may give each layer: a non-empty subset."""
    if not value or any(m not in RECOMPUTE_MODES for m in value):
        raise AutoparError(
            f"recompute must be a non-empty subset of {RECOMPUTE_MODES}, got {value}",
            where="PlanOptions.recompute",
            fix='e.g. recompute=("none", "full")',
        )
    return value


def layer_modes(name: str, value: Any) -> tuple[str, ...] | None:
    """One recomputation mode per repeated layer (a tuple), or ``None``."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not value \
            or any(m not in RECOMPUTE_MODES for m in value):
        raise AutoparError(
            f"recompute_layers must give one of {RECOMPUTE_MODES} per layer, got {value!r}",
            where="PlanOptions.recompute_layers",
            fix='e.g. recompute_layers=("full", "full", "none", "none")')
    return tuple(value)


def _finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise AutoparError(f"{name} must be a finite number, got {value!r}",
                           where=f"PlanOptions.{name}", fix="e.g. memory_fraction=0.9, "
                           "time_limit_s=20")


def memory_share(name: str, value: Any) -> Any:
    """A share of device memory: a finite number in (0, 1]."""
    _finite(name, value)
    if not 0 < value <= 1:
        raise AutoparError(f"memory_fraction must be in (0, 1], got {value}",
                           where="PlanOptions.memory_fraction",
                           fix="e.g. 0.9 leaves 10% headroom")
    return value


def seconds(name: str, value: Any) -> Any:
    """A finite number of seconds > 0."""
    _finite(name, value)
    if value <= 0:
        raise AutoparError(f"time_limit_s must be positive, got {value}",
                           where="PlanOptions.time_limit_s", fix="e.g. 20")
    return value


def margin(name: str, value: Any) -> Any:
    """A fraction >= 0, or ``None`` (the cost model's own error)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value < 0):
        raise AutoparError(
            f"extrapolation_margin must be a fraction >= 0 or None, got {value!r}",
            where="PlanOptions.extrapolation_margin",
            fix="e.g. 0.1 (an extrapolated plan must be predicted 10% faster), 0 for none, "
            "or None for the model's own error")
    return value


def constraint_tuple(name: str, value: Any) -> Any:
    """Parsed constraints: a tuple of :class:`Constraint`."""
    if not isinstance(value, tuple) or not all(isinstance(c, Constraint) for c in value):
        raise AutoparError(f"constraints must be a tuple of Constraint, got "
                           f"{value!r}", where="PlanOptions.constraints",
                           fix="parse text with autopar.core.constraints.parse_constraints")
    return value
