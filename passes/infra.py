"""The pass contract and the manager that runs passes in order.

A pass reads the plan and a context, rewrites the graph and reports what it changed (as
torch.fx's ``passes/infra`` does: ``requires`` -> ``call`` -> result with ``modified``).
The manager checks each pass's ``requires`` are met by earlier passes, runs them, lints the
graph after each, and names the pass that failed. Researchers add passes by subclassing
:class:`GraphPass` and registering them::

    from autopar.passes import GraphPass, PassResult, register_pass

    @register_pass
    class CountMatmuls(GraphPass):
        name = "count-matmuls"

        def run(self, gm, ctx):
            n = sum(1 for node in gm.graph.nodes if "mm" in str(node.target))
            return PassResult(gm, modified=False, changes=[f"{n} matmuls"])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.errors import AutoparError, PassError
from autopar.plan import Plan


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
    ``"insert-collectives"`` (:data:`BUILTIN_ORDER`). With neither it runs last.
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


_REGISTRY: dict[str, type[GraphPass]] = {}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Make a pass available by name (``autopar.passes.get_pass(name)``)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a pass named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def get_pass(name: str) -> type[GraphPass]:
    if name not in _REGISTRY:
        raise PassError(
            f"no pass named {name!r}",
            where="passes",
            fix=f"registered passes: {', '.join(sorted(_REGISTRY))}",
        )
    return _REGISTRY[name]


# Every built-in pass, in the order ``program_passes`` runs those a plan needs. A program
# holds only some of them; an added pass anchored on one the program lacks runs where that
# one would have run.
BUILTIN_ORDER = (
    "shard-parameters", "localize-shapes", "substitute-local-ops",
    "insert-collectives", "sync-batch-statistics", "mean-loss", "expert-parallel", "chunked-loss",
    "fuse-attention", "cast-precision", "place-created-tensors", "recompute-inputs",
    "outline-layers", "outline-experts", "checkpoint-layers", "pipeline-split",
)


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


class PassManager:
    def __init__(self, passes: Iterable[GraphPass]):
        self.passes = list(passes)
        done: set[str] = set()
        for p in self.passes:
            missing = [r for r in p.requires if r not in done]
            if missing:
                raise PassError(
                    f"pass {p.name!r} requires {missing} to run before it",
                    where=f"pass order: {[q.name for q in self.passes]}",
                    fix="reorder the passes",
                )
            done.add(p.name)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, list[PassResult]]:
        results = []
        for p in self.passes:
            try:
                result = p(gm, ctx)
                result.graph_module.graph.lint()
            except AutoparError as e:
                if isinstance(e, PassError):
                    raise
                raise PassError(f"pass {p.name!r} failed: {e.what}", where=e.where, fix=e.fix) from e
            except Exception as e:  # noqa: BLE001 - name the pass for any failure
                raise PassError(
                    f"pass {p.name!r} failed: {type(e).__name__}: {e}",
                    where=f"pass {p.name}",
                    fix="this is a bug in the pass or an op its rules do not cover; report it "
                    "with the plan (autopar plan --json)",
                ) from e
            result.pass_name = p.name
            if result.modified:
                result.graph_module.recompile()
            if result.graph_module is not gm:  # a rebuilt module keeps what passes recorded
                for key, value in gm.meta.items():
                    if key.startswith("autopar_"):
                        result.graph_module.meta.setdefault(key, value)
            gm = result.graph_module
            results.append(result)
        return gm, results
