"""Cluster descriptions: all the cost models and the solver know of the hardware.

A cluster is ``nodes`` identical nodes of ``devices_per_node`` identical devices, with one
link model inside a node and one between nodes. Name one by shorthand or preset, or describe
it in a YAML/JSON file or dict whose values override a preset's:

>>> c = load_cluster("16x8xH100-80GB")
>>> c.world_size, c.device.peak("bf16") / 1e12, c.sources["device.memory_bytes"]
(128, 989.4, 'preset H100-80GB')
>>> load_cluster(c.to_dict()) == c
True

Every value remembers where it came from (``Cluster.sources``, keyed by dotted field name
such as ``intra_node.latency_s``); ``format_cluster`` prints values with units and sources
for ``autopar cluster show SPEC``. Files carry their units in key names (``memory_gib``,
``bandwidth_gb_per_s``, ``latency_us``; GB = 1e9 bytes, GiB = 2**30); ``to_dict`` writes
base units (``memory_bytes``, ``bandwidth_bytes_per_s``, ``latency_s``) so that plans
round-trip exactly. Files are read with ``yaml.safe_load``/``json``: loading never runs code.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autopar.cluster_presets import DTYPES, GB, GIB, PRESETS, TFLOPS
from autopar.errors import ClusterError

if TYPE_CHECKING:
    import torch

BACKENDS = ("nccl", "gloo")
SHORTHAND_FORMS = "NAME, DxNAME or NxDxNAME (e.g. H100-80GB, 8xH100-80GB, 16x8xA100-80GB, 2xcpu)"
_FILE_SUFFIXES = (".yaml", ".yml", ".json")

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
}  # fmt: skip


def dtype_key(dtype: str | torch.dtype) -> str:
    """The ``peak_flops`` key for a dtype: ``torch.bfloat16`` or ``"bfloat16"`` -> ``"bf16"``.

    >>> dtype_key("float32"), dtype_key("FP8")
    ('fp32', 'fp8')
    """
    text = str(dtype).strip().lower().removeprefix("torch.")
    if text not in _DTYPE_ALIASES:
        raise ClusterError(
            f"no peak FLOP/s is modelled for dtype {dtype!r}",
            where="dtype",
            fix=f"use one of {', '.join(DTYPES)} (or torch.float32, torch.bfloat16, "
            "torch.float16, torch.float8_*)",
        )
    return _DTYPE_ALIASES[text]


class _FrozenMap(Mapping):
    """A read-only, hashable, picklable dict, so the frozen dataclasses stay hashable."""

    def __init__(self, data: Mapping[str, Any] | None = None):
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return repr(self._data)


_RULES = {
    "count": "an integer >= 1",
    "bytes": "an integer > 0",
    "positive": "a number > 0",
    "nonnegative": "a number >= 0",
    "fraction": "a number in (0, 1]",
}


def _check(kind: str, value: Any, key: str, where: str) -> None:
    """Raise unless ``value`` is of ``kind`` (a key of ``_RULES``); shared by types and loader."""
    integral = kind in ("count", "bytes")
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int if integral else (int, float))
        and math.isfinite(value)
    )
    if ok:
        ok = {
            "count": value >= 1,
            "bytes": value > 0,
            "positive": value > 0,
            "nonnegative": value >= 0,
            "fraction": 0 < value <= 1,
        }[kind]
    if not ok:
        hint = ""
        if isinstance(value, str) and re.fullmatch(r"[-+]?[\d.]+e[-+]?\d+", value.strip(), re.I):
            hint = " (YAML reads 1e12 as text: write 1.0e+12)"
        raise ClusterError(
            f"{key} must be {_RULES[kind]}, got {value!r}{hint}",
            where=where,
            fix=f"set {key} to {_RULES[kind]}",
        )


def _check_text(value: Any, key: str, where: str, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        raise ClusterError(
            f"{key} must be a{'' if empty_ok else ' non-empty'} string, got {value!r}",
            where=where,
            fix=f"set {key} to a name such as 'H100-80GB'",
        )


def _check_backend(value: Any, where: str) -> None:
    if value not in BACKENDS:
        raise ClusterError(
            f"unknown backend {value!r}",
            where=where,
            fix=f"use one of {', '.join(BACKENDS)} (nccl for GPUs, gloo for cpu)",
        )


def _check_dtype(value: Any, where: str) -> None:
    if value not in DTYPES:
        raise ClusterError(
            f"unknown dtype key {value!r} in peak FLOP/s",
            where=where,
            fix=f"use dtype keys among {', '.join(DTYPES)}",
        )


@dataclass(frozen=True)
class DeviceSpec:
    """One device: the numbers the compute and memory models divide by."""

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float

    def __post_init__(self) -> None:
        _check_text(self.name, "name", "DeviceSpec.name")
        _check("bytes", self.memory_bytes, "memory_bytes", "DeviceSpec.memory_bytes")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ClusterError(
                f"peak_flops must be a non-empty mapping, got {self.peak_flops!r}",
                where="DeviceSpec.peak_flops",
                fix=f"give FLOP/s for at least one of {', '.join(DTYPES)}",
            )
        for key, value in self.peak_flops.items():
            _check_dtype(key, f"DeviceSpec.peak_flops.{key}")
            _check("positive", value, f"peak_flops.{key}", f"DeviceSpec.peak_flops.{key}")
        ordered = {k: self.peak_flops[k] for k in DTYPES if k in self.peak_flops}
        object.__setattr__(self, "peak_flops", _FrozenMap(ordered))
        _check(
            "positive",
            self.memory_bandwidth_bytes_per_s,
            "memory_bandwidth_bytes_per_s",
            "DeviceSpec.memory_bandwidth_bytes_per_s",
        )
        _check(
            "fraction", self.matmul_efficiency, "matmul_efficiency", "DeviceSpec.matmul_efficiency"
        )

    def peak(self, dtype: str | torch.dtype) -> float:
        """Dense peak FLOP/s in ``dtype``; an unsupported dtype is an error, never a guess."""
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            raise ClusterError(
                f"device {self.name} does not support {key} (no peak FLOP/s for it)",
                where=f"device.peak_flops.{key}",
                fix=f"use one of the dtypes it supports: {', '.join(self.peak_flops)}; or add "
                f"{key} under device.peak_tflops in a cluster file",
            )
        return self.peak_flops[key]


@dataclass(frozen=True)
class LinkSpec:
    """A link as collectives see it: per-device, one-direction bus bandwidth, and latency."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        _check(
            "positive",
            self.bandwidth_bytes_per_s,
            "bandwidth_bytes_per_s",
            "LinkSpec.bandwidth_bytes_per_s",
        )
        _check("nonnegative", self.latency_s, "latency_s", "LinkSpec.latency_s")


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of identical devices; ``sources`` says where each value came from."""

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    name: str = ""
    backend: str = "nccl"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check("count", self.nodes, "nodes", "Cluster.nodes")
        _check("count", self.devices_per_node, "devices_per_node", "Cluster.devices_per_node")
        for attr, cls in (
            ("device", DeviceSpec),
            ("intra_node", LinkSpec),
            ("inter_node", LinkSpec),
        ):
            if not isinstance(getattr(self, attr), cls):
                raise ClusterError(
                    f"{attr} must be a {cls.__name__}, got {type(getattr(self, attr)).__name__}",
                    where=f"Cluster.{attr}",
                    fix=f"pass a {cls.__name__}, or build the cluster with load_cluster()",
                )
        _check_text(self.name, "name", "Cluster.name", empty_ok=True)
        _check_backend(self.backend, "Cluster.backend")
        if not isinstance(self.sources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()
        ):
            raise ClusterError(
                "sources must map field names to strings",
                where="Cluster.sources",
                fix="e.g. {'device.memory_bytes': 'preset H100-80GB'}",
            )
        object.__setattr__(self, "sources", _FrozenMap(self.sources))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, in base units; ``load_cluster(c.to_dict()) == c``, sources included."""
        d = self.device
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "backend": self.backend,
            "device": {
                "name": d.name,
                "memory_bytes": d.memory_bytes,
                "peak_flops": dict(d.peak_flops),
                "memory_bandwidth_bytes_per_s": d.memory_bandwidth_bytes_per_s,
                "matmul_efficiency": d.matmul_efficiency,
            },
            "intra_node_link": _link_dict(self.intra_node),
            "inter_node_link": _link_dict(self.inter_node),
            "sources": dict(self.sources),
        }


