"""What a program that fuses its elementwise ops moves: the bytes it never writes or reads.

Eager PyTorch runs every elementwise op as its own kernel, writing its output to memory for
the next op to read back. Programs that fuse them do not: Transformer Engine's kernels
(RMSNorm with the fp8 cast of its output, SwiGLU, rotary embeddings, bias-dropout-add, as
Megatron-LM and NeMo run them) and ``torch.compile`` (Inductor fuses chains of pointwise
ops and reductions into one generated kernel). A fused chain reads what it takes from
outside once, writes what leaves it once, and launches one kernel. So when the cost model
prices such a program (``PinnedConfig.fuse_elementwise``), a value passed from one
elementwise op to another is neither written nor read back, and only the first op of a
chain pays a kernel launch. autopar's own runtime runs eager ops; its plans are priced
unfused.

This is an analysis of the traced graph; :class:`autopar.solver.pricing.costs.CostTables` applies
it (:func:`autopar.solver.pricing.kernel_work.kernel_work`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.graph_facts import META_KEY, NodeFacts
from autopar.solver.model.problem import Problem

_NOT_FUSED = ("embedding", "index_put", "scatter", "sort", "topk", "nonzero", "unique",
              "multinomial", "bernoulli", "cumsum", "argmax", "argmin")
"""Memory-bound ops that stay kernels of their own in a fused program: gathers and scatters
whose backward is an atomic scatter-add, sorts and scans, random draws."""


@dataclass(frozen=True)
class FusedBytes:
    """Traced bytes one op moves inside a fused chain, which the fused program does not."""

    read: float  # inputs another fused op produced (read from registers, not memory)
    written: float  # outputs only fused ops read (never written out)
    continues: bool  # it reads a fused op's output: it runs in that op's kernel


def fusable(node: fx.Node) -> bool:
    """Whether a fusing compiler folds ``node`` into its neighbours' kernel: an aten op
    that computes no matmul FLOPs, is no view and is not one of :data:`_NOT_FUSED`."""
    facts: NodeFacts | None = node.meta.get(META_KEY)
    if node.op != "call_function" or facts is None or facts.is_view or facts.fwd_flops:
        return False
    target = facts.target
    if not target.startswith("aten.") or "scaled_dot_product" in target:
        return False
    return not any(word in target for word in _NOT_FUSED)


def _is_view(node: fx.Node) -> bool:
    """A node that runs no kernel: a view of its input, or a getitem of a tuple."""
    facts: NodeFacts | None = node.meta.get(META_KEY)
    return node.op == "call_function" and (
        node.target is operator.getitem or (facts is not None and facts.is_view))


def through_views(node: fx.Node) -> fx.Node:
    """The node whose kernel produced ``node``'s storage: views and getitems hop back."""
    while _is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _readers(node: fx.Node) -> list[fx.Node]:
    """The ops that read ``node``'s storage, looking through views and getitems."""
    out: list[fx.Node] = []
    pending = list(node.users)
    while pending:
        user = pending.pop()
        if _is_view(user):
            pending.extend(user.users)
        else:
            out.append(user)
    return out


def _value_bytes(node: fx.Node) -> float:
    facts: NodeFacts | None = node.meta.get(META_KEY)
    if facts is None or not facts.shapes:
        return 0.0
    total = 0.0
    for shape, dtype in zip(facts.shapes, facts.dtypes or ("float32",) * len(facts.shapes)):
        numel = 1
        for s in shape:
            numel *= s
        total += numel * _element_size(dtype)
    return total


_SIZES: dict[str, int] = {}


def _element_size(dtype: str) -> int:
    if dtype not in _SIZES:
        torch_dtype = getattr(torch, dtype, None)
        _SIZES[dtype] = (torch.empty((), dtype=torch_dtype).element_size()
                         if isinstance(torch_dtype, torch.dtype) else 4)
    return _SIZES[dtype]


def fused_bytes(gm: fx.GraphModule, skip: frozenset[str] = frozenset()) -> dict[str, FusedBytes]:
    """Node name -> :class:`FusedBytes` for every fusable op that passes values to or takes
    them from another fusable op; ``skip`` names nodes priced elsewhere (fused attention).

    >>> import torch
    >>> from autopar.trace import trace
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.relu(x * 2) + 1
    >>> fused = fused_bytes(trace(M(), (torch.randn(4, 8),)))
    >>> sorted((name, f.read, f.written, f.continues) for name, f in fused.items())
    [('add', 128.0, 0.0, True), ('mul', 0.0, 128.0, False), ('relu', 128.0, 128.0, True)]
    """
    ops = {n for n in gm.graph.nodes if n.name not in skip and fusable(n)}
    kernel = _kernels(gm, ops)
    out: dict[str, FusedBytes] = {}
    for node in ops:
        facts: NodeFacts = node.meta[META_KEY]
        read = float(sum(_value_bytes(a) for a in node.all_input_nodes
                         if kernel.get(through_views(a)) == kernel[node]))
        readers = _readers(node)
        inside = readers and all(kernel.get(r) == kernel[node] for r in readers)
        written = _value_bytes(node) if inside else 0.0
        if read or written:
            out[node.name] = FusedBytes(min(read, float(facts.bytes_read)),
                                        min(written, float(facts.bytes_written)), read > 0)
    for node in gm.graph.nodes:  # a view of a value that never leaves its kernel
        root = through_views(node)
        if root is node or root not in ops or root.name not in out or not out[root.name].written:
            continue
        readers = _readers(node)
        if readers and all(kernel.get(r) == kernel[root] for r in readers):
            out[node.name] = FusedBytes(0.0, _value_bytes(node), True)
    return out


def _kernels(gm: fx.GraphModule, ops: set[fx.Node]) -> dict[fx.Node, int]:
    """Fusable op -> the kernel it runs in: the number of unfused kernels (matmuls,
    attention, collectives) on the longest path before it. Two connected fusable ops share
    a kernel unless one waits on an unfused op the other feeds: a residual add and the next
    layer's residual add are connected, but the attention between them splits them."""
    barriers: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        depth = 0
        for a in node.all_input_nodes:
            source = through_views(a)  # a view runs no kernel: its source's does
            unfused = source.op == "call_function" and source not in ops
            depth = max(depth, barriers[source] + unfused)
        barriers[node] = depth
    return {node: barriers[node] for node in ops}


def fuse_elementwise(problem: Problem, gm: fx.GraphModule, on: bool) -> Problem:
    """``problem`` priced with its elementwise chains fused (a compiled program, ``compile``;
    ``PinnedConfig.fuse_elementwise``) when ``on``."""
    if on:
        problem.fused_elementwise = fused_bytes(gm, skip=problem.fused_attention)
    return problem
