"""In-place writes, and the graph edges whose placement they tie.

An in-place op (``copy_``, ``masked_fill_``, ``index_put_``: any op whose schema writes an
argument) changes storage that other nodes read under other names: the buffer the written
tensor is a view of, and every view taken of that buffer. Each device runs the op on its
*local* tensor, so the write reaches the buffer only if every step from the buffer to the
written view was taken on that same local tensor. A redistributed copy (a slice of a
replicated tensor, a gather of a shard) is new storage: a write into it is lost, and a copy
made before a write misses it. Hence three kinds of *tied* edges, which must carry their
placement unchanged (producer's output placement == consumer's input placement):

- an edge into the written argument of an in-place op (the in-place rules then give the
  op's output, an alias of that argument, the same placement);
- an edge from a written buffer (or a view of it) into a view taken before the buffer's
  last write: the view shares the buffer's storage, so its placement is the buffer's,
  mapped by the view's rule;
- an edge from a written buffer (or a view of it) into any other reader placed before the
  last write: a redistributed copy is made before the first reader that needs it
  (passes/insert_collectives.py), so only readers after the last write may get one.

The solver honours tied edges (``Use.tied``), the planner checks the chosen plan against
them (:func:`check_tied`), and so does the collective-insertion pass for hand-edited plans.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Placement
from autopar.core.values import tensor_inputs, tensor_nodes


@dataclass(frozen=True)
class Tie:
    """Why an edge is tied: ``write`` writes into storage the edge's tensor shares."""

    consumer: fx.Node
    slot: int  # tensor input slot of the consumer (flattened order, as strategies count)
    write: fx.Node  # the in-place op
    kind: str  # "view", "written" or "read before write"


def _schema(node: fx.Node) -> Any:
    if node.op != "call_function":
        return None
    return getattr(node.target, "_schema", None)


def _arg_values(node: fx.Node, schema: Any) -> list[tuple[Any, Any]]:
    """(schema argument, value) for what the node passes, positional arguments first and
    then keywords in the node's order: the order ``tensor_inputs`` flattens them in."""
    by_name = {a.name: a for a in schema.arguments}
    out = [(schema.arguments[i] if i < len(schema.arguments) else None, v)
           for i, v in enumerate(node.args)]
    return out + [(by_name.get(k), v) for k, v in node.kwargs.items()]


def _writes(arg: Any) -> bool:
    return arg is not None and arg.alias_info is not None and arg.alias_info.is_write


def written_slots(node: fx.Node) -> list[int]:
    """Tensor input slots of ``node`` its op writes in place (empty for most ops)."""
    schema = _schema(node)
    if schema is None:
        return []
    slots, slot = [], 0
    for arg, value in _arg_values(node, schema):
        for _ in tensor_nodes(value):
            if _writes(arg):
                slots.append(slot)
            slot += 1
    return slots


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares (a view, or an in-place op's
    result), or None. ``split``/``unbind``/``chunk`` (and the ``getitem`` that picks one of
    their pieces) alias their input."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and aliased_input(source) else None
    schema = _schema(node)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    sets = set(schema.returns[0].alias_info.before_set)
    for a, v in _arg_values(node, schema):
        info = a.alias_info if a is not None else None
        if info is not None and (sets & set(info.before_set) or "*" in info.after_set):
            nodes = tensor_nodes(v)
            return nodes[0] if len(nodes) == 1 else None
    return None


def writes(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(in-place op, the tensor whose storage it writes, views looked through), in order."""
    root = roots(graph)
    return [(node, root[tensor_inputs(node)[slot]])
            for node in graph.nodes for slot in written_slots(node)]


def roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node's storage root: the tensor its value is a view (or in-place result) of."""
    root: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        source = aliased_input(node)
        root[node] = root.get(source, source) if source is not None else node
    return root


def ties(graph: fx.Graph) -> dict[tuple[fx.Node, int], Tie]:
    """Every tied edge of ``graph``, keyed by (consumer, tensor input slot)."""
    root = roots(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_write = {base: write for write, base in writes(graph)}  # base -> its last writer
    out: dict[tuple[fx.Node, int], Tie] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        source = aliased_input(node)
        written = set(written_slots(node))
        for slot, a in enumerate(tensor_inputs(node)):
            write = last_write.get(root[a])
            if write is None:
                continue
            if slot in written:
                kind = "written"
            elif order[node] > order[write]:
                continue  # the storage is final: a copy of it is as good
            else:
                kind = "view" if a is source else "read before write"
            out[(node, slot)] = Tie(node, slot, write, kind)
    return out


def describe(node: fx.Node) -> str:
    """``name (target) in module at file:line``: where a user finds the op."""
    facts = node.meta.get(META_KEY)
    text = f"{node.name} ({node.target})"
    if facts is not None and facts.module_path:
        text += f" in {facts.module_path}"
    if facts is not None and facts.source:
        text += f" at {facts.source}"
    return text


def check_tied(
    graph: fx.Graph,
    have: Callable[[fx.Node], Placement | None],
    need: Callable[[fx.Node, int], Placement | None],
    axis: str,
    found: dict[tuple[fx.Node, int], Tie] | None = None,
) -> None:
    """Raise if a tied edge would be redistributed on ``axis``: ``have(a)`` is the placement
    of input value ``a``, ``need(consumer, slot)`` what the consumer's strategy reads (None:
    not planned, nothing to check). ``found``: ``ties(graph)``, when the caller has it."""
    for (consumer, slot), tie in (ties(graph) if found is None else found).items():
        a = tensor_inputs(consumer)[slot]
        wanted, got = need(consumer, slot), have(a)
        if wanted is None or got is None or wanted == got:
            continue
        raise AutoparError(
            f"in-place write {describe(tie.write)} would be lost or read stale on {axis}: "
            f"{describe(consumer)} reads {a.name} ({tie.kind}) as {wanted}, but {a.name} is "
            f"placed {got}, so it would get a redistributed copy, not the storage "
            "the write changes",
            where=f"strategies.{consumer.name}.{axis}",
            fix="re-plan with this autopar (the solver keeps such edges in place); if the "
            "plan was edited by hand, give both nodes the same placement",
        )


def layer_writes_outside(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(in-place op, written tensor) where an op in a repeated layer writes storage made
    outside that layer. Recomputing the layer (activation checkpointing) would write it a
    second time, after readers saw the first."""
    out = []
    for write, base in writes(graph):
        layer = _layer(write)
        if layer is not None and _layer(base) != layer:
            out.append((write, base))
    return out


def _layer(node: fx.Node) -> int | None:
    facts = node.meta.get(META_KEY)
    return None if facts is None else facts.layer
