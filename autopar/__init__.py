"""autopar: a compiler for training parallelism.

Three ways in:

- ``autopar.trace(model, example_inputs)``: the annotated fx graph;
- ``autopar.plan(model, cluster, example_inputs)``: a Plan (JSON), with no processes;
- ``autopar.parallelize(model, cluster, example_inputs)``: under torchrun, this rank's part
  of the model, ready for an ordinary optimizer loop.
"""

from autopar.api.parallelize import parallelize
from autopar.api.planning import plan
from autopar.core.cluster import Cluster, load_cluster
from autopar.core.errors import AutoparError
from autopar.core.plan import Plan
from autopar.core.version import __version__
from autopar.ops import moe_ops  # noqa: F401  (autopar::grouped_mm, grouped GEMM FLOPs)
from autopar.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from autopar.runtime.loss_scale import LossScaleConfig
from autopar.trace import TensorSpec, trace

__all__ = [
    "AutoparError",
    "Cluster",
    "LossScaleConfig",
    "Plan",
    "TensorSpec",
    "__version__",
    "load_cluster",
    "latest_checkpoint",
    "load_checkpoint",
    "parallelize",
    "save_checkpoint",
    "plan",
    "trace",
]
