"""Plan-driven graph rewrites, one pass per file, run by a PassManager."""

from autopar.passes.checkpoint_layers import CheckpointLayers
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
from autopar.passes.outline_layers import OutlineLayers
from autopar.passes.shard_parameters import ShardParameters
from autopar.passes.substitute_local_ops import SubstituteLocalOps


def sharding_passes() -> list[GraphPass]:
    """The passes that turn the traced graph into this rank's program, in order."""
    return [ShardParameters(), LocalizeShapes(), SubstituteLocalOps(), InsertCollectives()]


__all__ = [
    "CheckpointLayers",
    "GraphPass",
    "InsertCollectives",
    "LocalizeShapes",
    "OutlineLayers",
    "PassContext",
    "PassManager",
    "PassResult",
    "ShardParameters",
    "SubstituteLocalOps",
    "get_pass",
    "register_pass",
    "sharding_passes",
]
