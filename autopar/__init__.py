"""autopar: a compiler for training parallelism.

Three ways in:

- ``autopar.trace(model, example_inputs)``: the annotated fx graph;
- ``autopar.plan(model, cluster, example_inputs)``: a Plan (JSON), with no processes;
- ``autopar.parallelize(model, cluster, example_inputs)``: under torchrun, this rank's part
  of the model, ready for an ordinary optimizer loop.
"""

from autopar import moe_ops  # noqa: F401  (autopar::grouped_mm, grouped GEMM FLOPs)
from autopar.cluster import Cluster, load_cluster
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.planning import plan
from autopar.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from autopar.runtime.loss_scale import LossScaleConfig
from autopar.runtime.parallelize import parallelize
from autopar.trace import TensorSpec, trace

__version__ = "0.1.0"

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
