"""Find repeated blocks (transformer layers) so the solver decides each kind once.

A node belongs to layer ``i`` of container ``c`` when its module path (or, for a parameter,
its name) starts with ``c.i``, and ``c`` has at least two numbered children that run one
after another, each once. Two layers
share a *signature* when their nodes, in graph order, have the same ops, shapes and wiring;
the node at position ``k`` of one then corresponds to the node at position ``k`` of the
other. The outermost numbered container wins, so the experts inside a MoE layer are part of
the layer, not blocks of their own.

A model may have several stacks (an encoder-decoder has ``encoder.block`` and
``decoder.block``). A node's ``layer`` is its layer's place among *all* the model's layers,
in the order they run (T5: encoder 0, 1, then decoder 2, 3), so the solver and the pipeline
see one sequence of distinct layers (the index within its stack is in the module path).
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autopar.core.graph_facts import META_KEY, BlockFacts, NodeFacts

_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _layer_of(path: str) -> tuple[str, int] | None:
    m = _NUMBERED.match(path)
    if not m or not m.group(1):
        return None
    return m.group(1), int(m.group(2))


def assign_blocks(gm: fx.GraphModule) -> list[BlockFacts]:
    """Set ``block``, ``layer`` and ``position`` in each node's facts; return the blocks."""
    members: dict[str, dict[int, list[fx.Node]]] = defaultdict(lambda: defaultdict(list))
    first_run: dict[tuple[str, int], int] = {}  # graph position of a layer's first op
    for i, node in enumerate(gm.graph.nodes):
        facts: NodeFacts = node.meta[META_KEY]
        found = _layer_of(facts.module_path) if facts.module_path else None
        if found:
            members[found[0]][found[1]].append(node)
            if node.op != "get_attr":  # weights may be read anywhere; ops run in order
                first_run.setdefault(found, i)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    stacks = {c: layers for c, layers in members.items()
              if len(layers) >= 2 and _in_sequence(layers, position)
              and _chained(layers, gm)}
    order = sorted(((c, i) for c, layers in stacks.items() for i in layers),
                   key=lambda key: (first_run.get(key, len(gm.graph.nodes)), key))
    ordinal = {key: n for n, key in enumerate(order)}

    blocks = []
    for container in sorted(stacks, key=lambda c: min(ordinal[c, i] for i in stacks[c])):
        layers = stacks[container]
        signatures: dict[tuple, int] = {}
        block = BlockFacts(container=container,
                           layers=tuple(sorted(ordinal[container, i] for i in layers)))
        for index, nodes in layers.items():
            layer = ordinal[container, index]
            sig = _signature(nodes)
            block.signature_of[layer] = signatures.setdefault(sig, len(signatures))
            for position, node in enumerate(nodes):
                facts = node.meta[META_KEY]
                facts.block, facts.layer, facts.position = container, layer, position
        blocks.append(block)
    return blocks


def _in_sequence(layers: dict[int, list[fx.Node]], position: dict[fx.Node, int]) -> bool:
    """Do the layers run one after another, each once? A module applied several times (its
    weights shared, as ALBERT's layers are) or the parts of one block (an ``nn.Sequential``
    of a norm and two linears) interleave: they are no stack of layers."""
    spans = sorted((min(position[n] for n in ops), max(position[n] for n in ops))
                   for ops in ([n for n in nodes if n.op != "get_attr"] for nodes in
                               layers.values()) if ops)
    return all(end < start for (_, end), (start, _) in zip(spans, spans[1:]))


def _chained(layers: dict[int, list[fx.Node]], gm: fx.GraphModule) -> bool:
    """Does each layer compute from the one before it (a transformer's hidden state), not
    beside it (the experts of a routing loop, each fed its own tokens): only a chain can be
    cut into pipeline stages that pass one layer's output to the next."""
    index = {node: i for i, nodes in layers.items() for node in nodes if node.op != "get_attr"}
    last: dict[fx.Node, int | None] = {}  # the latest layer a value depends on
    fed: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        sources = [index.get(a, last.get(a)) for a in node.all_input_nodes]
        sources = [s for s in sources if s is not None]
        if node in index:
            fed.setdefault(index[node], set()).update(s for s in sources if s != index[node])
            last[node] = index[node]
        else:
            last[node] = max(sources, default=None)
    order = sorted(layers)
    return all(prev in fed.get(cur, set()) for prev, cur in zip(order, order[1:]))


def _signature(nodes: list[fx.Node]) -> tuple:
    index = {n: i for i, n in enumerate(nodes)}

    def ref(a: object) -> object:
        if isinstance(a, fx.Node):
            return ("in", index[a]) if a in index else ("ext",)
        return repr(a)

    out = []
    for n in nodes:
        facts = n.meta[META_KEY]
        leaves, _ = tree_flatten((n.args, n.kwargs))
        param_shape = facts.param.shape if facts.param else None
        out.append((n.op, facts.target if n.op != "get_attr" else "attr", facts.shapes,
                    facts.dtypes, param_shape, tuple(ref(a) for a in leaves)))
    return tuple(out)


def fingerprint(gm: fx.GraphModule) -> str:
    """A stable hash of the model: ops, wiring, parameter names and shapes, and the
    non-size constants of each op (eps, dropout p, dtypes).

    Sizes (view shapes, ``arange`` ends), devices and activation shapes are left out, so the
    same model traced at another batch size or sequence length, or on meta instead of CPU,
    has the same fingerprint (a plan records its batch and sequence separately).
    """
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        facts: NodeFacts = node.meta[META_KEY]
        leaves, _ = tree_flatten((node.args, node.kwargs))
        args = [a.name if isinstance(a, fx.Node) else _constant(a) for a in leaves]
        param = (facts.param.fqn, facts.param.shape) if facts.param else None
        h.update(repr((node.name, node.op, facts.target, param, facts.dtypes, args)).encode())
    return h.hexdigest()[:16]


def _constant(a: object) -> str:
    if isinstance(a, bool) or isinstance(a, (float, str)):
        return repr(a)
    if isinstance(a, torch.dtype):
        return str(a)
    return "_"  # ints (sizes), devices, layouts: not part of the model's identity
