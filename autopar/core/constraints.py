"""Constraints the solver must obey: what a researcher says the plan may and may not be.

Built-ins, each also written as text (``--constraint``, a cluster file's ``constraints:``):

==============================  ====================================================
``tp<=4``, ``dp>=8``, ``pp==2``  a mesh axis' degree (``dp tp pp cp ep``; ``<= >= ==``)
``devices<=64``                  a device budget: use at most that many devices
``memory<=40GiB``                a per-device memory cap below the hardware's
``schedule in 1f1b,zb_v``        the pipeline schedules allowed
``cut after 11``                 a pipeline stage boundary after layer 11 (0-based)
``replicate lm_head``            a module's nodes and weights stay whole (no tp split)
``dtype lm_head=fp32``           a module computes in a given precision
==============================  ====================================================

Plugin constraints (entry-point group ``autopar.constraints``) subclass :class:`Constraint`
and use two hooks: :meth:`Constraint.allows` sees each candidate setting as a
:class:`SettingView` (mesh degrees, ZeRO stage, microbatching, schedule); and
:meth:`Constraint.restrict` adds CP-SAT constraints to each layout solve through a
:class:`LayoutView` (the model, and each decision's strategies as Boolean literals). Both
views are documented and stable.

When the constraints leave no plan, the error names the smallest set of them that conflict
(:mod:`autopar.solver.search.constraint_core`), not "no plan found".

>>> [str(c) for c in parse_constraints(["tp<=2", "memory<=40GiB", "cut after 3"])]
['tp<=2', 'memory<=40GiB', 'cut after 3']
>>> parse_constraint("tp<=2").allows(SettingView(dp=4, tp=4, pp=1))
False
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.core.errors import AutoparError
from autopar.core.units import format_bytes

AXES = ("dp", "tp", "pp", "cp", "ep")
_OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConstraintError(AutoparError):
    """A constraint is malformed, or the constraints leave no plan."""


@dataclass(frozen=True)
class SettingView:
    """One candidate setting as constraints see it (stable: fields are only ever added)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatch: int = 1  # sequences per microbatch on one data-parallel rank
    microbatches: int = 1
    schedule: str | None = None  # the pipeline schedule; None without pipeline stages
    virtual: int = 1  # chunks per pipeline rank
    recompute: str = "none"

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


@dataclass(frozen=True)
class DecisionView:
    """One decision of a layout solve: nodes that share a strategy (the same op in every
    repeat of a layer: restricting one restricts them all), and each strategy's literal
    (exactly one is true)."""

    name: str  # the first node's name
    nodes: tuple[str, ...]
    module_paths: tuple[str, ...]  # the modules the nodes come from ("model.layers.3.mlp")
    layer: int | None  # the repeated layer of the first node, None outside layers
    op: str  # the op, e.g. "aten.linear.default"
    choices: tuple[tuple[str, Any], ...]  # (strategy as text, its CP-SAT literal)
    replicated: tuple[bool, ...]  # per choice: everything whole on the tp axis


@dataclass
class LayoutView:
    """What :meth:`Constraint.restrict` may use: ``model`` (an OR-Tools ``CpModel``), the
    setting being solved, and its decisions."""

    model: Any
    setting: SettingView
    decisions: list[DecisionView] = field(default_factory=list)

    def forbid(self, decision: DecisionView, index: int) -> None:
        """Rule out one strategy of ``decision``."""
        self.model.Add(decision.choices[index][1] == 0)


class Constraint:
    """Subclass and override the hooks that apply. ``str(constraint)`` names it in
    messages, so make it what a user would write."""

    def allows(self, setting: SettingView) -> bool:
        """Whether a candidate setting may be the plan's."""
        return True

    def restrict(self, layout: LayoutView) -> None:
        """Add CP-SAT constraints to one layout solve."""

    def __str__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Degree(Constraint):
    """A mesh axis' degree: ``Degree("tp", "<=", 4)``."""

    axis: str
    op: str
    value: int

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise ConstraintError(f"unknown mesh axis {self.axis!r} in a constraint",
                                  where=str(self), fix=f"use one of {', '.join(AXES)}")
        if self.op not in _OPS:
            raise ConstraintError(f"unknown comparison {self.op!r}", where=str(self),
                                  fix="use <=, >= or ==")
        _positive(self.value, str(self))

    def allows(self, setting: SettingView) -> bool:
        return _OPS[self.op](getattr(setting, self.axis), self.value)

    def __str__(self) -> str:
        return f"{self.axis}{self.op}{self.value}"


