"""Reading one cluster description (the user's, a preset's, a profile's overrides) into its
fields by dotted name, in base units, every key and value checked on the way."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.core.cluster.checks import (
    _check,
    _check_backend,
    _check_curve,
    _check_op_rates,
    _check_text,
)
from autopar.core.cluster.keys import (
    _CURVES,
    _DEVICE_KEYS,
    _DEVICE_UNITS,
    _LINK_UNITS,
    _LINKS,
    _OP_RATES,
    _PEAK_UNITS,
    _TOP_KEYS,
)
from autopar.core.cluster.presets import DTYPES
from autopar.core.cluster.spec import COLLECTIVE_KINDS
from autopar.core.constraints import parse_constraint
from autopar.core.errors import AutoparError, ClusterError


@dataclass(frozen=True)
class _Origin:
    """Where a description comes from: starts error messages, ``where`` and source labels."""

    desc: str  # "cluster file 'c.yaml'"
    prefix: str  # "c.yaml: "
    label: str  # "file c.yaml"
    base_dir: Path = Path()  # relative paths inside the description (profile:) start here

    def where(self, path: str) -> str:
        return f"{self.prefix}{path or '(top level)'}"


def _section(data: Any, path: str, allowed: tuple[str, ...], origin: _Origin) -> Mapping:
    """``data`` as a mapping with only ``allowed`` keys, or an error naming the bad key."""
    if not isinstance(data, Mapping):
        raise ClusterError(
            f"{origin.desc}: {path or 'the description'} must be a mapping, "
            f"got {type(data).__name__}",
            where=origin.where(path or "(top level)"),
            fix=f"write key: value pairs with keys among {', '.join(allowed)}",
        )
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ClusterError(
                f"{origin.desc}: unknown key '{key}'" + (f" in {path}" if path else ""),
                where=origin.where(f"{path}.{key}" if path else str(key) or repr(key)),
                fix=f"{hint}allowed keys{' in ' + path if path else ''}: {', '.join(allowed)}",
            )
    return data


def _read(data: Any, origin: _Origin) -> dict[str, Any]:
    """The fields a description sets, by dotted name, in base units (presets not applied)."""
    data = _section(data, "", _TOP_KEYS, origin)
    out: dict[str, Any] = {}
    if "name" in data:
        _check_text(data["name"], "name", origin.where("name"), empty_ok=True)
        out["name"] = data["name"]
    for key in ("nodes", "devices_per_node", "cores_per_node"):
        if key in data:
            _check("count", data[key], key, origin.where(key))
            out[key] = data[key]
    if "backend" in data:
        _check_backend(data["backend"], origin.where("backend"))
        out["backend"] = data["backend"]
    if "constraints" in data:
        out["constraints"] = _constraints(data["constraints"], origin)
    device = data.get("device", {})
    device = {"preset": device} if isinstance(device, str) else device
    device = _section(device, "device", _DEVICE_KEYS, origin)
    if "name" in device:
        _check_text(device["name"], "device.name", origin.where("device.name"))
        out["device.name"] = device["name"]
    out.update(_read_units(device, "device", _DEVICE_UNITS, origin))
    for curve in _CURVES:
        if curve in device:
            path = f"device.{curve}"
            out[path] = _check_curve(device[curve], path, origin.where(path))
    rate_keys = [k for k in _OP_RATES if k in device]
    if len(rate_keys) > 1:
        _conflict("device", rate_keys, origin)
    for key in rate_keys:
        path = f"device.{key}"
        rates = _check_op_rates(device[key], path, origin.where(path))
        out["device.op_s_per_element"] = {op: (f * _OP_RATES[key], b * _OP_RATES[key])
                                          for op, (f, b) in rates.items()}
    peak_keys = [k for k in _PEAK_UNITS if k in device]
    if len(peak_keys) > 1:
        _conflict("device", peak_keys, origin)
    for key in peak_keys:
        peaks = _section(device[key], f"device.{key}", DTYPES, origin)
        for dtype, value in peaks.items():
            path = f"device.{key}.{dtype}"
            _check("positive", value, path, origin.where(path))
            convert = _PEAK_UNITS[key]
            out[f"device.peak_flops.{dtype}"] = convert(value) if convert else value
    for key, prefix in _LINKS.items():
        link = _section(data.get(key, {}), key, (*_LINK_UNITS, "per_kind"), origin)
        fields = _read_units(link, key, _LINK_UNITS, origin)
        out.update({f"{prefix}.{name.split('.', 1)[1]}": v for name, v in fields.items()})
        if "per_kind" in link:
            out[f"{prefix}.per_kind"] = _per_kind_fits(link["per_kind"], f"{key}.per_kind",
                                                       origin)
    return out


def _per_kind_fits(data: Any, path: str, origin: _Origin) -> dict[str, tuple[float, float]]:
    """A link's ``per_kind`` section: collective kind -> its own (bandwidth, latency) fit,
    each in the link's units (``bandwidth_gb_per_s`` or ``_bytes_per_s``, ``latency_us`` or
    ``_s``), both required."""
    units = {k: v for k, v in _LINK_UNITS.items() if not k.startswith("busy")}
    out = {}
    for kind, fit in _section(data, path, COLLECTIVE_KINDS, origin).items():
        fields = _read_units(_section(fit, f"{path}.{kind}", tuple(units), origin),
                             f"{path}.{kind}", units, origin)
        missing = [name for name in ("bandwidth_bytes_per_s", "latency_s")
                   if f"{path}.{kind}.{name}" not in fields]
        if missing:
            raise ClusterError(f"{origin.desc}: {path}.{kind} gives no {missing[0]}",
                               where=origin.where(f"{path}.{kind}"),
                               fix="give the kind's bandwidth and its latency")
        out[kind] = (fields[f"{path}.{kind}.bandwidth_bytes_per_s"],
                     fields[f"{path}.{kind}.latency_s"])
    return out


def _read_units(section: Mapping, path: str, units: dict, origin: _Origin) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field_name in dict.fromkeys(f for f, _, _ in units.values()):
        keys = [k for k, (f, _, _) in units.items() if f == field_name and k in section]
        if len(keys) > 1:
            _conflict(path, keys, origin)
        for key in keys:
            _, kind, convert = units[key]
            _check(kind, section[key], f"{path}.{key}", origin.where(f"{path}.{key}"))
            out[f"{path}.{field_name}"] = _in_base_units(section[key], convert, kind,
                                                         f"{path}.{key}", origin)
    return out


def _in_base_units(value: Any, convert: Any, kind: str, key: str, origin: _Origin) -> Any:
    """``value`` converted to base units, which must stay finite and (if positive) above 0."""
    try:
        converted = convert(value) if convert else value
    except OverflowError:
        converted = math.inf
    if not math.isfinite(converted):
        problem = "too large"
    elif kind == "positive" and converted <= 0:
        problem = "too small (it rounds to 0)"
    else:
        return converted
    raise ClusterError(f"{origin.desc}: {key} {value!r} is {problem}", where=origin.where(key),
                       fix=f"give {key} a realistic value")


def _conflict(path: str, keys: list[str], origin: _Origin) -> None:
    raise ClusterError(
        f"{origin.desc}: {' and '.join(keys)} in {path} give the same value twice",
        where=origin.where(f"{path}.{keys[1]}"),
        fix=f"keep one of {', '.join(keys)}",
    )


def _constraints(value: Any, origin: _Origin) -> tuple[str, ...]:
    """A ``constraints:`` list of constraint texts (``autopar.core.constraints``), each read."""
    if isinstance(value, str) or not isinstance(value, list):
        raise ClusterError(f"{origin.desc}: constraints must be a list of texts, got {value!r}",
                           where=origin.where("constraints"),
                           fix="write constraints: [\"tp<=4\", \"memory<=40GiB\"]")
    for i, text in enumerate(value):
        try:
            parse_constraint(text)
        except AutoparError as e:
            raise ClusterError(f"{origin.desc}: {e.what}", where=origin.where(
                f"constraints[{i}]"), fix=e.fix) from None
    return tuple(value)
