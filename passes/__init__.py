"""Plan-driven graph rewrites, one pass per file, run by a PassManager in the order of
:data:`autopar.passes.program.PROGRAM`."""

from autopar.passes.cast_precision import CastPrecision
from autopar.passes.checkpoint_layers import CheckpointLayers
from autopar.passes.chunked_loss import ChunkedLoss
from autopar.passes.expert_parallel import ExpertParallel
from autopar.passes.fuse_attention import FuseAttention
from autopar.passes.hoist_weight_casts import HoistWeightCasts
from autopar.passes.infra import (
    GraphPass,
    PassContext,
    PassManager,
    PassResult,
    get_pass,
    register_pass,
)
from autopar.passes.insert_collectives import InsertCollectives
from autopar.passes.localize_shapes import LocalizeShapes
from autopar.passes.mean_loss import MeanLoss
from autopar.passes.outline_experts import OutlineExperts
from autopar.passes.outline_layers import OutlineLayers
from autopar.passes.pipeline_split import PipelineSplit
from autopar.passes.place_created_tensors import PlaceCreatedTensors
from autopar.passes.program import (
    BUILTIN_ORDER,
    PROGRAM,
    optional_builtins,
    place_passes,
    program_for,
    program_passes,
    sharding_passes,
)
from autopar.passes.recompute_inputs import RecomputeInputs
from autopar.passes.shard_parameters import ShardParameters
from autopar.passes.substitute_local_ops import SubstituteLocalOps
from autopar.passes.sync_batch_statistics import SyncBatchStatistics

__all__ = [
    "BUILTIN_ORDER",
    "CastPrecision",
    "CheckpointLayers",
    "ChunkedLoss",
    "ExpertParallel",
    "FuseAttention",
    "GraphPass",
    "HoistWeightCasts",
    "InsertCollectives",
    "LocalizeShapes",
    "MeanLoss",
    "OutlineExperts",
    "OutlineLayers",
    "PROGRAM",
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
    "optional_builtins",
    "place_passes",
    "program_for",
    "program_passes",
    "register_pass",
    "sharding_passes",
]
