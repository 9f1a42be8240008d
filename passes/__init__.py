"""Plan-driven graph rewrites, one pass per file, run by a PassManager."""

from autopar.passes.cast_precision import CastPrecision
from autopar.passes.checkpoint_layers import CheckpointLayers
from autopar.passes.chunked_loss import ChunkedLoss
from autopar.passes.expert_parallel import ExpertParallel
from autopar.passes.fuse_attention import FuseAttention
from autopar.passes.infra import (
    BUILTIN_ORDER,
    GraphPass,
    PassContext,
    PassManager,
    PassResult,
    get_pass,
    place_passes,
    register_pass,
)
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
from autopar.plan import Plan


def sharding_passes() -> list[GraphPass]:
    """The tensor-parallel passes, in order."""
    return [ShardParameters(), LocalizeShapes(), SubstituteLocalOps(), InsertCollectives()]


def program_passes(plan: Plan) -> list[GraphPass]:
    """Every pass that turns a graph traced on one microbatch into this rank's program for
    ``plan``, in order: tensor parallelism; fused attention kernels; layer modules when FSDP2 gathers them, when
    checkpointing reruns them, or when pipeline stages are cut between them (after giving
    each layer its own copy of what it reads that is made from the inputs alone); the
    checkpointing; the pipeline split. The plan's per-node precision is cast in after the
    passes that replace nodes and before layers are outlined (a layer's weight casts run
    inside it). Every program computes its cross-entropy chunked
    (the memory model prices it so)."""
    zero = plan.training.get("zero", 0)
    recompute = plan.training.get("recompute", "none")
    pipelined = plan.mesh.get("pp", 1) > 1
    passes = sharding_passes()
    if needs_sync(plan):
        passes.append(SyncBatchStatistics())
    passes.append(MeanLoss())
    if plan.mesh.get("ep", 1) > 1:
        passes.append(ExpertParallel())
    if plan.training.get("chunked_loss", True):
        passes.append(ChunkedLoss())
    if any(entry.get("fused") for entry in plan.attention):
        passes.append(FuseAttention())
    if any(word != "fp32" for word in plan.precision.values()):
        passes.append(CastPrecision())
    passes.append(PlaceCreatedTensors())  # before outlining: layers copy the nodes
    if pipelined:  # before outlining: stages then carry no masks, only inputs
        passes.append(RecomputeInputs())
    data = plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1)  # ranks averaging gradients
    if (zero >= 1 and data > 1) or recompute != "none" or pipelined:  # FSDP2's units
        passes.append(OutlineLayers())
    if zero == 3 and plan.mesh.get("ep", 1) > 1:  # FSDP2 shards experts as modules
        passes.append(OutlineExperts())
    if recompute != "none":
        passes.append(CheckpointLayers())
    if pipelined:
        passes.append(PipelineSplit())
    return passes


__all__ = [
    "BUILTIN_ORDER",
    "CastPrecision",
    "CheckpointLayers",
    "ChunkedLoss",
    "ExpertParallel",
    "FuseAttention",
    "GraphPass",
    "InsertCollectives",
    "LocalizeShapes",
    "MeanLoss",
    "OutlineExperts",
    "OutlineLayers",
    "PassContext",
    "PassManager",
    "PassResult",
    "PipelineSplit",
    "PlaceCreatedTensors",
    "RecomputeInputs",
    "ShardParameters",
    "SubstituteLocalOps",
    "SyncBatchStatistics",
    "get_pass",
    "place_passes",
    "program_passes",
    "register_pass",
    "sharding_passes",
]
