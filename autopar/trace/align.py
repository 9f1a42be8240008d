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
import hashlib

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


def restore_batch_constants(gm: fx.GraphModule, reference: fx.GraphModule) -> list[str]:
    """Give ``gm`` (traced on one microbatch, named like ``reference``) the values that the
    planned graph computes with where the batch size entered arithmetic as a number.

    ``loss.sum() / x.size(0)`` traces to a division by a literal: the global batch's size in
    the planned graph, the microbatch's in the retrace. The plan's placements (a share of a
    sum over the batch, scaled by the batch's parts for the runtime's mean) are those of
    the planned graph, which divides by the global size as one device does; shape arguments
    (``view``, ``expand``, ``arange``) keep their local sizes. Returns the nodes changed."""
    theirs = {n.name: n for n in reference.graph.nodes}
    changed = []
    for node in gm.graph.nodes:
        ref = theirs.get(node.name)
        if node.op != "call_function" or ref is None or ref.target is not node.target:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None or not node.all_input_nodes:
            continue  # a factory's numbers are sizes
        args, ref_args = list(node.args), list(ref.args)
        if len(args) != len(ref_args):
            continue
        for i, (mine, planned) in enumerate(zip(args, ref_args)):
            kind = str(schema.arguments[i].type) if i < len(schema.arguments) else ""
            if (kind in _VALUE_TYPES and _number(mine) and _number(planned)
                    and mine != planned):
                args[i] = planned
        if args != list(node.args):
            node.args = tuple(args)
            changed.append(node.name)
    if changed:
        gm.recompile()
    return changed


_VALUE_TYPES = ("Tensor", "Scalar", "float", "number")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def describe(gm: fx.GraphModule) -> list[list[str]]:
    """``gm``'s nodes in order, each ``[name, op, target, structure]``: the structure is a
    hash of what the node computes from what (op, target, arguments, its inputs'
    structures), independent of names and order. Enough for another process to find the
    same graph in its own trace."""
    return [[n.name, n.op, str(n.target), h] for n, h in _structures(gm).items()]


def _structures(gm: fx.GraphModule) -> dict[fx.Node, str]:
    out: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        text = repr((node.op, str(node.target),
                     fx.map_arg((node.args, node.kwargs), lambda a: ("@", out[a]))))
        out[node] = hashlib.sha256(text.encode()).hexdigest()[:24]
    return out


def align_to(gm: fx.GraphModule, description: list[list[str]]) -> fx.GraphModule | None:
    """``gm`` rebuilt in the order and with the names of the graph ``description`` describes
    (:func:`describe`), or None when the two graphs differ. The same model traced in another
    process may order independent ops differently (a loop over a ``set`` of strings follows
    the process's hash seed). Nodes of one structure compute one value, so each described
    node takes a node of ``gm`` of its structure, and reads the nodes already placed of its
    inputs' structures."""
    structures = _structures(gm)
    if len(description) != len(structures):
        return None
    free: dict[str, list[fx.Node]] = {}
    for node, h in structures.items():
        free.setdefault(h, []).append(node)
    graph = fx.Graph()
    placed: dict[str, fx.Node] = {}  # structure -> a new node computing it
    for name, op, target, h in description:
        if not free.get(h):
            return None
        node = free[h].pop(0)
        if node.op != op or str(node.target) != target:
            return None

        def placed_like(a: fx.Node) -> fx.Node:
            return placed[structures[a]]

        try:
            new = graph.create_node(node.op, node.target, fx.map_arg(node.args, placed_like),
                                    fx.map_arg(node.kwargs, placed_like), name, node.type)
        except KeyError:  # an input not placed before it: not the same graph
            return None
        if new.name != name:
            return None
        new.meta = dict(node.meta)
        placed.setdefault(h, new)
    graph._codegen = gm.graph._codegen
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out
