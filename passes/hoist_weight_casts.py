"""Move each weight's once-a-step cast to where the weight is read: a layer's first lines.

Under ``compile`` (:mod:`autopar.runtime.compiled`) a layer's ``forward`` is compiled, and
``cast_weight`` (:mod:`autopar.ops.step_copies`) is opaque to Dynamo (its table is Python
state): each call breaks the graph. Cast where the cast pass put them, before their first
use, a layer would be cut between its matmuls into as many graphs as it has weights; cast
right after the weight is read, they all run first, eagerly, and the layer's compute is one
graph. Within a layer this changes no value and no lifetime that matters (the copies live
for the whole step). Runs after :class:`OutlineLayers` (moving a cast in the flat graph
would move it out of its layer's partition); with no layers outlined and no pipeline, it
moves the whole program's casts.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.ops.step_copies import cast_weight
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


def hoist_casts(gm: fx.GraphModule) -> int:
    """Move every ``cast_weight`` of ``gm``'s graph right after the node it reads; how many
    moved."""
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is cast_weight:
            source = node.args[0]
            if isinstance(source, fx.Node) and source.next is not node:
                source.append(node)
                moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


@register_pass
class HoistWeightCasts(GraphPass):
    name = "hoist-weight-casts"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        paths = list(gm.meta.get("autopar_layer_paths", []))
        if paths:
            modules = [gm.get_submodule(p) for p in paths]
        elif ctx.plan.mesh.get("pp", 1) == 1:
            modules = [gm]
        else:
            modules = []
        moved = sum(hoist_casts(m) for m in modules if isinstance(m, fx.GraphModule))
        changes = [f"{moved} weight cast(s) moved to where their weights are read"] if moved else []
        return PassResult(gm, modified=bool(moved), changes=changes)
