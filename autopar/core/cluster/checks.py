"""The value rules cluster fields obey, shared by the types and the loader: counts, sizes,
fractions, curves, per-op rates, names, and the read-only map the frozen types hold."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from autopar.core.cluster.presets import DTYPES
from autopar.core.errors import ClusterError

if TYPE_CHECKING:
    import torch

BACKENDS = ("nccl", "gloo")

MAX_DEVICES_PER_NODE = 1024
"""Devices in one node at most: the largest NVLink domain built (GB200 NVL576) has 576."""

MAX_WORLD_SIZE = 2**20
"""Devices in a cluster at most: 10x the largest training clusters built. The planner
enumerates mesh shapes over the devices, so an accidental ``10**20`` must fail, not hang."""

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
    "share": "a number in [0, 1]",
}


def _finite(value: int | float) -> bool:
    """Finite as a float too: the cost models compute in floats (10**400 overflows them)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _check(kind: str, value: Any, key: str, where: str) -> None:
    """Raise unless ``value`` is of ``kind`` (a key of ``_RULES``); shared by types and loader."""
    integral = kind in ("count", "bytes")
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int if integral else (int, float))
        and _finite(value)
    )
    if ok:
        ok = {
            "count": value >= 1,
            "bytes": value > 0,
            "positive": value > 0,
            "nonnegative": value >= 0,
            "fraction": 0 < value <= 1,
            "share": 0 <= value <= 1,
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


def check_size(nodes: int, per_node: int, where: Callable[[str], str]) -> None:
    """Node and device counts within the limits autopar plans for (``where(key)`` locates
    a key in the user's description)."""
    if per_node > MAX_DEVICES_PER_NODE:
        raise ClusterError(
            f"devices_per_node {per_node} is above autopar's limit of {MAX_DEVICES_PER_NODE}",
            where=where("devices_per_node"),
            fix=f"use at most {MAX_DEVICES_PER_NODE} devices per node (the largest NVLink domain "
            "has 576)",
        )
    if nodes * per_node > MAX_WORLD_SIZE:
        raise ClusterError(
            f"{nodes} nodes x {per_node} devices = {nodes * per_node} devices is above autopar's "
            f"limit of {MAX_WORLD_SIZE}",
            where=where("nodes"),
            fix=f"describe at most {MAX_WORLD_SIZE} devices (10x the largest clusters built)",
        )


def _check_curve(value: Any, key: str, where: str) -> tuple[tuple[float, float], ...]:
    """``value`` as a matmul efficiency curve: ``((flops, efficiency), ...)``, FLOPs rising.

    Strictly rising FLOPs keep interpolation well defined; an empty curve is allowed and
    means "use the compute model's parametric curve"."""
    rule = "a list of [flops, efficiency] pairs with flops > 0 rising and efficiency in (0, 1]"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ClusterError(
            f"{key} must be {rule}, got {value!r}",
            where=where,
            fix=f"write {key}: [[1.0e+6, 0.3], [1.0e+9, 0.9]] (or [] for none)",
        )
    points: list[tuple[float, float]] = []
    for i, pair in enumerate(value):
        at = f"{where}[{i}]"
        if isinstance(pair, (str, bytes, Mapping)) or not isinstance(pair, (list, tuple)):
            pair = (pair,)
        if len(pair) != 2:
            raise ClusterError(
                f"{key}[{i}] must be a [flops, efficiency] pair, got {pair!r}",
                where=at,
                fix=f"write each point of {key} as [flops, efficiency]",
            )
        _check("positive", pair[0], f"{key}[{i}] flops", at)
        _check("fraction", pair[1], f"{key}[{i}] efficiency", at)
        if points and pair[0] <= points[-1][0]:
            raise ClusterError(
                f"{key} FLOPs must rise from point to point, but point {i} has "
                f"{pair[0]!r} after {points[-1][0]!r}",
                where=at,
                fix=f"sort the points of {key} by FLOPs and merge duplicates",
            )
        points.append((float(pair[0]), float(pair[1])))
    return tuple(points)


def _check_op_rates(value: Any, key: str, where: str) -> Mapping[str, tuple[float, float]]:
    """``value`` as per-element op rates: ``{op: [forward_s, backward_s]}``, ``op`` an aten
    op's name (``gelu``, ``layer_norm``), seconds per output element, each >= 0."""
    if not isinstance(value, Mapping):
        raise ClusterError(
            f"{key} must map op names to [forward, backward] seconds per element, got {value!r}",
            where=where,
            fix=f"write {key}: {{gelu: [1.5e-9, 2.7e-9]}} (or {{}} for none)",
        )
    rates: dict[str, tuple[float, float]] = {}
    for op, pair in value.items():
        at = f"{where}.{op}"
        if not isinstance(op, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", op):
            raise ClusterError(
                f"{key} has op name {op!r}; op names are aten names like 'gelu'",
                where=at, fix="name the op as aten does: lower case, digits and '_'")
        if isinstance(pair, (str, bytes, Mapping)) or not isinstance(pair, (list, tuple)) or (
                len(pair) != 2):
            raise ClusterError(
                f"{key}.{op} must be a [forward, backward] pair, got {pair!r}",
                where=at, fix=f"write {key}.{op} as [forward seconds, backward seconds]")
        _check("nonnegative", pair[0], f"{key}.{op} forward", at)
        _check("nonnegative", pair[1], f"{key}.{op} backward", at)
        rates[op] = (float(pair[0]), float(pair[1]))
    return _FrozenMap(rates)


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
