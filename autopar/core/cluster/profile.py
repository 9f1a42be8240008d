"""Calibrated profiles: what ``autopar calibrate`` measured, for cluster files to reference.

A profile is a JSON document (never a pickle; loading it runs no code)::

    {
      "format": "autopar-profile",
      "version": 1,
      "created": "2026-11-03T12:00:00+00:00",
      "host": {"hostname": "...", "cpu_count": 2, "torch_version": "2.13.0",
               "backend": "gloo", "threads_per_process": 1, ...},
      "device": {                               # overrides, base units
        "peak_flops": {"fp32": 1.69e11},        # FLOP/s per dtype key
        "matmul_efficiency": 0.98,              # at the largest measured matmul
        "matmul_efficiency_curve": [[8192.0, 0.04], ..., [1.7e10, 0.98]],
        "memory_bandwidth_bytes_per_s": 2.8e10,
        "memory_efficiency": 1.0,
        "kernel_floor_s": 2.0e-06,
        "corun_slowdown": 0.05,                 # per further process training at once
        "sharded_host_s_per_tensor": 4e-4,      # FSDP2's host work per tensor per step
        "sharded_optimizer_s_per_tensor": 6e-4  # stepping a DTensor over a plain tensor
      },
      "intra_node_link": {"bandwidth_bytes_per_s": 1.3e9, "latency_s": 1.2e-4,
                          "per_kind": {           # optional: kinds fitted on their own
                            "reduce_scatter": {"bandwidth_bytes_per_s": 4.6e8,
                                               "latency_s": 1.5e-4}}},
      "inter_node_link": {...},                 # optional
      "intra_node_link_uncontended": {...},     # optional: measured with as many processes
                                                # as cores, when --nproc is more than that
      "measurements": {...}                     # raw points, for people and plots
    }

Every section is optional except ``format`` and ``version``, and every field in ``device``
and the links is optional: a profile overrides what it measured and nothing else. A cluster
file names one with a top-level ``profile: path/to/profile.json`` (relative to the cluster
file); its values beat the preset's and lose to the file's own (see ``load_cluster``).
Unknown keys are errors, so a typo never silently keeps a preset number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.core.cluster.checks import _check, _check_curve, _check_op_rates, _FrozenMap
from autopar.core.cluster.presets import DTYPES
from autopar.core.cluster.spec import COLLECTIVE_KINDS
from autopar.core.cluster.text import parse_json, read_text
from autopar.core.errors import ClusterError

PROFILE_FORMAT = "autopar-profile"
PROFILE_VERSION = 1

_TOP_KEYS = (
    "format",
    "version",
    "created",
    "host",
    "device",
    "intra_node_link",
    "inter_node_link",
    "intra_node_link_uncontended",
    "measurements",
)
_DEVICE_KINDS = {
    "peak_flops": "peaks",
    "memory_bandwidth_bytes_per_s": "positive",
    "matmul_efficiency": "fraction",
    "matmul_efficiency_curve": "curve",
    "kernel_floor_s": "nonnegative",
    "memory_efficiency": "fraction",
    "attention_efficiency": "fraction",
    "attention_efficiency_curve": "curve",
    "allocation_s_per_byte": "nonnegative",
    "corun_slowdown": "nonnegative",
    "memory_overlap": "share",
    "fp8_matmul_efficiency": "fraction",
    "generated_attention_forward": "positive",
    "generated_attention_backward": "positive",
    "sharded_host_s_per_tensor": "nonnegative",
    "sharded_optimizer_s_per_tensor": "nonnegative",
    "op_s_per_element": "op_rates",
    "view_s": "nonnegative",
}
_LINK_KINDS = {"bandwidth_bytes_per_s": "positive", "latency_s": "nonnegative",
               "busy_latency_s": "nonnegative", "per_kind": "per_kind"}
_FIT_KINDS = {"bandwidth_bytes_per_s": "positive", "latency_s": "nonnegative"}
_HOST_KEYS = (
    "hostname",
    "platform",
    "cpu_count",
    "python_version",
    "torch_version",
    "device_type",
    "device_name",
    "backend",
    "nproc",
    "threads_per_process",
    "quick",
)
_LINK_SECTIONS = ("intra_node_link", "inter_node_link", "intra_node_link_uncontended")


@dataclass(frozen=True)
class Profile:
    """A validated profile; ``origin`` (the file, for messages) is not part of its value."""

    device: Mapping[str, Any] = field(default_factory=dict)
    intra_node_link: Mapping[str, float] = field(default_factory=dict)
    inter_node_link: Mapping[str, float] = field(default_factory=dict)
    intra_node_link_uncontended: Mapping[str, float] = field(default_factory=dict)
    host: Mapping[str, Any] = field(default_factory=dict)
    measurements: Mapping[str, Any] = field(default_factory=dict, hash=False)
    created: str = ""
    origin: str = field(default="profile", compare=False)

    def __post_init__(self) -> None:
        device = _keys(self.device, "device", tuple(_DEVICE_KINDS), self.origin)
        checked: dict[str, Any] = {}
        for key, value in device.items():
            checked[key] = _check_device_value(key, value, self.origin)
        object.__setattr__(self, "device", _FrozenMap(checked))
        for section in _LINK_SECTIONS:
            link = _keys(getattr(self, section), section, tuple(_LINK_KINDS), self.origin)
            for key, value in link.items():
                path = f"{section}.{key}"
                if key == "per_kind":  # collective kind -> its own fit
                    link[key] = _per_kind_section(value, path, self.origin)
                else:
                    _check(_LINK_KINDS[key], value, path, _where(self.origin, path))
            object.__setattr__(self, section, _FrozenMap(link))
        host = _keys(self.host, "host", _HOST_KEYS, self.origin)
        for key, value in host.items():
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise ClusterError(
                    f"{_desc(self.origin)}: host.{key} must be a string or number, got {value!r}",
                    where=_where(self.origin, f"host.{key}"),
                    fix="host describes the machine: write text or numbers only",
                )
        object.__setattr__(self, "host", _FrozenMap(host))
        if not isinstance(self.measurements, Mapping):
            raise ClusterError(
                f"{_desc(self.origin)}: measurements must be a mapping",
                where=_where(self.origin, "measurements"),
                fix="write measurements as an object of raw points (or leave it out)",
            )
        if not isinstance(self.created, str):
            raise ClusterError(
                f"{_desc(self.origin)}: created must be an ISO time string, got {self.created!r}",
                where=_where(self.origin, "created"),
                fix='write e.g. "created": "2026-11-03T12:00:00+00:00"',
            )

    def cluster_overrides(self) -> dict[str, Any]:
        """The profile as a partial cluster description in base units (what it overrides)."""
        out: dict[str, Any] = {}
        if self.device:
            out["device"] = _plain(self.device)
        for section in _LINK_SECTIONS:
            if getattr(self, section):
                out[section] = _plain(getattr(self, section))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON document; ``Profile.from_dict(p.to_dict()) == p``."""
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "created": self.created,
            "host": dict(self.host),
        }
        out.update(self.cluster_overrides())
        out["measurements"] = _plain(self.measurements)
        return out

    @classmethod
    def from_dict(cls, data: Any, origin: str = "profile") -> Profile:
        """Validate a parsed profile document; errors name ``origin`` and the field."""
        if not isinstance(data, Mapping):
            raise ClusterError(
                f"{_desc(origin)} must be a JSON object, got {type(data).__name__}",
                where=_where(origin, "(top level)"),
                fix="write it with `autopar calibrate --out PROFILE`",
            )
        if data.get("format") != PROFILE_FORMAT:
            raise ClusterError(
                f"{_desc(origin)} is not an autopar profile "
                f"(format {data.get('format')!r}, expected {PROFILE_FORMAT!r})",
                where=_where(origin, "format"),
                fix="point the cluster file's profile: at a file written by "
                "`autopar calibrate --out PROFILE`",
            )
        if data.get("version") != PROFILE_VERSION:
            raise ClusterError(
                f"{_desc(origin)} has version {data.get('version')!r}; this autopar reads "
                f"version {PROFILE_VERSION}",
                where=_where(origin, "version"),
                fix="re-run `autopar calibrate --out PROFILE` with this autopar",
            )
        _keys(data, "", _TOP_KEYS, origin)
        return cls(
            device=data.get("device", {}),
            intra_node_link=data.get("intra_node_link", {}),
            inter_node_link=data.get("inter_node_link", {}),
            intra_node_link_uncontended=data.get("intra_node_link_uncontended", {}),
            host=data.get("host", {}),
            measurements=data.get("measurements", {}),
            created=data.get("created", ""),
            origin=origin,
        )


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file (JSON only)."""
    shown = str(path)
    text = read_text(Path(path), "profile", fix_missing="check the path (a cluster file's "
                     "profile: is relative to the cluster file); or write one with `autopar "
                     "calibrate --out PROFILE`")
    data = parse_json(text, "profile", shown, "a profile written by `autopar calibrate --out "
                      "PROFILE`")
    return Profile.from_dict(data, origin=shown)


def write_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as indented JSON, creating parent folders; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
    return out


def _check_device_value(key: str, value: Any, origin: str) -> Any:
    path = f"device.{key}"
    kind = _DEVICE_KINDS[key]
    if kind == "curve":
        return _check_curve(value, path, _where(origin, path))
    if kind == "op_rates":
        return _check_op_rates(value, path, _where(origin, path))
    if kind == "peaks":
        peaks = _keys(value, path, DTYPES, origin)
        if not peaks:
            raise ClusterError(
                f"{_desc(origin)}: {path} is empty",
                where=_where(origin, path),
                fix=f"give FLOP/s for at least one of {', '.join(DTYPES)}, or leave it out",
            )
        for dtype, flops in peaks.items():
            _check("positive", flops, f"{path}.{dtype}", _where(origin, f"{path}.{dtype}"))
        return _FrozenMap({k: peaks[k] for k in DTYPES if k in peaks})
    _check(kind, value, path, _where(origin, path))
    return value


def _per_kind_section(data: Any, path: str, origin: str) -> _FrozenMap:
    """A link's per-kind fits: each collective kind's bandwidth and latency, checked."""
    fits = _keys(data, path, COLLECTIVE_KINDS, origin)
    out = {}
    for kind, fit in fits.items():
        fit = _keys(fit, f"{path}.{kind}", tuple(_FIT_KINDS), origin)
        for key, rule in _FIT_KINDS.items():
            where = f"{path}.{kind}.{key}"
            if key not in fit:
                raise ClusterError(f"{_desc(origin)}: {path}.{kind} has no {key}",
                                   where=_where(origin, where),
                                   fix="give both bandwidth_bytes_per_s and latency_s")
            _check(rule, fit[key], where, _where(origin, where))
        out[kind] = _FrozenMap(fit)
    return _FrozenMap(out)


def _keys(data: Any, path: str, allowed: tuple[str, ...], origin: str) -> dict[str, Any]:
    """``data`` as a dict with only ``allowed`` keys, or an error naming the bad key."""
    if not isinstance(data, Mapping):
        raise ClusterError(
            f"{_desc(origin)}: {path or 'the document'} must be a mapping, "
            f"got {type(data).__name__}",
            where=_where(origin, path or "(top level)"),
            fix=f"write an object with keys among {', '.join(allowed)}",
        )
    for key in data:
        if key not in allowed:
            raise ClusterError(
                f"{_desc(origin)}: unknown key '{key}'" + (f" in {path}" if path else ""),
                where=_where(origin, f"{path}.{key}" if path else str(key)),
                fix=f"allowed keys{' in ' + path if path else ''}: {', '.join(allowed)}",
            )
    return dict(data)


def _plain(value: Any) -> Any:
    """JSON-able copy: frozen maps to dicts, tuples to lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _desc(origin: str) -> str:
    return origin if origin == "profile" else f"profile '{origin}'"


def _where(origin: str, path: str) -> str:
    return path if origin == "profile" else f"{origin}: {path}"
