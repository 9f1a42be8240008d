"""Where a traced graph runs experts: the analysis expert parallelism is planned and executed on.

An MoE layer written the torchtitan / Hugging Face way sorts its tokens by expert and runs
them through grouped matmuls whose weights stack one matrix per expert (``(experts, in,
out)``) and whose ``offs`` says where each expert's rows end. The *expert region* of such
a layer is its grouped matmuls sharing one ``offs`` and the row-wise ops between them (an
activation, SwiGLU's product, a split of a fused gate/up projection): everything that runs
on the tokens while they are grouped by expert. It has one input (the sorted rows) and one
output; expert parallelism moves the rows to the experts' owners at the input and back at
the output (:mod:`autopar.ops.expert_ops`).

>>> import torch, autopar
>>> from autopar.models.moe import MoEConfig, MoEGPT
>>> model = MoEGPT(MoEConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16,
...                          experts=4, expert_ffn=32, routing="sorted"))
>>> idx = torch.randint(0, 32, (2, 8))
>>> [(r.experts, len(r.matmuls)) for r in expert_regions(autopar.trace(model, (idx, idx)))]
[(4, 2), (4, 2)]
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.graph_facts import META_KEY


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
    rows: fx.Node  # the sorted tokens the region reads (rows, hidden), or the dense slots
    offs: fx.Node | None  # cumulative rows per expert (None: dense slots)
    output: fx.Node  # the region's result (rows, hidden)
    weights: tuple[fx.Node, ...]  # get_attr nodes of the stacked expert weights
    members: frozenset[fx.Node]  # every node of the region
    experts: int
    # "grouped": sorted rows through grouped matmuls; "dense": GShard's capacity slots
    # (batch, ..., experts, ...) through einsums, the experts on ``expert_dim``; "loop": one
    # expert written as its own module (a ModuleList's ``expert_dim``-th), its rows picked
    # by ``nonzero``
    kind: str = "grouped"
    expert_dim: int = 0

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
    regions = [_region(offs, matmuls) for offs, matmuls in by_offs.items()]
    regions += _dense_regions(gm)
    regions += _loop_regions(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(regions, key=lambda r: min(order[m] for m in r.matmuls))


# ops a dense expert computation may run between its einsums, slot by slot
_ROWWISE = {torch.ops.aten.gelu.default, torch.ops.aten.silu.default,
            torch.ops.aten.relu.default, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor,
            torch.ops.aten.sigmoid.default, torch.ops.aten.tanh.default,
            torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default,
            torch.ops.aten.dropout.default, torch.ops.aten.chunk.default,
            torch.ops.aten.split.Tensor, operator.getitem}


def _dense_regions(gm: fx.GraphModule) -> list[ExpertRegion]:
    """GShard-style experts: ``einsum`` of capacity slots (batch, experts, capacity, hidden)
    with a stacked weight whose first label is the experts', kept in the output."""
    found = []  # (einsum, rows operand, rows' expert dim, weight)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.einsum.default:
            continue
        equation, operands = node.args[0], node.args[1]
        if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation:
            continue
        terms, out = equation.replace(" ", "").split("->")
        terms = terms.split(",")
        for wi in (0, 1):
            w = _through_casts(operands[wi])
            label = terms[wi][:1]
            other = terms[1 - wi]
            if (w.op == "get_attr" and label and label in other and label in out
                    and other.index(label) > 0 and other.index(label) == out.index(label)):
                found.append((node, operands[1 - wi], other.index(label), w))
                break
    regions: list[ExpertRegion] = []
    used: set[fx.Node] = set()
    for start, rows, dim, _ in found:
        if start in used:
            continue
        chain = [(start, rows, dim)]
        reach = _rowwise_after(start)
        for other, other_rows, other_dim, _ in found:
            if other is not start and other not in used and other_rows in reach:
                chain.append((other, other_rows, other_dim))
                reach |= _rowwise_after(other)
        used.update(n for n, _, _ in chain)
        weights = {n: w for n, _, _, w in found}
        matmuls = [n for n, _, _ in chain]
        experts = {_shape(weights[n])[0] for n in matmuls}
        members, entries, exits = _bounds(matmuls, [r for _, r, _ in chain])
        if len(entries) != 1 or len(exits) != 1 or len(experts) != 1:
            raise ExpertRegionError(f"{start.name}: the dense experts read {len(entries)} and "
                                    f"give {len(exits)} slot tensors")
        regions.append(ExpertRegion(tuple(matmuls), entries.pop(), None, exits[0],
                                    tuple(dict.fromkeys(weights[n] for n in matmuls)),
                                    frozenset(members), experts.pop(), "dense", dim))
    return regions


