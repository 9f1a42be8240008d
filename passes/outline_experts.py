"""Outline each expert region into a module that owns exactly the experts' weights.

Under ZeRO-3 with expert parallelism, FSDP2 shards the expert weights over ``edp`` (the
ranks holding the same experts) and every other weight over dp, as torchtitan does. FSDP2
gathers a module's weights when the module is called, so the experts' computation must be
a module of its own, called by its layer. This pass cuts each region that
``expert-parallel`` tagged (its matmuls, the row-wise ops between them, and the reads of
the expert weights: casts, transposes, tensor-parallel collectives) out of the graph that
holds it (a layer made by ``outline-layers``, or the root) into a ``GraphModule``. That
module is installed at the weights' own module path (``model.layers.3.mlp.experts``), so
parameter names do not change. The paths go to ``gm.meta["autopar_expert_units"]`` for the
runtime.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autopar.analysis.expert_sites import _CHECKS, _bounds, expert_module
from autopar.core.errors import PassError
from autopar.passes.expert_parallel import EXPERT_REGION
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.outline_layers import _install

UNITS = "autopar_expert_units"


@register_pass
class OutlineExperts(GraphPass):
    name = "outline-experts"
    requires = ("expert-parallel",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        owners = [("", gm)] + [(p, gm.get_submodule(p))
                               for p in gm.meta.get("autopar_layer_paths", [])]
        units: list[str] = []
        for prefix, owner in owners:
            if not isinstance(owner, fx.GraphModule):
                continue
            regions: dict[int, list[fx.Node]] = {}
            for node in owner.graph.nodes:
                if EXPERT_REGION in node.meta:
                    regions.setdefault(node.meta[EXPERT_REGION], []).append(node)
            for matmuls in regions.values():
                path = outline_region(owner, matmuls)
                units.append(f"{prefix}.{path}" if prefix else path)
            if regions:
                owner.graph.lint()
                owner.recompile()
        gm.meta[UNITS] = units
        return PassResult(gm, modified=bool(units),
                          changes=[f"{u}: the experts' own module" for u in units])


def _weight_only(node: fx.Node) -> bool:
    """Is ``node`` a weight, or computed from weights alone (a cast, a transpose)?"""
    if node.op == "get_attr":
        return True
    return (node.op == "call_function" and bool(node.all_input_nodes)
            and all(_weight_only(a) for a in node.all_input_nodes))


def region_nodes(matmuls: list[fx.Node]) -> set[fx.Node]:
    """The region of ``matmuls``: the matmuls, every node between them, the reads of their
    weights used nowhere else, and trace-time asserts on its values."""
    rows = [a for mm in matmuls for a in mm.all_input_nodes if not _weight_only(a)]
    members = set(_bounds(matmuls, rows)[0])
    todo = list(members)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in members and _weight_only(a) and all(u in members for u in a.users):
                members.add(a)
                todo.append(a)
    for n in list(members):
        members.update(u for u in n.users if u.target in _CHECKS and not u.users)
    return members


def outline_region(owner: fx.GraphModule, matmuls: list[fx.Node]) -> str:
    """Move the region of ``matmuls`` into a module at its weights' module path, called
    where the region ran; that path."""
    members = region_nodes(matmuls)
    order = {n: i for i, n in enumerate(owner.graph.nodes)}
    ordered = sorted(members, key=order.__getitem__)
    inputs = list(dict.fromkeys(a for n in ordered for a in n.all_input_nodes
                                if a not in members))
    outputs = [n for n in ordered if any(u not in members for u in n.users)]
    users = [u for n in outputs for u in n.users if u not in members]
    where = f"{owner.__class__.__name__} ({matmuls[0].name})"
    if not outputs or max((order[a] for a in inputs), default=-1) > min(order[u] for u in users):
        raise PassError(f"the experts of {matmuls[0].name} are interleaved with the code "
                        "around them and cannot be called as one module",
                        where=where, fix="plan with zero=0, or ep=1")
    targets = [str(n.target) for n in ordered if n.op == "get_attr"]
    path = expert_module(owner, targets)
    if path is None:
        raise PassError(f"the expert weights {', '.join(targets)} do not have a module of "
                        "their own", where=where,
                        fix="hold the experts' stacked weights in a module of their own (as "
                        "torchtitan's GroupedExperts), or plan with zero=0")
    attrs = {t[len(path) + 1:]: operator.attrgetter(t)(owner) for t in targets}

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in ordered:
        if n.op == "get_attr":
            env[n] = graph.get_attr(str(n.target)[len(path) + 1:])
            env[n].meta = dict(n.meta)
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    module = fx.GraphModule(attrs, graph, class_name="Experts")

    first_user = min(users, key=order.__getitem__)
    with owner.graph.inserting_before(first_user):
        call = owner.graph.call_module(path, tuple(inputs))
        results = [call] if len(outputs) == 1 else [
            owner.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for out, result in zip(outputs, results):
        result.meta = dict(out.meta)
        for user in [u for u in out.users if u not in members]:
            user.replace_input_with(out, result)
    for n in reversed(ordered):
        owner.graph.erase_node(n)
    _install(owner, path, module)  # replaces the plain module that held the weights
    return path
