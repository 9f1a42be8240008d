"""The plan: every decision, as versioned JSON keyed by stable fx node names.

A plan is data. Loading one parses JSON and checks it; it never runs code. It round-trips
exactly (``Plan.from_json(p.to_json()) == p``). A plan records the fingerprint of the model
it was made for; applying it to another model fails with both fingerprints in the message.

Fields other tools read (keep them stable): ``schema_version``; ``mesh`` (axis -> size,
outer to inner); ``predicted.step_time_s``, ``predicted.peak_memory_bytes``,
``predicted.tflops_per_device``, ``predicted.tokens_per_s``; ``solver.status``,
``solver.wall_s``; ``model.params``, ``model.fingerprint``; ``cluster.devices``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import PlanError
from autopar.placements import Placement, parse_placement
from autopar.strategies.rule import Strategy

SCHEMA_VERSION = 2
MESH_AXES = ("pp", "dp", "cp", "tp")  # outer to inner; tp innermost (fastest links)

_REQUIRED = {
    "schema_version": int,
    "model": dict,
    "cluster": dict,
    "mesh": dict,
    "batch": dict,
    "training": dict,
    "strategies": dict,
    "params": dict,
    "predicted": dict,
    "solver": dict,
}


def strategy_to_json(s: Strategy) -> dict[str, Any]:
    out: dict[str, Any] = {"in": [str(p) for p in s.inputs], "out": [str(p) for p in s.outputs]}
    if s.local_impl:
        out["impl"] = s.local_impl
    return out


def strategy_from_json(data: dict[str, Any], where: str) -> Strategy:
    try:
        return Strategy(
            tuple(parse_placement(p) for p in data["in"]),
            tuple(parse_placement(p) for p in data["out"]),
            data.get("impl"),
        )
    except (KeyError, TypeError) as e:
        raise PlanError(
            f"malformed strategy {data!r}",
            where=where,
            fix='a strategy is {"in": [placements], "out": [placements]}',
        ) from e


@dataclass
class Plan:
    schema_version: int
    model: dict[str, Any]  # name, fingerprint, params, trainable_params
    cluster: dict[str, Any]  # the resolved cluster, plus "devices"
    mesh: dict[str, int]  # axis -> size, outer to inner
    batch: dict[str, int]  # global, microbatch, microbatches, seq, traced
    training: dict[str, Any]  # precision, optimizer, zero, recompute
    strategies: dict[str, dict[str, Any]]  # node name -> axis -> {"in": [...], "out": [...]}
    params: dict[str, dict[str, str]]  # parameter FQN -> axis -> stored placement
    predicted: dict[str, Any]
    solver: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)  # per-layer summary
    # pipeline stages (when mesh.pp > 1): schedule, virtual_stages, bubble_fraction,
    # chunks [{chunk, rank, layers: [first, last]}], stages [{rank, layers, times, memory}]
    pipeline: dict[str, Any] = field(default_factory=dict)
    unruled_ops: dict[str, int] = field(default_factory=dict)
    # attention sites: [{node, pattern, layer, what, fused, reason}] (fuse-attention pass)
    attention: list[dict[str, Any]] = field(default_factory=list)
    # why the plan is as it is where a user might not expect it: "tp" -> how tensor
    # parallelism is used (weights/work/batch split) and, for a pinned tp that shards no
    # weight or splits the batch, the modelled alternatives (autopar.solver.explain_tp)
    explanation: dict[str, Any] = field(default_factory=dict)

    # --- access ------------------------------------------------------------------------
    def strategy(self, node_name: str, axis: str) -> Strategy | None:
        entry = self.strategies.get(node_name, {}).get(axis)
        if entry is None:
            return None
        return strategy_from_json(entry, where=f"strategies.{node_name}.{axis}")

    def param_placement(self, fqn: str, axis: str) -> Placement | None:
        text = self.params.get(fqn, {}).get(axis)
        return parse_placement(text) if text is not None else None

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.mesh.values():
            n *= size
        return n

    # --- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"{source} is not a JSON object", where=source, fix="pass a plan file")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(
                f"{source} has schema version {version!r}; this autopar reads version "
                f"{SCHEMA_VERSION}",
                where="schema_version",
                fix="re-plan with this autopar (autopar plan ... --json FILE)",
            )
        for key, kind in _REQUIRED.items():
            if not isinstance(data.get(key), kind):
                raise PlanError(
                    f"{source} lacks field {key!r} (or it is not a {kind.__name__})",
                    where=key,
                    fix="re-plan with autopar plan ... --json FILE",
                )
        for axis, size in data["mesh"].items():
            if axis not in MESH_AXES or not isinstance(size, int) or size < 1:
                raise PlanError(
                    f"bad mesh entry {axis}={size!r} in {source}",
                    where=f"mesh.{axis}",
                    fix=f"axes are {', '.join(MESH_AXES)} with positive integer sizes",
                )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"{source} has unknown fields {unknown}",
                where=unknown[0],
                fix="plans are written by autopar; do not add fields by hand",
            )
        plan = cls(**data)
        for name, axes in plan.strategies.items():
            for axis, entry in axes.items():
                strategy_from_json(entry, where=f"strategies.{name}.{axis}")
        for fqn, axes in plan.params.items():
            for axis, text in axes.items():
                try:
                    parse_placement(text)
                except PlanError as e:
                    raise PlanError(e.what, where=f"params.{fqn}.{axis}", fix=e.fix) from None
        return plan

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{source} is not valid JSON: {e.msg}",
                where=f"{source}:{e.lineno}:{e.colno}",
                fix="pass a plan written by autopar plan --json",
            ) from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {path} not found", where=str(path), fix="check the path")
        return cls.from_json(path.read_text(), source=str(path))

    def check_model(self, fingerprint: str, model_name: str = "this model") -> None:
        """Fail clearly when this plan was made for another model."""
        if self.model.get("fingerprint") != fingerprint:
            raise PlanError(
                f"the plan was made for model {self.model.get('name')!r} (fingerprint "
                f"{self.model.get('fingerprint')}), but {model_name} has fingerprint "
                f"{fingerprint}",
                where="model.fingerprint",
                fix="re-plan for this model, or load the model the plan was made for",
            )
