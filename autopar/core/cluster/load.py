"""Resolve a cluster from a shorthand, a preset name, a dict or a YAML/JSON file.

Values layer as default < preset < profile < the description's own, each remembering its
source. Files are read with ``yaml.safe_load``/``json``: loading never runs code."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autopar.core.cluster.presets import (
    DEFAULT_ATTENTION_EFFICIENCY,
    DEFAULT_KERNEL_FLOOR_S,
    DEFAULT_MEMORY_EFFICIENCY,
    DTYPES,
    GB,
    GIB,
    PRESETS,
    TFLOPS,
)
from autopar.core.cluster.profile import read_profile
from autopar.core.cluster.text import UniqueKeyLoader, parse_json, read_text, too_deep
from autopar.core.errors import AutoparError, ClusterError

if TYPE_CHECKING:
    pass

from autopar.core.cluster.spec import (
    _FILE_SUFFIXES,
    _LINKS,
    COLLECTIVE_KINDS,
    MAX_WORLD_SIZE,
    SHORTHAND_FORMS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    _check,
    _check_backend,
    _check_curve,
    _check_op_rates,
    _check_text,
    _field_order,
    check_size,
)

# ---- loading ------------------------------------------------------------------------------

# Unit-carrying user keys -> (field, check kind, conversion to base units).
_DEVICE_UNITS = {
    "memory_gib": ("memory_bytes", "positive", lambda v: round(v * GIB)),
    "memory_bytes": ("memory_bytes", "bytes", None),
    "memory_bandwidth_gb_per_s": ("memory_bandwidth_bytes_per_s", "positive", lambda v: v * GB),
    "memory_bandwidth_bytes_per_s": ("memory_bandwidth_bytes_per_s", "positive", None),
    "matmul_efficiency": ("matmul_efficiency", "fraction", None),
    "kernel_floor_us": ("kernel_floor_s", "nonnegative", lambda v: v / 1e6),
    "kernel_floor_s": ("kernel_floor_s", "nonnegative", None),
    "allocation_ns_per_byte": ("allocation_s_per_byte", "nonnegative", lambda v: v / 1e9),
    "allocation_s_per_byte": ("allocation_s_per_byte", "nonnegative", None),
    "memory_efficiency": ("memory_efficiency", "fraction", None),
    "attention_efficiency": ("attention_efficiency", "fraction", None),
    "corun_slowdown": ("corun_slowdown", "nonnegative", None),
    "memory_overlap": ("memory_overlap", "share", None),
    "fp8_matmul_efficiency": ("fp8_matmul_efficiency", "fraction", None),
    "generated_attention_forward": ("generated_attention_forward", "positive", None),
    "generated_attention_backward": ("generated_attention_backward", "positive", None),
    "sharded_host_us_per_tensor": ("sharded_host_s_per_tensor", "nonnegative",
                                   lambda v: v / 1e6),
    "sharded_host_s_per_tensor": ("sharded_host_s_per_tensor", "nonnegative", None),
    "sharded_optimizer_us_per_tensor": ("sharded_optimizer_s_per_tensor", "nonnegative",
                                        lambda v: v / 1e6),
    "sharded_optimizer_s_per_tensor": ("sharded_optimizer_s_per_tensor", "nonnegative", None),
    "view_us": ("view_s", "nonnegative", lambda v: v / 1e6),
    "view_s": ("view_s", "nonnegative", None),
    "speed_spread": ("speed_spread", "share", None),
}
_CURVE = "matmul_efficiency_curve"
_CURVES = (_CURVE, "attention_efficiency_curve")
_OP_RATES = {"op_s_per_element": 1.0, "op_ns_per_element": 1e-9}  # key -> to seconds
_PEAK_UNITS = {"peak_tflops": lambda v: v * TFLOPS, "peak_flops": None}
_LINK_UNITS = {
    "bandwidth_gb_per_s": ("bandwidth_bytes_per_s", "positive", lambda v: v * GB),
    "bandwidth_bytes_per_s": ("bandwidth_bytes_per_s", "positive", None),
    "latency_us": ("latency_s", "nonnegative", lambda v: v / 1e6),
    "latency_s": ("latency_s", "nonnegative", None),
    "busy_latency_us": ("busy_latency_s", "nonnegative", lambda v: v / 1e6),
    "busy_latency_s": ("busy_latency_s", "nonnegative", None),
}
_TOP_KEYS = (
    "name", "nodes", "devices_per_node", "cores_per_node", "backend", "profile", "device",
    *_LINKS, "sources", "constraints"
)  # fmt: skip
_DEVICE_KEYS = ("preset", "name", *_DEVICE_UNITS, *_PEAK_UNITS, *_CURVES, *_OP_RATES)

# Fields with a default when neither the description nor its preset sets them.
_DEFAULTS = {
    "backend": "nccl",
    "device.kernel_floor_s": DEFAULT_KERNEL_FLOOR_S,
    "device.memory_efficiency": DEFAULT_MEMORY_EFFICIENCY,
    "device.attention_efficiency": DEFAULT_ATTENTION_EFFICIENCY,
    "device.allocation_s_per_byte": 0.0,
    "device.corun_slowdown": 0.0,
    "device.memory_overlap": 1.0,
    "device.fp8_matmul_efficiency": 1.0,
    "device.generated_attention_forward": 1.0,
    "device.generated_attention_backward": 1.0,
    "device.sharded_host_s_per_tensor": 0.0,
    "device.sharded_optimizer_s_per_tensor": 0.0,
    f"device.{_CURVE}": (),
    "device.attention_efficiency_curve": (),
    "device.op_s_per_element": {},
    "device.view_s": 0.0,
    "device.speed_spread": 0.0,
    "intra_node.busy_latency_s": 0.0,
    "inter_node.busy_latency_s": 0.0,
}

# Fields a description must end up with (from the user or a preset) -> the key to add.
_REQUIRED = {
    "nodes": "nodes",
    "devices_per_node": "devices_per_node",
    "device.name": "device.name",
    "device.memory_bytes": "device.memory_gib",
    "device.peak_flops": "device.peak_tflops",
    "device.memory_bandwidth_bytes_per_s": "device.memory_bandwidth_gb_per_s",
    "device.matmul_efficiency": "device.matmul_efficiency",
    "intra_node.bandwidth_bytes_per_s": "intra_node_link.bandwidth_gb_per_s",
    "intra_node.latency_s": "intra_node_link.latency_us",
    "inter_node.bandwidth_bytes_per_s": "inter_node_link.bandwidth_gb_per_s",
    "inter_node.latency_s": "inter_node_link.latency_us",
}


@dataclass(frozen=True)
class _Origin:
    """Where a description comes from: starts error messages, ``where`` and source labels."""

    desc: str  # "cluster file 'c.yaml'"
    prefix: str  # "c.yaml: "
    label: str  # "file c.yaml"
    base_dir: Path = Path()  # relative paths inside the description (profile:) start here

    def where(self, path: str) -> str:
        return f"{self.prefix}{path or '(top level)'}"


def load_cluster(spec: Cluster | Mapping[str, Any] | str | os.PathLike[str]) -> Cluster:
    """Resolve a cluster from a ``Cluster``, a dict, a shorthand/preset name or a file path.

    >>> load_cluster("2xcpu").backend, load_cluster("h100-80gb").world_size
    ('gloo', 1)
    """
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Mapping):
        return _from_mapping(spec, _Origin("cluster dict", "", "dict"))
    if isinstance(spec, os.PathLike):
        return _from_file(Path(spec))
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower().endswith(_FILE_SUFFIXES):
            return _from_file(Path(text))
        if _SHORTHAND.fullmatch(text):
            return _from_shorthand(text)
        if os.path.isfile(text):
            return _from_file(Path(text))
        if os.path.isdir(text):
            raise ClusterError(
                f"cluster spec '{text}' is a directory",
                where="cluster spec",
                fix="name a .yaml, .yml or .json file in it, or a shorthand such as 8xH100-80GB",
            )
        raise ClusterError(
            f"cannot read {spec!r} as a cluster shorthand or file",
            where="cluster spec",
            fix=f"write {SHORTHAND_FORMS} with NAME one of {', '.join(PRESETS)}; "
            "or give a path ending in .yaml, .yml or .json",
        )
    raise ClusterError(
        f"cannot read a cluster from a value of type {type(spec).__name__}",
        where="cluster spec",
        fix=f"pass a Cluster, a dict, a .yaml/.yml/.json path, or a shorthand {SHORTHAND_FORMS}",
    )


_SHORTHAND = re.compile(r"(?:([0-9]+)x)?(?:([0-9]+)x)?([a-z][\w.-]*)", re.IGNORECASE | re.ASCII)


def _from_shorthand(text: str) -> Cluster:
    first, second, preset = _SHORTHAND.fullmatch(text).groups()
    origin = _Origin(f"shorthand '{text}'", f"shorthand '{text}': ", f"shorthand {text}")
    if any(g is not None and len(g) > 9 for g in (first, second)):
        raise ClusterError(
            f"shorthand '{text}' has a count of more than 9 digits",
            where="cluster spec",
            fix=f"at most {MAX_WORLD_SIZE} devices; write {SHORTHAND_FORMS}",
        )
    counts = [int(g) for g in (first, second) if g is not None]
    if any(n < 1 for n in counts):
        raise ClusterError(
            f"shorthand '{text}' has a count of 0",
            where="cluster spec",
            fix=f"node and device counts are >= 1; write {SHORTHAND_FORMS}",
        )
    nodes, per_node = ([1, 1] + counts)[-2:]
    preset = _preset_name(preset, origin, "preset")
    data = {
        "name": _default_name(nodes, per_node, preset),
        "nodes": nodes,
        "devices_per_node": per_node,
        "device": {"preset": preset},
    }
    return _from_mapping(data, origin)


def _from_file(path: Path) -> Cluster:
    shown = str(path)
    suffix = path.suffix.lower()
    if suffix not in _FILE_SUFFIXES:
        raise ClusterError(
            f"cluster file '{shown}' has an unknown extension",
            where=shown,
            fix="name it .yaml, .yml or .json",
        )
    text = read_text(path, "cluster file", fix_missing=f"check the path; or use a shorthand "
                     f"{SHORTHAND_FORMS} with NAME one of {', '.join(PRESETS)}")
    data = (parse_json(text, "cluster file", shown, _JSON_EXAMPLE) if suffix == ".json"
            else _parse_yaml(text, shown))
    origin = _Origin(f"cluster file '{shown}'", f"{shown}: ", f"file {shown}", path.parent)
    if data is None:
        raise ClusterError(
            f"cluster file '{shown}' is empty",
            where=shown,
            fix="write a mapping with nodes, devices_per_node and device (e.g. preset: H100-80GB)",
        )
    return _from_mapping(data, origin)


_JSON_EXAMPLE = ('an object such as {"nodes": 2, "devices_per_node": 8, "device": {"preset": '
                 '"H100-80GB"}}')


def _parse_yaml(text: str, shown: str) -> Any:
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise too_deep(f"cluster file '{shown}'", shown) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        problem = getattr(err, "problem", None) or str(err)
        raise ClusterError(
            f"cluster file '{shown}' is not valid YAML: {problem}",
            where=f"{shown}, {at}",
            fix="fix the YAML syntax there; the file is a mapping such as "
            "'nodes: 2', 'devices_per_node: 8', 'device: {preset: H100-80GB}'",
        ) from None


def _preset_name(name: Any, origin: _Origin, path: str) -> str:
    """The canonical preset name for ``name``, matched case-insensitively."""
    by_lower = {key.lower(): key for key in PRESETS}
    if isinstance(name, str) and name.strip().lower() in by_lower:
        return by_lower[name.strip().lower()]
    close = difflib.get_close_matches(str(name).lower(), by_lower, n=1, cutoff=0.5)
    hint = f"did you mean {by_lower[close[0]]}? " if close else ""
    raise ClusterError(
        f"{origin.desc}: unknown device preset {name!r}",
        where=origin.where(path),
        fix=f"{hint}use one of {', '.join(PRESETS)}",
    )


def _default_name(nodes: int, per_node: int, device: str) -> str:
    counts = f"{nodes}x{per_node}x" if nodes > 1 else f"{per_node}x" if per_node > 1 else ""
    return f"{counts}{device}"


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


def _from_mapping(data: Mapping[str, Any], origin: _Origin) -> Cluster:
    """Layer default < preset < profile < ``data``, recording each value's source, and build."""
    values: dict[str, Any] = dict(_DEFAULTS)
    sources: dict[str, str] = dict.fromkeys(_DEFAULTS, "default")
    device = data.get("device") if isinstance(data, Mapping) else None
    preset = device if isinstance(device, str) else None
    if isinstance(device, Mapping) and "preset" in device:
        preset = device["preset"]
    if preset is not None:
        name = _preset_name(preset, origin, "device.preset")
        preset_origin = _Origin(f"preset {name}", f"preset {name}: ", f"preset {name}")
        for key, value in _read(PRESETS[name], preset_origin).items():
            values[key], sources[key] = value, preset_origin.label
    if isinstance(data, Mapping) and "profile" in data:
        path = _profile_path(data["profile"], origin)
        try:
            profile = read_profile(path)
        except ClusterError as err:  # say which description names the profile
            raise ClusterError(f"{origin.desc}: {err.what}", where=origin.where(
                f"profile ({err.where})"), fix=err.fix) from None
        shown = str(path)
        profile_origin = _Origin(f"profile '{shown}'", f"{shown}: ", f"profile {shown}")
        for key, value in _read(profile.cluster_overrides(), profile_origin).items():
            values[key], sources[key] = value, profile_origin.label
    for key, value in _read(data, origin).items():
        values[key], sources[key] = value, origin.label

    missing = [
        user_key
        for key, user_key in _REQUIRED.items()
        if not any(k == key or k.startswith(key + ".") for k in values)
    ]
    if missing:
        needs_preset = any("." in k for k in missing)
        raise ClusterError(
            f"{origin.desc}: missing {', '.join(missing)}",
            where=origin.where(missing[0]),
            fix=f"add {', '.join(missing)}"
            + (f"; or set device.preset to one of {', '.join(PRESETS)}" if needs_preset else ""),
        )
    check_size(values["nodes"], values["devices_per_node"], origin.where)
    if "name" not in values:
        values["name"] = _default_name(
            values["nodes"], values["devices_per_node"], values["device.name"]
        )
        sources["name"] = "default"
    _apply_recorded_sources(data.get("sources"), sources, origin)

    def link(prefix: str) -> LinkSpec:
        return LinkSpec(values[f"{prefix}.bandwidth_bytes_per_s"], values[f"{prefix}.latency_s"],
                        values.get(f"{prefix}.busy_latency_s", 0.0),
                        values.get(f"{prefix}.per_kind", {}))

    def optional_link(prefix: str) -> LinkSpec | None:
        given = [k for k in ("bandwidth_bytes_per_s", "latency_s") if f"{prefix}.{k}" in values]
        if not given:
            return None
        if len(given) < 2:
            key = next(k for k, p in _LINKS.items() if p == prefix)
            missing = "bandwidth_gb_per_s" if given == ["latency_s"] else "latency_us"
            raise ClusterError(f"{origin.desc}: {key} gives {given[0]} but not the other",
                               where=origin.where(f"{key}.{missing}"),
                               fix=f"add {key}.{missing}, or leave {key} out")
        return link(prefix)

    peak = {k.rsplit(".", 1)[1]: v for k, v in values.items() if k.startswith("device.peak_flops.")}
    device_spec = DeviceSpec(
        name=values["device.name"],
        memory_bytes=values["device.memory_bytes"],
        peak_flops=peak,
        memory_bandwidth_bytes_per_s=values["device.memory_bandwidth_bytes_per_s"],
        matmul_efficiency=values["device.matmul_efficiency"],
        kernel_floor_s=values["device.kernel_floor_s"],
        memory_efficiency=values["device.memory_efficiency"],
        attention_efficiency=values["device.attention_efficiency"],
        matmul_efficiency_curve=values[f"device.{_CURVE}"],
        attention_efficiency_curve=values["device.attention_efficiency_curve"],
        allocation_s_per_byte=values["device.allocation_s_per_byte"],
        corun_slowdown=values["device.corun_slowdown"],
        memory_overlap=values["device.memory_overlap"],
        fp8_matmul_efficiency=values["device.fp8_matmul_efficiency"],
        generated_attention_forward=values["device.generated_attention_forward"],
        generated_attention_backward=values["device.generated_attention_backward"],
        sharded_host_s_per_tensor=values["device.sharded_host_s_per_tensor"],
        sharded_optimizer_s_per_tensor=values["device.sharded_optimizer_s_per_tensor"],
        op_s_per_element=values["device.op_s_per_element"],
        view_s=values["device.view_s"],
        speed_spread=values["device.speed_spread"],
    )
    return Cluster(
        nodes=values["nodes"],
        devices_per_node=values["devices_per_node"],
        device=device_spec,
        intra_node=link("intra_node"),
        inter_node=link("inter_node"),
        name=values["name"],
        backend=values["backend"],
        sources={key: sources[key] for key in sorted(sources, key=_field_order)
                 if key != "constraints"},
        cores_per_node=values.get("cores_per_node"),
        intra_node_uncontended=optional_link("intra_node_uncontended"),
        constraints=values.get("constraints", ()),
    )


def _constraints(value: Any, origin: _Origin) -> tuple[str, ...]:
    """A ``constraints:`` list of constraint texts (``autopar.core.constraints``), each read."""
    from autopar.core.constraints import parse_constraint

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


def _profile_path(value: Any, origin: _Origin) -> Path:
    """The profile a description names, relative to the cluster file that names it."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ClusterError(
            f"{origin.desc}: profile must be a path to a profile JSON file, got {value!r}",
            where=origin.where("profile"),
            fix="write profile: path/to/profile.json (from `autopar calibrate --out PROFILE`)",
        )
    path = Path(os.path.expanduser(value))  # "~nobody" stays as written
    return path if path.is_absolute() else origin.base_dir / path


def _apply_recorded_sources(recorded: Any, sources: dict[str, str], origin: _Origin) -> None:
    """Keep the provenance a saved cluster (``to_dict``) carries, instead of "dict"."""
    if recorded is None:
        return
    allowed = tuple(sources)
    recorded = _section(recorded, "sources", allowed, origin)
    for key, value in recorded.items():
        _check_text(value, f"sources.{key}", origin.where(f"sources.{key}"))
        sources[key] = value
