"""The plan: every decision, as versioned JSON keyed by stable fx node names.

A plan is data. Loading one parses JSON and checks every field against the schema
(:mod:`autopar.core.plan_schema`); it never runs code. It round-trips
exactly (``Plan.from_json(p.to_json()) == p``). A plan records the fingerprint of the model
it was made for, and the cluster; applying it to another model or cluster fails with both
named in the message.

Fields other tools read (keep them stable): ``schema_version``; ``mesh`` (axis -> size,
outer to inner); ``predicted.step_time_s``, ``predicted.peak_memory_bytes``,
``predicted.tflops_per_device``, ``predicted.tokens_per_s``; ``solver.status``,
``solver.wall_s``; ``model.params``, ``model.fingerprint``; ``cluster.devices``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.core import json_data
from autopar.core.errors import PlanError
from autopar.core.placements import Placement, parse_placement
from autopar.core.plan_schema import CARVED_AXES, MESH_AXES, SCHEMA_VERSION, validate
from autopar.core.strategy import Strategy

if TYPE_CHECKING:
    from autopar.core.cluster import Cluster

__all__ = ["MESH_AXES", "SCHEMA_VERSION", "Plan", "strategy_from_json", "strategy_to_json"]
MAX_PLAN_BYTES = 256 << 20  # autopar's plans are a few MB even for 70B models
_FIX_FILE = "pass a plan file written by autopar plan MODEL --cluster ... --json FILE"


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
    # weight or splits the batch, the modelled alternatives (autopar.solver.explain.explain_tp)
    explanation: dict[str, Any] = field(default_factory=dict)
    # context parallelism when mesh.cp > 1: cp, algorithm, layout, pinned, the modelled
    # cost of each algorithm ("algorithms"), and why this one (autopar.solver.axes.context)
    context: dict[str, Any] = field(default_factory=dict)
    # per-node precision: fx node name -> "fp32" | "bf16" | "fp16" | "fp8" (every node that
    # makes a float), and the policy it came from: compute word, parameter dtype, user
    # overrides, and the nodes kept fp32 by reason (autopar.analysis.precision)
    precision: dict[str, str] = field(default_factory=dict)
    precision_policy: dict[str, Any] = field(default_factory=dict)
    # ops that couple the samples of the batch: [{node, op, kind ("statistic" |
    # "input_statistic" | "mixes_batch"), exact, where}] (autopar.analysis.batch_coupling); a
    # statistic is made whole over dp by the sync-batch-statistics pass, an input statistic
    # over the whole step (autopar.analysis.step_statistics)
    batch_coupled: list[dict[str, Any]] = field(default_factory=list)
    # the constraints the plan obeys, as text (autopar.core.constraints; a plugin's as it names
    # itself)
    constraints: list[str] = field(default_factory=list)

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
        """Ranks the plan runs on: the mesh's product (``ep`` is carved out of ``dp``)."""
        n = 1
        for axis, size in self.mesh.items():
            if axis not in CARVED_AXES:
                n *= size
        return n

    # --- text ----------------------------------------------------------------------------
    def __str__(self) -> str:
        """The summary ``autopar plan`` prints (``to_json()`` is the data)."""
        from autopar.core.plan_summary import format_plan

        return format_plan(self, self.model.get("name", "model"))

    def __repr__(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        step = self.predicted.get("step_time_s")
        return (f"<Plan {self.model.get('name', 'model')} on {self.cluster.get('name')}: "
                f"{mesh}, {step:.4g} s a step (modelled); str() for the summary>"
                if step is not None else f"<Plan {self.model.get('name', 'model')}: {mesh}>")

    # --- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> Plan:
        """The plan ``data`` holds, after :func:`autopar.core.plan_schema.validate` checked every
        field and the rules between them (``where`` names the field)."""
        validate(data, source)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        if not isinstance(text, str):
            raise PlanError(f"{source} is not text", where=source,
                            fix="pass the plan's JSON text (Plan.load reads a file)")
        try:
            data = json_data.loads(text)
        except json_data.DuplicateKey as e:
            raise PlanError(f"{source} gives key {e.key!r} twice in one object", where=e.key,
                            fix="keep one of them; plans are written by autopar plan --json"
                            ) from None
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{source} is not valid JSON: {e.msg}",
                where=f"{source}:{e.lineno}:{e.colno}",
                fix=_FIX_FILE,
            ) from None
        except (ValueError, RecursionError) as e:  # a 5,000-digit number; deep nesting
            raise PlanError(f"{source} cannot be read as a plan: {str(e)[:200]}",
                            where=source, fix=_FIX_FILE
                            ) from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file: JSON text, never unpickled or executed."""
        path = Path(path)
        if not path.exists():
            raise PlanError(f"plan file {path} not found", where=str(path), fix="check the path")
        if not path.is_file():
            raise PlanError(f"plan {path} is not a file", where=str(path), fix=_FIX_FILE)
        try:
            if path.stat().st_size > MAX_PLAN_BYTES:
                raise PlanError(f"plan file {path} is larger than {MAX_PLAN_BYTES >> 20} MiB",
                                where=str(path), fix=_FIX_FILE)
            raw = path.read_bytes()
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror or e}", where=str(path),
                            fix="check the path and its permissions") from None
        return cls.from_bytes(raw, source=str(path))

    @classmethod
    def from_bytes(cls, raw: bytes, source: str = "plan") -> Plan:
        """A plan from a file's bytes: UTF-8 JSON text (a binary file or a pickle is an
        error saying so; nothing is ever unpickled)."""
        if not raw.strip():
            raise PlanError(f"plan file {source} is empty", where=source, fix=_FIX_FILE)
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            kind = "a Python pickle" if raw[:1] == b"\x80" else "binary data"
            raise PlanError(f"plan file {source} is not UTF-8 text (it looks like {kind}, "
                            f"byte {e.start}); plans are JSON and are never unpickled",
                            where=source, fix=_FIX_FILE) from None
        return cls.from_json(text, source=source)

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

    def check_batch(self, batch: int | None, seq: int | None) -> None:
        """Fail clearly when the example inputs are not the batch the plan was made for: each
        rank's program is traced on the plan's microbatch of them, and the plan's split of
        the batch (dp x microbatch x microbatches) holds for that size only."""
        given = (batch or 1, seq or 1)
        planned = (self.batch["traced"], self.batch["seq"])
        if given != planned:
            raise PlanError(
                f"the plan was made for example batches of {planned[0]} sequence(s) of "
                f"{planned[1]} token(s), but these example inputs have {given[0]} of {given[1]}",
                where="batch.traced" if given[0] != planned[0] else "batch.seq",
                fix="pass example inputs of the plan's size, or re-plan for these",
            )

    def check_cluster(self, cluster: Cluster) -> None:
        """Fail clearly when this plan was made for another cluster.

        The same cluster means the same device kind (``device.name``: the preset, or a
        calibrated profile's name), node count, devices per node and backend: what the mesh,
        the memory fit and the process groups depend on. Link speeds and efficiencies may
        differ (a recalibrated profile of the same machines): they change the predictions,
        not what runs."""
        mine, given = _cluster_key(self.cluster), _cluster_key(cluster.to_dict())
        if mine != given:
            raise PlanError(
                f"the plan was made for cluster {self.cluster.get('name')!r} ({_describe(mine)})"
                f", but is applied to cluster {cluster.name!r} ({_describe(given)})",
                where="cluster",
                fix="re-plan for this cluster (autopar plan MODEL --cluster ...), or run on the "
                "cluster the plan was made for",
            )


def _cluster_key(cluster: dict[str, Any]) -> tuple[str, int, int, str]:
    return (cluster["device"]["name"], cluster["nodes"], cluster["devices_per_node"],
            cluster["backend"])


def _describe(key: tuple[str, int, int, str]) -> str:
    device, nodes, per_node, backend = key
    return f"{nodes} node(s) x {per_node} {device}, {backend}"