def _link_dict(link: LinkSpec) -> dict[str, float]:
    return {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}


# ---- loading ------------------------------------------------------------------------------

# Unit-carrying user keys -> (field, check kind, conversion to base units).
_DEVICE_UNITS = {
    "memory_gib": ("memory_bytes", "positive", lambda v: round(v * GIB)),
    "memory_bytes": ("memory_bytes", "bytes", None),
    "memory_bandwidth_gb_per_s": ("memory_bandwidth_bytes_per_s", "positive", lambda v: v * GB),
    "memory_bandwidth_bytes_per_s": ("memory_bandwidth_bytes_per_s", "positive", None),
    "matmul_efficiency": ("matmul_efficiency", "fraction", None),
}
_PEAK_UNITS = {"peak_tflops": lambda v: v * TFLOPS, "peak_flops": None}
_LINK_UNITS = {
    "bandwidth_gb_per_s": ("bandwidth_bytes_per_s", "positive", lambda v: v * GB),
    "bandwidth_bytes_per_s": ("bandwidth_bytes_per_s", "positive", None),
    "latency_us": ("latency_s", "nonnegative", lambda v: v / 1e6),
    "latency_s": ("latency_s", "nonnegative", None),
}
_LINKS = {"intra_node_link": "intra_node", "inter_node_link": "inter_node"}
_TOP_KEYS = ("name", "nodes", "devices_per_node", "backend", "device", *_LINKS, "sources")
_DEVICE_KEYS = ("preset", "name", *_DEVICE_UNITS, *_PEAK_UNITS)

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

    def where(self, path: str) -> str:
        return f"{self.prefix}{path}"


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


