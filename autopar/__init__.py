"""autopar: a compiler for training parallelism.

Three ways in:

- ``autopar.trace(model, example_inputs)``: the annotated fx graph;
- ``autopar.plan(model, cluster, example_inputs)``: a Plan (JSON), with no processes;
- ``autopar.parallelize(model, cluster, example_inputs)``: under torchrun, this rank's part
  of the model, ready for an ordinary optimizer loop.

The public names load on first use (PEP 562), so ``import autopar`` and the CLI's errors do
not wait for the solver, the runtime or torch.distributed to import.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from autopar.core.version import __version__

# name -> the module that defines it
_PUBLIC = {
    "AutoparError": "autopar.core.errors",
    "Cluster": "autopar.core.cluster",
    "load_cluster": "autopar.core.cluster",
    "Plan": "autopar.core.plan",
    "plan": "autopar.api.planning",
    "parallelize": "autopar.api.parallelize",
    "latest_checkpoint": "autopar.runtime.checkpoint",
    "load_checkpoint": "autopar.runtime.checkpoint",
    "save_checkpoint": "autopar.runtime.checkpoint",
    "LossScaleConfig": "autopar.runtime.loss_scale",
    "TensorSpec": "autopar.trace",
    "trace": "autopar.trace",
}

__all__ = [  # the names of _PUBLIC, and the version (ruff reads a literal list only)
    "AutoparError", "Cluster", "LossScaleConfig", "Plan", "TensorSpec", "__version__",
    "latest_checkpoint", "load_checkpoint", "load_cluster", "parallelize", "plan",
    "save_checkpoint", "trace",
]


assert sorted(__all__) == sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # importing autopar.trace set the submodule here: the function wins
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
    """``autopar.trace`` is the function, though ``autopar/trace/`` is also a package: the
    import system sets a package's submodules as its attributes once they load, and this
    keeps that from hiding the function (as the eager ``from autopar.trace import trace``
    of earlier versions did)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from autopar.api.parallelize import parallelize
    from autopar.api.planning import plan
    from autopar.core.cluster import Cluster, load_cluster
    from autopar.core.errors import AutoparError
    from autopar.core.plan import Plan
    from autopar.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from autopar.runtime.loss_scale import LossScaleConfig
    from autopar.trace import TensorSpec, trace
