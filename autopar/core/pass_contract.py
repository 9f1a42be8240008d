"""The pass contract: what a graph pass is given, what it returns, and how it says where it
runs. Core, not ``passes/``: plugin discovery checks a plugin's pass against it without
loading the built-in passes (a pass plugin is a :class:`GraphPass` subclass)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

if TYPE_CHECKING:  # a context carries a plan; the contract needs no plan code
    from autopar.core.plan import Plan


@dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the graph: the plan and where this rank sits."""

    plan: Plan
    coords: dict[str, int]  # this rank's index on each mesh axis, e.g. {"dp": 1, "tp": 0}
    device: str = "cpu"  # where this rank runs ("cuda:0"): tensors the program makes go there

    @property
    def mesh(self) -> dict[str, int]:
        return self.plan.mesh


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool
    changes: list[str] = field(default_factory=list)
    pass_name: str = ""  # filled in by the PassManager


class GraphPass(ABC):
    """Subclass and implement :meth:`run`; set ``name`` and, if needed, ``requires``.

    A pass added to the built-in program (a plugin, or ``parallelize(passes=[...])``) says
    where it runs with ``runs_after`` and/or ``runs_before``: a built-in pass name such as
    ``"insert-collectives"`` (:data:`autopar.passes.program.BUILTIN_ORDER`). With neither it runs last.
    """

    name: str = ""
    requires: tuple[str, ...] = ()
    runs_after: str | None = None
    runs_before: str | None = None

    @abstractmethod
    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Rewrite ``gm`` (in place or not) and say what changed."""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return self.run(gm, ctx)
