"""The registry of sharding rules: op -> rule.

Built-in rules register themselves when ``autopar.strategies`` is imported. A plugin adds
a rule for its own op (or replaces a built-in one) the same way::

    from autopar.strategies import register_rule, Strategy, replicate_all

    @register_rule(torch.ops.mylib.fused_gelu.default)
    def fused_gelu(call, axis_size):
        ...
        return [replicate_all(call), ...]

An op without a rule runs replicated; the plan counts such ops (``unruled_ops``) so a user
sees what the solver could not shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from autopar.core.strategy import OpCall, Rule, Strategy, replicate_all

_RULES: dict[Any, Rule] = {}
# rules for ops a model library defines when it is imported, by "namespace::name" (Hugging
# Face's ``transformers::grouped_mm_fallback``): no need to import the library first
_NAMED: dict[str, Rule] = {}


def register_rule(*targets: Any, replace: bool = False) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the sharding rule of each of ``targets``.

    A target is an aten ``OpOverload`` (``torch.ops.aten.add.Tensor``), an
    ``OpOverloadPacket`` (``torch.ops.aten.add``: every overload), or the name of a custom
    op another library defines (``"transformers::grouped_mm_fallback"``). Registering a target twice
    is an error unless ``replace=True``, so two plugins cannot silently fight over an op.
    """

    def decorate(fn: Rule) -> Rule:
        for target in targets:
            if isinstance(target, str):
                _NAMED[target] = fn
                continue
            keys = _expand(target)
            for key in keys:
                if key in _RULES and not replace and _RULES[key] is not fn:
                    raise ValueError(
                        f"a sharding rule for {key} is already registered "
                        f"({_RULES[key].__module__}.{_RULES[key].__name__}); "
                        "pass replace=True to override it"
                    )
                _RULES[key] = fn
        return fn

    return decorate


def _expand(target: Any) -> list[Any]:
    # An OpOverloadPacket stands for all its overloads.
    overloads = getattr(target, "overloads", None)
    if callable(overloads):
        return [getattr(target, name) for name in overloads()]
    return [target]


# Rules for whole kinds of op, by a property torch declares (its ``pointwise`` tag): an op
# of the kind without a rule of its own gets the kind's. Checked in order.
_KIND_RULES: list[tuple[Callable[[Any], bool], Rule]] = []


def register_kind_rule(belongs: Callable[[Any], bool]) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of every op ``belongs(op)`` holds for that has no rule
    of its own (``hardswish``, ``rsub``: any op torch tags pointwise)."""
    def register(fn: Rule) -> Rule:
        _KIND_RULES.append((belongs, fn))
        return fn
    return register


def rule_for(target: Any) -> Rule | None:
    rule = _RULES.get(target)
    if rule is None and _NAMED and hasattr(target, "name"):
        rule = _NAMED.get(target.name().removesuffix(".default"))
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = next((fn for belongs, fn in _KIND_RULES if belongs(target)), None)
    return rule


def registered() -> dict[Any, Rule]:
    """Every registered op and its rule (a copy)."""
    return dict(_RULES)


def has_rule(target: Any) -> bool:
    return rule_for(target) is not None


def strategies_for(call: OpCall, axis_size: int) -> list[Strategy]:
    """Every strategy for ``call`` on an axis of ``axis_size``; replicated if no rule.

    The replicated strategy comes first, and duplicates are dropped, so the order (and so
    the solver's result) is deterministic.
    """
    rule = rule_for(call.target)
    if rule is None or axis_size == 1:
        return [replicate_all(call)]
    try:
        key = _frozen((rule, call.target, call.args, call.kwargs, call.out, call.hints,
                       axis_size))
    except _Unkeyable:  # a node or an unhashable argument: ask the rule
        return _strategies(rule, call, axis_size)
    found = _KNOWN.get(key)
    if found is None:
        if len(_KNOWN) >= _KNOWN_MAX:
            _KNOWN.clear()
        found = _KNOWN[key] = tuple(_strategies(rule, call, axis_size))
    return list(found)


def _strategies(rule: Rule, call: OpCall, axis_size: int) -> list[Strategy]:
    base = replicate_all(call)
    out = [base]
    seen = {base}
    for strategy in rule(call, axis_size):
        if strategy not in seen:
            seen.add(strategy)
            out.append(strategy)
    return out


# A rule is a function of the call it is given: the strategies of a call seen before (each
# repeated layer makes the same calls, 80 times in Llama-3-70B) are the ones it gave then.
# The rule itself is part of the key, so a replaced rule is asked again.
_KNOWN: dict[tuple, tuple[Strategy, ...]] = {}
_KNOWN_MAX = 1 << 16


class _Unkeyable(Exception):
    """A call argument that cannot be part of a key (see :func:`_frozen`)."""


def _frozen(value: Any) -> Any:
    """``value`` as a hashable key (lists and dicts as tagged tuples); raises
    :class:`_Unkeyable` for a graph node (no other call shares it, and a key would keep its
    graph alive) or an unhashable value."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, Mapping):
        return ("dict", tuple(sorted(((k, _frozen(v)) for k, v in value.items()),
                                     key=lambda kv: repr(kv[0]))))
    if isinstance(value, fx.Node):
        raise _Unkeyable
    if isinstance(value, (bool, int, float)):
        return (type(value), value)  # True, 1 and 1.0 hash alike; a rule may tell them apart
    try:
        hash(value)
    except TypeError:
        raise _Unkeyable from None
    return value
