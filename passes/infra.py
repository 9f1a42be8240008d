"""The pass registry and the manager that runs passes in order.

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

from collections.abc import Iterable

import torch.fx as fx

from autopar.core.errors import AutoparError, PassError
from autopar.core.pass_contract import GraphPass, PassContext, PassResult

__all__ = ["GraphPass", "PassContext", "PassManager", "PassResult", "get_pass", "register_pass"]


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