_SHORTHAND = re.compile(r"(?:(\d+)x)?(?:(\d+)x)?([a-z][\w.-]*)", re.IGNORECASE)


def _from_shorthand(text: str) -> Cluster:
    first, second, preset = _SHORTHAND.fullmatch(text).groups()
    counts = [int(g) for g in (first, second) if g is not None]
    origin = _Origin(f"shorthand '{text}'", f"shorthand '{text}': ", f"shorthand {text}")
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
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClusterError(
            f"cluster file '{shown}' not found",
            where=shown,
            fix=f"check the path; or use a shorthand {SHORTHAND_FORMS} "
            f"with NAME one of {', '.join(PRESETS)}",
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ClusterError(
            f"cannot read cluster file '{shown}': {err}",
            where=shown,
            fix="pass a readable UTF-8 .yaml, .yml or .json file",
        ) from None
    data = _parse_json(text, shown) if suffix == ".json" else _parse_yaml(text, shown)
    origin = _Origin(f"cluster file '{shown}'", f"{shown}: ", f"file {shown}")
    if data is None:
        raise ClusterError(
            f"cluster file '{shown}' is empty",
            where=shown,
            fix="write a mapping with nodes, devices_per_node and device (e.g. preset: H100-80GB)",
        )
    return _from_mapping(data, origin)


def _parse_yaml(text: str, shown: str) -> Any:
    try:
        return yaml.safe_load(text)
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


def _parse_json(text: str, shown: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ClusterError(
            f"cluster file '{shown}' is not valid JSON: {err.msg}",
            where=f"{shown}, line {err.lineno}, column {err.colno}",
            fix='fix the JSON syntax there; the file is an object such as {"nodes": 2, '
            '"devices_per_node": 8, "device": {"preset": "H100-80GB"}}',
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
                where=origin.where(f"{path}.{key}" if path else str(key)),
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
    for key in ("nodes", "devices_per_node"):
        if key in data:
            _check("count", data[key], key, origin.where(key))
            out[key] = data[key]
    if "backend" in data:
        _check_backend(data["backend"], origin.where("backend"))
        out["backend"] = data["backend"]
    device = data.get("device", {})
    device = {"preset": device} if isinstance(device, str) else device
    device = _section(device, "device", _DEVICE_KEYS, origin)
    if "name" in device:
        _check_text(device["name"], "device.name", origin.where("device.name"))
        out["device.name"] = device["name"]
    out.update(_read_units(device, "device", _DEVICE_UNITS, origin))
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
        link = _section(data.get(key, {}), key, tuple(_LINK_UNITS), origin)
        fields = _read_units(link, key, _LINK_UNITS, origin)
        out.update({f"{prefix}.{name.split('.', 1)[1]}": v for name, v in fields.items()})
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
            value = section[key]
            out[f"{path}.{field_name}"] = convert(value) if convert else value
    return out


def _conflict(path: str, keys: list[str], origin: _Origin) -> None:
    raise ClusterError(
        f"{origin.desc}: {' and '.join(keys)} in {path} give the same value twice",
        where=origin.where(f"{path}.{keys[1]}"),
        fix=f"keep one of {', '.join(keys)}",
    )


def _from_mapping(data: Mapping[str, Any], origin: _Origin) -> Cluster:
    """Layer default < preset < ``data``, recording each value's source, and build."""
    values: dict[str, Any] = {"backend": "nccl"}
    sources: dict[str, str] = {"backend": "default"}
    device = data.get("device") if isinstance(data, Mapping) else None
    preset = device if isinstance(device, str) else None
    if isinstance(device, Mapping) and "preset" in device:
        preset = device["preset"]
    if preset is not None:
        name = _preset_name(preset, origin, "device.preset")
        preset_origin = _Origin(f"preset {name}", f"preset {name}: ", f"preset {name}")
        for key, value in _read(PRESETS[name], preset_origin).items():
            values[key], sources[key] = value, preset_origin.label
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
    if "name" not in values:
        values["name"] = _default_name(
            values["nodes"], values["devices_per_node"], values["device.name"]
        )
        sources["name"] = "default"
    _apply_recorded_sources(data.get("sources"), sources, origin)

    def link(prefix: str) -> LinkSpec:
        return LinkSpec(values[f"{prefix}.bandwidth_bytes_per_s"], values[f"{prefix}.latency_s"])

    peak = {k.rsplit(".", 1)[1]: v for k, v in values.items() if k.startswith("device.peak_flops.")}
    device_spec = DeviceSpec(
        name=values["device.name"],
        memory_bytes=values["device.memory_bytes"],
        peak_flops=peak,
        memory_bandwidth_bytes_per_s=values["device.memory_bandwidth_bytes_per_s"],
        matmul_efficiency=values["device.matmul_efficiency"],
    )
    return Cluster(
        nodes=values["nodes"],
        devices_per_node=values["devices_per_node"],
        device=device_spec,
        intra_node=link("intra_node"),
        inter_node=link("inter_node"),
        name=values["name"],
        backend=values["backend"],
        sources={key: sources[key] for key in sorted(sources, key=_field_order)},
    )


def _apply_recorded_sources(recorded: Any, sources: dict[str, str], origin: _Origin) -> None:
    """Keep the provenance a saved cluster (``to_dict``) carries, instead of "dict"."""
    if recorded is None:
        return
    allowed = tuple(sources)
    recorded = _section(recorded, "sources", allowed, origin)
    for key, value in recorded.items():
        _check_text(value, f"sources.{key}", origin.where(f"sources.{key}"))
        sources[key] = value


_ORDER = ["name", "nodes", "devices_per_node", "backend", "device.name", "device.memory_bytes"]
_ORDER += [f"device.peak_flops.{k}" for k in DTYPES]
_ORDER += ["device.memory_bandwidth_bytes_per_s", "device.matmul_efficiency"]
_ORDER += [f"{p}.{f}" for p in _LINKS.values() for f in ("bandwidth_bytes_per_s", "latency_s")]


def _field_order(key: str) -> int:
    return _ORDER.index(key) if key in _ORDER else len(_ORDER)


# ---- display ------------------------------------------------------------------------------


def _num(x: float) -> str:
    text = f"{x:.3f}".rstrip("0").rstrip(".")
    return text if text not in ("0", "-0") or x == 0 else f"{x:.3g}"


def format_cluster(cluster: Cluster) -> str:
    """Every resolved value with its unit and source: what ``autopar cluster show`` prints."""
    c, d = cluster, cluster.device

    def src(key: str) -> str:
        return c.sources.get(key, "-")

    rows: list[tuple[str, str, str | None, str]] = [  # label, value, unit (None: text), source
        ("name", c.name or "-", None, src("name")),
        ("nodes", str(c.nodes), "", src("nodes")),
        ("devices per node", str(c.devices_per_node), "", src("devices_per_node")),
        ("world size", str(c.world_size), "", "nodes x devices per node"),
        ("backend", c.backend, None, src("backend")),
        ("device", d.name, None, src("device.name")),
        ("  memory", _num(d.memory_bytes / GIB), "GiB", src("device.memory_bytes")),
    ]
    for dtype, flops in d.peak_flops.items():
        rows.append(
            (f"  peak {dtype}", _num(flops / TFLOPS), "TFLOP/s", src(f"device.peak_flops.{dtype}"))
        )
    unsupported = [k for k in DTYPES if k not in d.peak_flops]
    if unsupported:
        rows.append(("  unsupported", ", ".join(unsupported), None, "no peak FLOP/s given"))
    rows += [
        (
            "  memory bandwidth",
            _num(d.memory_bandwidth_bytes_per_s / GB),
            "GB/s",
            src("device.memory_bandwidth_bytes_per_s"),
        ),
        ("  matmul efficiency", _num(d.matmul_efficiency), "", src("device.matmul_efficiency")),
    ]
    for title, prefix, link in (
        ("intra-node link", "intra_node", c.intra_node),
        ("inter-node link", "inter_node", c.inter_node),
    ):
        rows += [
            (title, "", None, ""),
            (
                "  bandwidth",
                _num(link.bandwidth_bytes_per_s / GB),
                "GB/s",
                src(f"{prefix}.bandwidth_bytes_per_s"),
            ),
            ("  latency", _num(link.latency_s * 1e6), "µs", src(f"{prefix}.latency_s")),
        ]
    return _table(c, rows)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _table(c: Cluster, rows: list[tuple[str, str, str | None, str]]) -> str:
    """Align labels, numbers on their decimal point, units and sources in columns."""
    split = {i: r[1].partition(".") for i, r in enumerate(rows) if r[2] is not None}
    w_int = max(len(whole) for whole, _, _ in split.values())
    w_frac = max(len(dot + frac) for _, dot, frac in split.values())
    w_unit = max(len(r[2]) for r in rows if r[2] is not None)
    w_label = max(len(r[0]) for r in rows)
    w_value = max([w_int + w_frac + 1 + w_unit] + [len(r[1]) for r in rows if r[2] is None])
    head = (
        f"cluster {c.name or '-'}: {_plural(c.nodes, 'node')} x "
        f"{_plural(c.devices_per_node, 'device')} per node ({c.device.name}), "
        f"world size {c.world_size}, backend {c.backend}"
    )
    lines = [head, "", f"{'field':<{w_label}}  {'value':<{w_value}}  source"]
    for i, (label, value, unit, source) in enumerate(rows):
        if i in split:
            whole, dot, frac = split[i]
            value = f"{whole:>{w_int}}{dot + frac:<{w_frac}} {unit}"
        lines.append(f"{label:<{w_label}}  {value:<{w_value}}  {source}".rstrip())
    return "\n".join(lines)