@dataclass(frozen=True)
class DeviceBudget(Constraint):
    """Use at most ``devices`` of the cluster's devices."""

    devices: int

    def __post_init__(self) -> None:
        _positive(self.devices, str(self))

    def allows(self, setting: SettingView) -> bool:
        return setting.devices <= self.devices

    def __str__(self) -> str:
        return f"devices<={self.devices}"


@dataclass(frozen=True)
class MemoryCap(Constraint):
    """Each device may hold at most ``bytes`` (below its hardware memory)."""

    bytes: float

    def __post_init__(self) -> None:
        if not isinstance(self.bytes, (int, float)) or self.bytes <= 0:
            raise ConstraintError(f"a memory cap must be a positive size, got {self.bytes!r}",
                                  where="memory<=...", fix="e.g. memory<=40GiB")

    def __str__(self) -> str:
        return f"memory<={_size_text(self.bytes)}"


@dataclass(frozen=True)
class Schedules(Constraint):
    """The pipeline schedules a plan may run."""

    allowed: tuple[str, ...]

    def __post_init__(self) -> None:
        from autopar.core.knobs import RUNNABLE_SCHEDULES, schedule_name

        try:
            names = tuple(schedule_name(s) for s in self.allowed)
        except AutoparError as e:
            raise ConstraintError(e.what, where=str(self), fix=e.fix) from None
        bad = [s for s in names if s not in RUNNABLE_SCHEDULES]
        if bad or not names:
            raise ConstraintError(f"unknown schedule(s) {bad or '(none)'} in a constraint",
                                  where=str(self),
                                  fix=f"allow some of {', '.join(RUNNABLE_SCHEDULES)}")
        object.__setattr__(self, "allowed", names)

    def allows(self, setting: SettingView) -> bool:
        return setting.pp == 1 or setting.schedule in self.allowed

    def __str__(self) -> str:
        return f"schedule in {','.join(self.allowed)}"


@dataclass(frozen=True)
class StageCut(Constraint):
    """A pipeline stage ends after layer ``after`` (0-based, in the order layers run)."""

    after: int

    def __post_init__(self) -> None:
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0:
            raise ConstraintError(f"a stage cut is after a layer index >= 0, got "
                                  f"{self.after!r}", where="cut after ...", fix="e.g. cut after 3")

    def allows(self, setting: SettingView) -> bool:
        return setting.pp > 1

    def __str__(self) -> str:
        return f"cut after {self.after}"


@dataclass(frozen=True)
class Replicated(Constraint):
    """Every node of a module (and so its weights) stays whole on the tensor-parallel axis.
    ``module`` matches a module path, or a part of one between dots (``lm_head``,
    ``layers.3.mlp``). A node of a repeated layer shares its strategy with its repeats, so
    keeping one layer's whole keeps every repeat's whole."""

    module: str

    def restrict(self, layout: LayoutView) -> None:
        for decision in layout.decisions:
            if any(_in_module(path, self.module) for path in decision.module_paths):
                for i, whole in enumerate(decision.replicated):
                    if not whole:
                        layout.forbid(decision, i)

    def __str__(self) -> str:
        return f"replicate {self.module}"


@dataclass(frozen=True)
class ModuleDtype(Constraint):
    """A module computes in ``dtype`` (a precision word: fp32, bf16, fp16, fp8); applied as
    the plan's ``precision_overrides``."""

    module: str
    dtype: str

    def __post_init__(self) -> None:
        from autopar.core.knobs import PRECISIONS as WORDS

        if self.dtype not in WORDS:
            raise ConstraintError(f"unknown dtype {self.dtype!r} in a constraint",
                                  where=str(self), fix=f"use one of {', '.join(WORDS)}")

    def __str__(self) -> str:
        return f"dtype {self.module}={self.dtype}"


def _in_module(path: str, module: str) -> bool:
    """Whether ``module`` is ``path`` or a part of it between dots."""
    return f".{module}." in f".{path}."


