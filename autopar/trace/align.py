"""Give a graph traced at another batch size the node names of the graph that was planned.

Plans name nodes. Each rank's program is traced again on one microbatch, and tracing at a
different batch size can produce a slightly different graph: a model may skip an op that is a
no-op at batch 1 (HF Llama's ``position_ids.expand(batch, -1)``), which shifts every later
auto-generated name (``expand_1`` becomes ``expand``). Matching the two node sequences by op
(a longest-common-subsequence diff, as ``difflib`` computes it) recovers which node is which;
the retraced graph is then rebuilt with the planned names. Nodes left unmatched keep a name
that cannot collide with a planned one.
"""

from __future__ import annotations

import difflib

import torch.fx as fx

from autopar.errors import PlanError


def _key(node: fx.Node) -> tuple[str, str]:
    return node.op, str(node.target)


def planned_names(gm: fx.GraphModule, reference: fx.GraphModule) -> dict[fx.Node, str]:
    """Node of ``gm`` -> name of the same node in ``reference`` (matched nodes only)."""
    ours, theirs = list(gm.graph.nodes), list(reference.graph.nodes)
    matcher = difflib.SequenceMatcher(None, [_key(n) for n in ours], [_key(n) for n in theirs],
                                      autojunk=False)
    names: dict[fx.Node, str] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            names[ours[block.a + k]] = theirs[block.b + k].name
    return names


def rename_like(gm: fx.GraphModule, reference: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its nodes named as in ``reference`` (``gm`` itself when they agree)."""
    if [n.name for n in gm.graph.nodes] == [n.name for n in reference.graph.nodes]:
        return gm
    names = planned_names(gm, reference)
    taken = {n.name for n in reference.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        name = names.get(node)
        if name is None:
            name = node.name
            while name in taken:
                name = f"{name}_retraced"
            taken.add(name)
        new = graph.create_node(node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                                fx.map_arg(node.kwargs, env.__getitem__), name, node.type)
        new.meta = dict(node.meta)
        if new.name != name:
            raise PlanError(
                f"could not give node {node.name!r} its planned name {name!r}",
                where="per-rank program", fix="re-plan for this model and batch")
        env[node] = new
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out
