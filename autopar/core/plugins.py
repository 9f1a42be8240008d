"""Plugins: what installed packages add to autopar through entry points.

A package declares entry points in these groups (``pyproject.toml``)::

    [project.entry-points."autopar.passes"]
    my-pass = "my_pkg.passes:MyPass"          # a GraphPass subclass (runs_after = "...")
    [project.entry-points."autopar.rules"]
    my-op = "my_pkg.rules:register"           # a function that calls autopar.register_rule
    [project.entry-points."autopar.cost_models"]
    my-op-cost = "my_pkg.costs:register"      # a function that registers op costs
    [project.entry-points."autopar.constraints"]
    max-tp = "my_pkg.constraints:MaxTp"       # a Constraint subclass or factory

autopar discovers them once per process, on first use (:func:`discover`). An entry point
that fails to import, to construct or to register is reported once, by its name and its
package, with its error, and skipped: everything else runs. ``autopar plugins`` lists them.

>>> [e.group for e in discover() if e.status == "loaded"] == [
...     e.group for e in discover() if e.status == "loaded"]   # discovered once, cached
True
"""

from __future__ import annotations

import importlib.metadata as metadata
import warnings
from dataclasses import dataclass
from typing import Any

GROUPS = ("autopar.passes", "autopar.rules", "autopar.cost_models", "autopar.constraints")


class PluginWarning(UserWarning):
    """A plugin that could not be loaded (it is skipped; the rest of autopar runs)."""


@dataclass(frozen=True)
class Plugin:
    """One discovered entry point and what became of it."""

    group: str
    name: str  # the entry point's name
    target: str  # "module:attribute"
    package: str  # the distribution that declares it
    version: str
    status: str  # "loaded" or "failed"
    error: str = ""  # why it failed
    obj: Any = None  # the loaded object (a pass class, a constraint class, a function)

    @property
    def where(self) -> str:
        """Where a pass runs (``runs_after``/``runs_before``), for the listing."""
        if self.group != "autopar.passes" or self.obj is None:
            return ""
        after, before = getattr(self.obj, "runs_after", None), getattr(self.obj, "runs_before",
                                                                        None)
        parts = [f"after {after}" if after else "", f"before {before}" if before else ""]
        return ", ".join(p for p in parts if p) or "last"


_DISCOVERED: list[Plugin] | None = None


def discover(refresh: bool = False) -> list[Plugin]:
    """Every autopar entry point of the installed packages, loaded (rules and cost models
    registered); cached after the first call unless ``refresh``."""
    global _DISCOVERED
    if _DISCOVERED is not None and not refresh:
        return _DISCOVERED
    found = []
    for group in GROUPS:
        for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
            found.append(_load(group, ep))
    _DISCOVERED = found
    for plugin in found:
        if plugin.status == "failed":
            warnings.warn(f"autopar: skipped plugin {plugin.name!r} ({plugin.group}) from "
                          f"package {plugin.package} {plugin.version}: {plugin.error}",
                          PluginWarning, stacklevel=2)
    return found


def _load(group: str, ep: metadata.EntryPoint) -> Plugin:
    dist = getattr(ep, "dist", None)
    package = dist.name if dist is not None else "(unknown package)"
    version = dist.version if dist is not None else ""
    base = dict(group=group, name=ep.name, target=ep.value, package=package, version=version)
    try:
        obj = ep.load()
        _check(group, obj)
        if group in ("autopar.rules", "autopar.cost_models"):
            obj()  # registers the package's rules / op costs
    except Exception as e:  # noqa: BLE001 - a plugin's failure must not stop autopar
        return Plugin(**base, status="failed", error=f"{type(e).__name__}: {e}")
    return Plugin(**base, status="loaded", obj=obj)


def _check(group: str, obj: Any) -> None:
    from autopar.core.pass_contract import GraphPass

    if group == "autopar.passes":
        if not (isinstance(obj, type) and issubclass(obj, GraphPass)):
            raise TypeError(f"{obj!r} is not a GraphPass subclass")
        if not obj.name:
            raise TypeError(f"{obj.__qualname__} has no name")
        obj()  # constructs: a pass that cannot be built is reported here, not mid-program
    elif group == "autopar.constraints":
        from autopar.core.constraints import Constraint

        if not (isinstance(obj, type) and issubclass(obj, Constraint)) and not callable(obj):
            raise TypeError(f"{obj!r} is neither a Constraint subclass nor a factory")
    elif not callable(obj):
        raise TypeError(f"{obj!r} is not a function (it should register what it adds)")


def plugin_passes() -> list[type]:
    """The pass classes of the loaded ``autopar.passes`` plugins."""
    return [p.obj for p in discover() if p.group == "autopar.passes" and p.status == "loaded"]
