"""Resolve a cluster from a shorthand, a preset name, a dict or a YAML/JSON file.

Values layer as default < preset < profile < the description's own, each remembering its
source. Files are read with ``yaml.safe_load``/``json``: loading never runs code."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from autopar.core.cluster.checks import MAX_WORLD_SIZE, _check_text, check_size
from autopar.core.cluster.fields import _Origin, _read, _section
from autopar.core.cluster.keys import _CURVE, _DEFAULTS, _LINKS, _REQUIRED, _field_order
from autopar.core.cluster.presets import PRESETS
from autopar.core.cluster.profile import read_profile
from autopar.core.cluster.spec import Cluster, DeviceSpec, LinkSpec
from autopar.core.cluster.text import UniqueKeyLoader, parse_json, read_text, too_deep
from autopar.core.errors import ClusterError

SHORTHAND_FORMS = "NAME, DxNAME or NxDxNAME (e.g. H100-80GB, 8xH100-80GB, 16x8xA100-80GB, 2xcpu)"
_FILE_SUFFIXES = (".yaml", ".yml", ".json")


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
    text = str(name).strip().lower()
    # a family name ("h100") means its presets ("H100-80GB", "H100-96GB"), not the nearest
    # spelling ("H200")
    family = [key for low, key in by_lower.items() if low.split("-")[0] == text]
    close = family or [by_lower[c] for c in
                       difflib.get_close_matches(text, by_lower, n=1, cutoff=0.5)]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ClusterError(
        f"{origin.desc}: unknown device preset {name!r}",
        where=origin.where(path),
        fix=f"{hint}use one of {', '.join(PRESETS)}",
    )


def _default_name(nodes: int, per_node: int, device: str) -> str:
    counts = f"{nodes}x{per_node}x" if nodes > 1 else f"{per_node}x" if per_node > 1 else ""
    return f"{counts}{device}"


def _from_mapping(data: Mapping[str, Any], origin: _Origin) -> Cluster:
    """Layer default < preset < profile < ``data``, recording each value's source, and build."""
    values, sources = _layered(data, origin)
    _require(values, origin)
    check_size(values["nodes"], values["devices_per_node"], origin.where)
    if "name" not in values:
        values["name"] = _default_name(
            values["nodes"], values["devices_per_node"], values["device.name"]
        )
        sources["name"] = "default"
    _apply_recorded_sources(data.get("sources"), sources, origin)
    return Cluster(
        nodes=values["nodes"],
        devices_per_node=values["devices_per_node"],
        device=_device(values),
        intra_node=_link(values, "intra_node"),
        inter_node=_link(values, "inter_node"),
        name=values["name"],
        backend=values["backend"],
        sources={key: sources[key] for key in sorted(sources, key=_field_order)
                 if key != "constraints"},
        cores_per_node=values.get("cores_per_node"),
        intra_node_uncontended=_optional_link(values, "intra_node_uncontended", origin),
        constraints=values.get("constraints", ()),
    )


def _layered(data: Mapping[str, Any], origin: _Origin) -> tuple[dict[str, Any], dict[str, str]]:
    """Every field by dotted name, and the label of the layer that set it: the defaults, then
    the preset ``data`` names, its profile, and ``data`` itself, each over the one before."""
    values: dict[str, Any] = dict(_DEFAULTS)
    sources: dict[str, str] = dict.fromkeys(_DEFAULTS, "default")

    def put(fields: dict[str, Any], label: str) -> None:
        for key, value in fields.items():
            values[key], sources[key] = value, label

    device = data.get("device") if isinstance(data, Mapping) else None
    preset = device if isinstance(device, str) else None
    if isinstance(device, Mapping) and "preset" in device:
        preset = device["preset"]
    if preset is not None:
        name = _preset_name(preset, origin, "device.preset")
        preset_origin = _Origin(f"preset {name}", f"preset {name}: ", f"preset {name}")
        put(_read(PRESETS[name], preset_origin), preset_origin.label)
    if isinstance(data, Mapping) and "profile" in data:
        put(*_profile_fields(data["profile"], origin))
    put(_read(data, origin), origin.label)
    return values, sources


def _profile_fields(value: Any, origin: _Origin) -> tuple[dict[str, Any], str]:
    """The fields of the profile a description names, and the label they are sourced to."""
    path = _profile_path(value, origin)
    try:
        profile = read_profile(path)
    except ClusterError as err:  # say which description names the profile
        raise ClusterError(f"{origin.desc}: {err.what}", where=origin.where(
            f"profile ({err.where})"), fix=err.fix) from None
    shown = str(path)
    profile_origin = _Origin(f"profile '{shown}'", f"{shown}: ", f"profile {shown}")
    return _read(profile.cluster_overrides(), profile_origin), profile_origin.label


def _require(values: dict[str, Any], origin: _Origin) -> None:
    """Raise naming the keys to add unless every required field has a value."""
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


def _device(values: dict[str, Any]) -> DeviceSpec:
    """The device the layered ``device.*`` fields describe."""
    peak = {k.rsplit(".", 1)[1]: v for k, v in values.items() if k.startswith("device.peak_flops.")}
    return DeviceSpec(
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


def _link(values: dict[str, Any], prefix: str) -> LinkSpec:
    """The link the layered ``prefix.*`` fields describe."""
    return LinkSpec(values[f"{prefix}.bandwidth_bytes_per_s"], values[f"{prefix}.latency_s"],
                    values.get(f"{prefix}.busy_latency_s", 0.0),
                    values.get(f"{prefix}.per_kind", {}))


def _optional_link(values: dict[str, Any], prefix: str, origin: _Origin) -> LinkSpec | None:
    """The link ``prefix`` when the description gives it (both numbers), else None."""
    given = [k for k in ("bandwidth_bytes_per_s", "latency_s") if f"{prefix}.{k}" in values]
    if not given:
        return None
    if len(given) < 2:
        key = next(k for k, p in _LINKS.items() if p == prefix)
        missing = "bandwidth_gb_per_s" if given == ["latency_s"] else "latency_us"
        raise ClusterError(f"{origin.desc}: {key} gives {given[0]} but not the other",
                           where=origin.where(f"{key}.{missing}"),
                           fix=f"add {key}.{missing}, or leave {key} out")
    return _link(values, prefix)


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