def _positive(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConstraintError(f"expected a positive integer, got {value!r}", where=where,
                              fix="e.g. tp<=4")


def _size_text(nbytes: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return format_bytes(nbytes).replace(" ", "")


_GRAMMAR = ("tp<=4, dp>=2, pp==2, devices<=64, memory<=40GiB, 'schedule in 1f1b,zb_v', "
            "'cut after 11', 'replicate lm_head', 'dtype lm_head=fp32', or the name of an "
            "installed constraint plugin (autopar plugins)")


def parse_constraint(text: str) -> Constraint:
    """One constraint from its text (see the module's table)."""
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError(f"a constraint must be non-empty text, got {text!r}",
                              where="constraints", fix=f"write one of: {_GRAMMAR}")
    s = " ".join(text.strip().split())
    m = re.fullmatch(r"(\w+)\s*(<=|>=|==)\s*(\S+)", s)
    if m:
        name, op, value = m.groups()
        if name == "memory":
            if op != "<=":
                raise ConstraintError(f"a memory cap is an upper bound: {text!r}",
                                      where=text, fix="write memory<=40GiB")
            return MemoryCap(_parse_size(value, text))
        number = _parse_int(value, text)
        if name == "devices":
            if op != "<=":
                raise ConstraintError(f"a device budget is an upper bound: {text!r}",
                                      where=text, fix="write devices<=64 (or pin devices=)")
            return DeviceBudget(number)
        if name in AXES:
            return Degree(name, op, number)
        raise ConstraintError(f"unknown name {name!r} in constraint {text!r}", where=text,
                              fix=f"constrain one of {', '.join(AXES)}, devices or memory")
    m = re.fullmatch(r"schedules? in (\S+)", s)
    if m:
        return Schedules(tuple(p for p in m.group(1).split(",") if p))
    m = re.fullmatch(r"cut after(?: layer)? (\S+)", s)
    if m:
        return StageCut(_parse_int(m.group(1), text, lo=0))
    m = re.fullmatch(r"replicate (\S+)", s)
    if m:
        return Replicated(m.group(1))
    m = re.fullmatch(r"dtype (\S+)\s*=\s*(\S+)", s)
    if m:
        return ModuleDtype(m.group(1), m.group(2))
    found = _plugin_constraint(s)
    if found is not None:
        return found
    raise ConstraintError(f"cannot read constraint {text!r}", where=text,
                          fix=f"write one of: {_GRAMMAR}")


def _plugin_constraint(text: str) -> Constraint | None:
    """``NAME [ARG]``: the ``autopar.constraints`` plugin of that entry-point name, made
    with ARG (text) when given."""
    from autopar.core.plugins import discover

    name, _, arg = text.partition(" ")
    for plugin in discover():
        if plugin.group == "autopar.constraints" and plugin.name == name and plugin.obj:
            try:
                made = plugin.obj(arg) if arg else plugin.obj()
            except Exception as e:  # noqa: BLE001 - a plugin's error, named
                raise ConstraintError(f"constraint plugin {name!r} (package {plugin.package}) "
                                      f"failed on {text!r}: {type(e).__name__}: {e}",
                                      where=text, fix="see the plugin's documentation") from e
            if not isinstance(made, Constraint):
                raise ConstraintError(f"constraint plugin {name!r} (package {plugin.package}) "
                                      f"made {made!r}, not a Constraint", where=text,
                                      fix="report it to the plugin's authors")
            return made
    return None


def parse_constraints(items: Iterable[Constraint | str] | None) -> tuple[Constraint, ...]:
    """Constraints from objects and/or text, checked."""
    out = []
    for item in items or ():
        if isinstance(item, Constraint):
            out.append(item)
        elif isinstance(item, str):
            out.append(parse_constraint(item))
        else:
            raise ConstraintError(f"a constraint is a Constraint or its text, got {item!r}",
                                  where="constraints", fix=f"e.g. {_GRAMMAR}")
    return tuple(out)


def _parse_int(value: str, text: str, lo: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < lo:
        raise ConstraintError(f"{value!r} in constraint {text!r} is not an integer >= {lo}",
                              where=text, fix=f"e.g. {_GRAMMAR}")
    return number


def _parse_size(value: str, text: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConstraintError(f"cannot read the size {value!r} in {text!r}", where=text,
                              fix="write a size such as 40GiB, 512MiB or 80GB")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def memory_cap(constraints: Sequence[Constraint]) -> MemoryCap | None:
    """The tightest memory cap among ``constraints``."""
    caps = [c for c in constraints if isinstance(c, MemoryCap)]
    return min(caps, key=lambda c: c.bytes) if caps else None


def stage_cuts(constraints: Sequence[Constraint]) -> frozenset[int]:
    """Layer counts before each required stage boundary (``cut after k``: k + 1)."""
    return frozenset(c.after + 1 for c in constraints if isinstance(c, StageCut))


def check_stage_cuts(constraints: Sequence[Constraint], n_layers: int) -> None:
    """A stage cut must leave a layer on each side: refused before any search."""
    for c in constraints:
        if isinstance(c, StageCut) and c.after + 1 >= n_layers:
            raise ConstraintError(
                f"{c}: the model has {n_layers} repeated layer(s) (0 to {n_layers - 1}), so "
                "no stage can start after it", where=str(c),
                fix=f"cut after a layer from 0 to {n_layers - 2}" if n_layers > 1 else
                "drop it: a model with one layer has no pipeline")
