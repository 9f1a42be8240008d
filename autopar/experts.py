"""Where a traced graph runs experts: the analysis expert parallelism is planned and executed on.

An MoE layer written the torchtitan / Hugging Face way sorts its tokens by expert and runs
them through grouped matmuls whose weights stack one matrix per expert (``(experts, in,
out)``) and whose ``offs`` says where each expert's rows end. The *expert region* of such
a layer is its grouped matmuls sharing one ``offs`` and the row-wise ops between them (an
activation, SwiGLU's product, a split of a fused gate/up projection): everything that runs
on the tokens while they are grouped by expert. It has one input (the sorted rows) and one
output; expert parallelism moves the rows to the experts' owners at the input and back at
the output (:mod:`autopar.expert_ops`).

>>> import torch, autopar
>>> from autopar.models.moe import MoEConfig, MoEGPT
>>> model = MoEGPT(MoEConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16,
...                          experts=4, expert_ffn=32, routing="sorted"))
>>> idx = torch.randint(0, 32, (2, 8))
>>> [(r.experts, len(r.matmuls)) for r in expert_regions(autopar.trace(model, (idx, idx)))]
[(4, 2), (4, 2)]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.graph_facts import META_KEY


def grouped_matmul_ops() -> set:
    """torch's grouped GEMM, autopar's, and Hugging Face's fallback where loaded."""
    ops = {torch.ops.aten._grouped_mm.default}
    for namespace, name in (("autopar", "grouped_mm"), ("transformers", "grouped_mm_fallback")):
        packet = getattr(getattr(torch.ops, namespace, None), name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


@dataclass(frozen=True)
class ExpertRegion:
    """One MoE layer's experts: the grouped matmuls, the rows they read, their weights."""

    matmuls: tuple[fx.Node, ...]  # in graph order
    rows: fx.Node  # the sorted tokens the region reads (rows, hidden)
    offs: fx.Node  # cumulative rows per expert
    output: fx.Node  # the region's result (rows, hidden)
    weights: tuple[fx.Node, ...]  # get_attr nodes of the stacked expert weights
    members: frozenset[fx.Node]  # every node of the region
    experts: int

    @property
    def weight_fqns(self) -> tuple[str, ...]:
        return tuple(str(w.target) for w in self.weights)


_CACHE: weakref.WeakKeyDictionary[fx.GraphModule, list[ExpertRegion]] = \
    weakref.WeakKeyDictionary()


def regions_of(gm: fx.GraphModule) -> list[ExpertRegion]:
    """:func:`expert_regions` of ``gm``, computed once; empty when the experts are written
    in a way expert parallelism cannot run (the planner then does not offer ``ep``)."""
    if gm not in _CACHE:
        try:
            _CACHE[gm] = expert_regions(gm)
        except ExpertRegionError:
            _CACHE[gm] = []
    return _CACHE[gm]


class ExpertRegionError(ValueError):
    """A grouped matmul whose surroundings expert parallelism cannot move rows around."""


def expert_regions(gm: fx.GraphModule) -> list[ExpertRegion]:
    """Every expert region of ``gm``, in graph order. A grouped matmul whose weight is not a
    stacked parameter, or whose region has more than one input or output, raises
    :class:`ExpertRegionError` naming it."""
    ops = grouped_matmul_ops()
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            offs = _arg(node, 2, "offs")
            if isinstance(offs, fx.Node):
                by_offs.setdefault(offs, []).append(node)
    return [_region(offs, matmuls) for offs, matmuls in by_offs.items()]


def _region(offs: fx.Node, matmuls: list[fx.Node]) -> ExpertRegion:
    group = set(matmuls)
    weights = []
    for mm in matmuls:
        w = _through_casts(mm.args[1])
        if w.op != "get_attr":
            raise ExpertRegionError(f"{mm.name}: its weight {w.name} is not a parameter")
        weights.append(w)
    experts = {_shape(w)[0] for w in weights}
    if len(experts) != 1:
        raise ExpertRegionError(f"{matmuls[0].name}: weights stack different expert counts "
                                f"{sorted(experts)}")
    after = _reachable(matmuls, forward=True)
    before = _reachable([mm.args[0] for mm in matmuls], forward=False)
    members = group | (after & before)
    entries = {mm.args[0] for mm in matmuls} - members
    if len(entries) != 1:
        raise ExpertRegionError(f"{matmuls[0].name}: the experts read {len(entries)} "
                                "different row tensors")
    exits = [n for n in members
             if any(u not in members and u.target not in _CHECKS for u in n.users)]
    if len(exits) != 1:
        raise ExpertRegionError(f"{matmuls[0].name}: {len(exits)} values leave the experts "
                                f"({', '.join(sorted(n.name for n in exits))})")
    (rows,) = entries
    return ExpertRegion(tuple(matmuls), rows, offs, exits[0], tuple(dict.fromkeys(weights)),
                        frozenset(members), experts.pop())


def _reachable(starts, forward: bool) -> set[fx.Node]:
    """Nodes after (or, backward, before and including) ``starts``."""
    todo = [s for s in starts if isinstance(s, fx.Node)]
    seen: set[fx.Node] = set() if forward else set(todo)
    while todo:
        n = todo.pop()
        nxt = n.users if forward else n.all_input_nodes
        for m in nxt:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default}
_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}  # trace-time asserts, no values


def _through_casts(node: fx.Node) -> fx.Node:
    """A weight read through dtype casts (a bf16 plan casts it) or transposes that keep the
    expert dim first (Hugging Face stores ``(experts, out, in)``) is still that weight."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        keeps_experts = (
            node.target in _CASTS or getattr(node.target, "__name__", "") == "cast_to"
            or (node.target is torch.ops.aten.transpose.int and 0 not in
                (node.args[1] % 3, node.args[2] % 3))
            or (node.target is torch.ops.aten.permute.default and node.args[1][0] == 0))
        if not keeps_experts:
            break
        node = node.args[0]
    return node


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta[META_KEY].shapes[0])


def _arg(node: fx.Node, index: int, name: str):
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)
