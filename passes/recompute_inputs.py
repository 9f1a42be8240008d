"""Recompute values made from the inputs alone in each layer that reads them.

Attention masks, position ids and rotary tables are computed once from the inputs (and
constant buffers), before the layers, and read by every layer. In a pipeline, a value a
later stage reads is carried through every stage boundary: a ``[batch, 1, seq, seq]`` mask,
often an expanded (stride-0, non-contiguous) view that gloo cannot even send, travels every
microbatch. Such a value costs a few elementwise ops to make and holds no gradient, so this
pass gives each layer (and each stretch of code between layers) that reads it its own copy
of the ops that make it; what then crosses a stage boundary is at most the small inputs they
read (``attention_mask`` as ``[batch, seq]``).

Only deterministic, non-mutating ATen ops whose inputs are the model's inputs, buffers,
constants or other such values are copied: never a weight, a random op, a collective, or a
buffer some in-place op writes (BART's ``shift_tokens_right`` fills a ``new_zeros``).
Runs before :class:`OutlineLayers`, whose partition of the graph it uses.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.core.graph_facts import META_KEY
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.outline_layers import partition_nodes


@register_pass
class RecomputeInputs(GraphPass):
    name = "recompute-inputs"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        part, _ = partition_nodes(gm)
        leaves = {n for n in gm.graph.nodes if n.op == "placeholder" or _is_constant(gm, n)}
        weightless = _weightless(gm, leaves)
        layer_of = {p: (n.meta[META_KEY].block, n.meta[META_KEY].layer) for n, p in part.items()
                    if META_KEY in n.meta and n.meta[META_KEY].layer is not None}
        copies: dict[tuple[fx.Node, int], fx.Node] = {}

        def copy(value: fx.Node, p: int, before: fx.Node) -> fx.Node:
            if (value, p) not in copies:
                args = {a: copy(a, p, before) if a in weightless and part[a] != p else a
                        for a in value.all_input_nodes}
                with gm.graph.inserting_before(before):
                    new = gm.graph.node_copy(value, args.__getitem__)
                new.meta = dict(value.meta)
                block, layer = layer_of.get(p, (None, None))
                new.meta[META_KEY] = dataclasses.replace(
                    value.meta[META_KEY], block=block, layer=layer, position=None)
                copies[value, p] = new
            return copies[value, p]

        for user in list(gm.graph.nodes):
            p = part.get(user)
            for a in user.all_input_nodes if p is not None else ():
                if a in weightless and part[a] != p:
                    user.replace_input_with(a, copy(a, p, user))
        for node in reversed(list(gm.graph.nodes)):
            if node in weightless and not node.users:
                gm.graph.erase_node(node)
        if not copies:
            return PassResult(gm, modified=False)
        made = sorted({v.name for v, _ in copies})
        return PassResult(gm, modified=True, changes=[
            f"{len(made)} values made from the inputs alone are recomputed where they are "
            f"read ({len(copies)} copies), not carried: {', '.join(made[:8])}"])


def _is_constant(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A buffer or constant tensor (not a parameter): free to read anywhere."""
    if node.op != "get_attr":
        return False
    value = operator.attrgetter(str(node.target))(gm)
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _weightless(gm: fx.GraphModule, leaves: set[fx.Node]) -> set[fx.Node]:
    """Nodes computed by pure ops from ``leaves`` (inputs, buffers, constants) alone, and
    never written in place: a copy of a buffer that ``copy_`` later fills (through a view)
    would miss the writes."""
    written = _written(gm)
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "call_function" and META_KEY in node.meta and _pure(node.target)
                and node not in written
                and all(a in out or a in leaves for a in node.all_input_nodes)):
            out.add(node)
    return out


def _written(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose storage an in-place op writes, directly or through a view of it."""
    base: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if isinstance(first, fx.Node) and _is_view(node.target):
            base[node] = base.get(first, first)
    written = set()
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            for arg, value in zip(node.target._schema.arguments, node.args):
                if isinstance(value, fx.Node) and arg.alias_info and arg.alias_info.is_write:
                    written.add(base.get(value, value))
    return {n for n in gm.graph.nodes if base.get(n, n) in written}


def _is_view(target: object) -> bool:
    """An op whose output shares its first input's storage (a view, a split's piece)."""
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and any(r.alias_info is not None for r in target._schema.returns))


def _pure(target: object) -> bool:
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags
            and bool(target._schema.returns))
