"""The program of passes that turns a traced graph into one rank's program for a plan.

The built-in passes are listed once, in the order they run, each with when a plan needs it
(torchtitan's ``parallelize_llama``: ``if enabled: apply_x``). Tensor parallelism first;
then batch statistics, the mean loss, experts, the chunked loss, fused attention kernels
and the plan's per-node precision (cast after the passes that replace nodes and before
layers are outlined: a layer's weight casts run inside it); layer modules when FSDP2 gathers
them, when checkpointing reruns them, or when pipeline stages are cut between them (after
giving each layer its own copy of what it reads that is made from the inputs alone); the
checkpointing; the pipeline split. Every program computes its cross-entropy chunked where
the plan says so (the memory model prices it so). Plugins and ``parallelize(passes=...)``
place their passes by name against this list (``runs_after``/``runs_before``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from autopar.core.errors import AutoparError, PassError
from autopar.core.pass_contract import GraphPass
from autopar.core.plan import Plan
from autopar.core.plugins import plugin_passes
from autopar.passes.cast_precision import CastPrecision
from autopar.passes.checkpoint_layers import CheckpointLayers
from autopar.passes.chunked_loss import ChunkedLoss
from autopar.passes.expert_parallel import ExpertParallel
from autopar.passes.fuse_attention import FuseAttention
from autopar.passes.hoist_weight_casts import HoistWeightCasts
from autopar.passes.infra import get_pass
from autopar.passes.insert_collectives import InsertCollectives
from autopar.passes.localize_shapes import LocalizeShapes
from autopar.passes.mean_loss import MeanLoss
from autopar.passes.outline_experts import OutlineExperts
from autopar.passes.outline_layers import OutlineLayers
from autopar.passes.pipeline_split import PipelineSplit
from autopar.passes.place_created_tensors import PlaceCreatedTensors
from autopar.passes.recompute_inputs import RecomputeInputs
from autopar.passes.shard_parameters import ShardParameters
from autopar.passes.substitute_local_ops import SubstituteLocalOps
from autopar.passes.sync_batch_statistics import SyncBatchStatistics, needs_sync


def _always(plan: Plan) -> bool:
    return True


def _pipelined(plan: Plan) -> bool:
    return plan.mesh.get("pp", 1) > 1


def _recomputes(plan: Plan) -> bool:
    return plan.training.get("recompute", "none") != "none"


def _outlines_layers(plan: Plan) -> bool:
    """FSDP2 gathers layers as modules (ZeRO over ranks averaging gradients), checkpointing
    reruns them, pipeline stages are cut between them."""
    data = plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1)  # ranks averaging gradients
    return (plan.training.get("zero", 0) >= 1 and data > 1) or _recomputes(plan) or _pipelined(
        plan)


PROGRAM: tuple[tuple[type[GraphPass], Callable[[Plan], bool]], ...] = (
    (ShardParameters, _always),
    (LocalizeShapes, _always),
    (SubstituteLocalOps, _always),
    (InsertCollectives, _always),
    (SyncBatchStatistics, needs_sync),
    (MeanLoss, _always),
    (ExpertParallel, lambda plan: plan.mesh.get("ep", 1) > 1),
    (ChunkedLoss, lambda plan: plan.training.get("chunked_loss", True)),
    (FuseAttention, lambda plan: any(entry.get("fused") for entry in plan.attention)),
    (CastPrecision, lambda plan: any(word != "fp32" for word in plan.precision.values())),
    (PlaceCreatedTensors, _always),  # before outlining: layers copy the nodes
    (RecomputeInputs, _pipelined),  # before outlining: stages then carry no masks, only inputs
    (OutlineLayers, _outlines_layers),
    (OutlineExperts, lambda plan: plan.training.get("zero", 0) == 3
     and plan.mesh.get("ep", 1) > 1),  # FSDP2 shards experts as modules
    (HoistWeightCasts, lambda plan: plan.training.get("compile", False)),  # one graph a layer
    (CheckpointLayers, _recomputes),
    (PipelineSplit, _pipelined),
)
"""Every built-in pass, in the order it runs, with when a plan needs it."""

BUILTIN_ORDER = tuple(cls.name for cls, _ in PROGRAM)
"""The built-in passes' names in order. A program holds only some of them; an added pass
anchored on one the program lacks runs where that one would have run."""

_SHARDING = (ShardParameters, LocalizeShapes, SubstituteLocalOps, InsertCollectives)


def sharding_passes() -> list[GraphPass]:
    """The tensor-parallel passes, in order."""
    return [cls() for cls in _SHARDING]


def program_passes(plan: Plan) -> list[GraphPass]:
    """Every built-in pass ``plan`` needs, in order."""
    return [cls() for cls, needed in PROGRAM if needed(plan)]


def place_passes(program: list[GraphPass], added: Iterable[GraphPass]) -> list[GraphPass]:
    """``program`` (built-in passes in :data:`BUILTIN_ORDER`) with each ``added`` pass placed
    by its ``runs_after``/``runs_before``; passes anchored at the same place keep the order
    they were given in. An anchor that is no built-in pass is an error naming the pass."""
    rank = {name: i for i, name in enumerate(BUILTIN_ORDER)}
    slots: list[tuple[float, int, GraphPass]] = [
        (rank.get(p.name, len(rank)), 0, p) for p in program]
    for i, p in enumerate(added):
        for anchor in (p.runs_after, p.runs_before):
            if anchor is not None and anchor not in rank:
                raise PassError(
                    f"pass {p.name!r} runs {'after' if anchor == p.runs_after else 'before'} "
                    f"{anchor!r}, which is no built-in pass",
                    where=f"{type(p).__module__}.{type(p).__qualname__}",
                    fix=f"anchor it on one of: {', '.join(BUILTIN_ORDER)}")
        after = rank[p.runs_after] + 0.5 if p.runs_after else None
        before = rank[p.runs_before] - 0.5 if p.runs_before else None
        if after is not None and before is not None and after > before:
            raise PassError(
                f"pass {p.name!r} runs after {p.runs_after!r} and before {p.runs_before!r}, "
                "but that one runs first", where=f"pass {p.name}",
                fix="anchor it between two passes in their order: " + ", ".join(BUILTIN_ORDER))
        where = after if after is not None else before if before is not None else len(rank)
        slots.append((where, 1 + i, p))
    return [p for _, _, p in sorted(slots, key=lambda s: (s[0], s[1]))]


def program_for(plan: Any, passes: Iterable[Any] = (), disable: Iterable[str] = ()) -> list:
    """The passes that make each rank's program for ``plan``: the built-in ones the plan
    needs, every loaded plugin pass and the call's own ``passes`` (instances, or names of
    registered or plugin passes) placed where they say they run, less the ``disable``d ones
    (plugin passes, or built-ins the plan runs correctly without: :func:`optional_builtins`).
    """
    program = program_passes(plan)
    disable = set(disable)
    by_name = {cls.name: cls for cls in plugin_passes()}
    added: list[GraphPass] = [cls() for cls in by_name.values()]
    for item in passes:
        if isinstance(item, GraphPass):
            added.append(item)
        elif isinstance(item, str):
            if item not in by_name:
                added.append(get_pass(item)())
        else:
            raise PassError(f"passes= takes GraphPass instances or pass names, got {item!r}",
                            where="passes=[...]",
                            fix="pass MyPass() or a registered pass's name")
    names = {p.name for p in program} | {p.name for p in added}
    unknown = sorted(disable - names)
    if unknown:
        raise AutoparError(f"disable_passes names {unknown}, which this program does not run",
                           where="disable_passes",
                           fix=f"passes it runs: {', '.join(sorted(names))}")
    optional = optional_builtins(plan)
    required = sorted(n for n in disable & {p.name for p in program} if n not in optional)
    if required:
        raise AutoparError(
            f"cannot disable {required}: this plan needs them to run correctly",
            where="disable_passes",
            fix=f"disable only plugin passes or {', '.join(optional) or 'none of the built-ins'}")
    kept = [p for p in program if p.name not in disable]
    return place_passes(kept, [p for p in added if p.name not in disable])


def optional_builtins(plan: Any) -> tuple[str, ...]:
    """Built-in passes ``plan``'s program computes the same without (its predicted times
    assumed them): the chunked loss, and fused attention unless context parallelism runs
    its ring through the fused op."""
    return ("chunked-loss",) + (("fuse-attention",) if plan.mesh.get("cp", 1) == 1 else ())
