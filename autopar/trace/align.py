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

import torch
import torch.fx as fx

from autopar.core.errors import PlanError


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


def describe(gm: fx.GraphModule) -> list[list]:
    """``gm``'s nodes in order, each ``[name, op, target, structure, inputs]``: the
    structure is a hash of what the node computes from what (op, target, arguments, its
    inputs' structures), independent of names and order; ``inputs`` names the nodes its
    arguments read, in order. Enough for another process to find the same graph in its
    own trace."""
    structures = _structures(gm)
    return [[n.name, n.op, str(n.target), structures[n], [a.name for a in _reads(n)]]
            for n in gm.graph.nodes]


def _reads(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node``'s arguments read, in order (repeats kept)."""
    out: list[fx.Node] = []
    fx.map_arg((node.args, node.kwargs), out.append)
    return out


def _structures(gm: fx.GraphModule) -> dict[fx.Node, str]:
    out: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        text = repr((node.op, str(node.target),
                     fx.map_arg((node.args, node.kwargs), lambda a: ("@", out[a]))))
        out[node] = hashlib.sha256(text.encode()).hexdigest()[:24]
    return out


def align_to(gm: fx.GraphModule, description: list[list]) -> fx.GraphModule | None:
    """``gm`` rebuilt in the order, with the names and the wiring of the graph
    ``description`` describes (:func:`describe`), or None when the two graphs differ. The
    same model traced in another process may order independent ops differently (a loop
    over a ``set`` of strings follows the process's hash seed). Each described node takes
    an unmatched node of ``gm`` of its structure (nodes of one structure compute one value)
    and reads the described node's inputs."""
    structures = _structures(gm)
    if len(description) != len(structures):
        return None
    free: dict[str, list[fx.Node]] = {}
    for node, h in structures.items():
        free.setdefault(h, []).append(node)
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}
    for name, op, target, h, inputs in description:
        if not free.get(h):
            return None
        node = free[h].pop(0)
        reads = iter(inputs)
        if node.op != op or str(node.target) != target or len(inputs) != len(_reads(node)) \
                or any(i not in made for i in inputs):
            return None
        args, kwargs = fx.map_arg((node.args, node.kwargs),
                                  lambda _, reads=reads: made[next(reads)])
        new = graph.create_node(node.op, node.target, args, kwargs, name, node.type)
        if new.name != name:
            return None
        new.meta = dict(node.meta)
        made[name] = new
    graph._codegen = gm.graph._codegen
    # parameters registered in the described order (FSDP2 gathers a unit's parameters in
    # that order, so every rank must have one), then the names the graph does not read (a
    # tied weight's other name)
    out = fx.GraphModule(gm, graph)
    for name, tensor in [*gm.named_parameters(remove_duplicate=False),
                         *gm.named_buffers(remove_duplicate=False)]:
        owner, _, attr = name.rpartition(".")
        try:
            holder = out.get_submodule(owner) if owner else out
        except AttributeError:
            holder = _make_path(out, owner)
        if not hasattr(holder, attr):
            setattr(holder, attr, tensor)
    out.meta.update(gm.meta)
    return out


def _make_path(root: torch.nn.Module, path: str) -> torch.nn.Module:
    module = root
    for part in path.split("."):
        if not hasattr(module, part):
            setattr(module, part, torch.nn.Module())
        module = getattr(module, part)
    return module