def _loop_regions(gm: fx.GraphModule) -> list[ExpertRegion]:
    """Experts written as modules of a list, each run on the rows ``nonzero`` picked for it
    (a data-dependent row count): for each such linear, the shortest module path ending in
    a list index whose linears form one region (one input, one output) is one expert."""
    linears = [n for n in gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten.linear.default
               and isinstance(n.args[1], fx.Node) and _through_casts(n.args[1]).op == "get_attr"]
    by_prefix: dict[str, list[fx.Node]] = {}
    for n in linears:
        parts = str(_through_casts(n.args[1]).target).split(".")
        for j in range(len(parts) - 1):
            if parts[j].isdigit():
                by_prefix.setdefault(".".join(parts[:j + 1]), []).append(n)
    found: list[tuple[str, ExpertRegion]] = []  # (the list's path, one expert's region)
    taken: set[fx.Node] = set()
    for prefix in sorted(by_prefix, key=lambda p: p.count(".")):
        group = [n for n in by_prefix[prefix] if n not in taken]
        if not group:
            continue
        region = _try_loop_region(prefix, group)
        if region is not None:
            found.append((prefix.rsplit(".", 1)[0], region))
            taken.update(group)
    counts: dict[str, int] = {}
    for container, _ in found:
        counts[container] = counts.get(container, 0) + 1
    return [ExpertRegion(r.matmuls, r.rows, None, r.output, r.weights, r.members,
                         counts[container], "loop", r.expert_dim) for container, r in found]


def _try_loop_region(prefix: str, matmuls: list[fx.Node]) -> ExpertRegion | None:
    rows = [mm.args[0] for mm in matmuls]
    if not any(_picked_rows(r) for r in rows):
        return None  # its one entry must be such rows; and _bounds walks the whole graph
    members, entries, exits = _bounds(matmuls, rows)
    if len(entries) != 1 or len(exits) != 1 or not _picked_rows(next(iter(entries))):
        return None
    # the expert's parameters: each linear's weight, and its bias where it has one
    params = [a for mm in matmuls for a in mm.args[1:3] if isinstance(a, fx.Node)]
    weights = tuple(dict.fromkeys(w for w in map(_through_casts, params) if w.op == "get_attr"))
    index = int(prefix.rsplit(".", 1)[1])
    return ExpertRegion(tuple(matmuls), entries.pop(), None, exits[0], weights,
                        frozenset(members), 0, "loop", index)


def _picked_rows(node) -> bool:
    """Does ``node`` hold a data-dependent number of rows (tokens ``nonzero`` picked)?"""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.ndim >= 1 and isinstance(val.shape[0],
                                                                        torch.SymInt)


def _rowwise_after(node: fx.Node) -> set[fx.Node]:
    """Nodes reached from ``node`` through slot-by-slot ops only."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen and user.op == "call_function" and user.target in _ROWWISE:
                seen.add(user)
                todo.append(user)
    return seen


def _region(offs: fx.Node, matmuls: list[fx.Node]) -> ExpertRegion:
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
    members, entries, exits = _bounds(matmuls, [mm.args[0] for mm in matmuls])
    if len(entries) != 1:
        raise ExpertRegionError(f"{matmuls[0].name}: the experts read {len(entries)} "
                                "different row tensors")
    if len(exits) != 1:
        raise ExpertRegionError(f"{matmuls[0].name}: {len(exits)} values leave the experts "
                                f"({', '.join(sorted(n.name for n in exits))})")
    (rows,) = entries
    return ExpertRegion(tuple(matmuls), rows, offs, exits[0], tuple(dict.fromkeys(weights)),
                        frozenset(members), experts.pop())


def _bounds(matmuls: list[fx.Node], rows: list) -> tuple[set, set, list]:
    """(members, entries, exits) of the region of ``matmuls`` reading ``rows``: the
    matmuls and every node between them; the values read from outside; the values used
    outside (trace-time asserts aside)."""
    members = set(matmuls) | (_reachable(matmuls, forward=True)
                              & _reachable(rows, forward=False))
    entries = set(rows) - members
    exits = [n for n in members
             if any(u not in members and u.target not in _CHECKS for u in n.users)]
    return members, entries, exits


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
# a precision cast, and the tensor-parallel collectives a weight may be read through
_MOVES = {"cast_to", "cast_weight", "redistribute", "grad_all_reduce", "gather_scatter_grad"}


def expert_module(root: torch.nn.Module, targets: list[str] | tuple[str, ...]) -> str | None:
    """The module path holding the expert weights ``targets`` (attribute paths under
    ``root``) and nothing else, or None when no module does. ZeRO-3 with expert parallelism
    shards that module over the ranks holding the same experts
    (:mod:`autopar.passes.outline_experts`); torchtitan's ``GroupedExperts`` and Hugging
    Face's ``MixtralExperts`` are such modules."""
    common: list[str] = []
    for level in zip(*(t.split(".")[:-1] for t in targets)):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    path = ".".join(common)
    if not path:
        return None
    try:
        module = root.get_submodule(path)
    except AttributeError:
        return None
    held = {f"{path}.{n}" for n, _ in module.named_parameters()}
    held |= {f"{path}.{n}" for n, _ in module.named_buffers()}
    return path if held == set(targets) else None


def _through_casts(node: fx.Node) -> fx.Node:
    """A weight read through dtype casts (a bf16 plan casts it), tensor-parallel
    collectives, or transposes that keep the expert dim first (Hugging Face stores
    ``(experts, out, in)``) is still that weight."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        keeps_experts = (
            node.target in _CASTS or getattr(node.target, "__name__", "") in _MOVES
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
