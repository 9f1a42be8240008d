"""What the pricing reads off one traced node: its matmul shape, whether it runs a kernel at
all, whether it adds a bias, the parameters it reads, the loss the runtime chunks.

Facts of the graph alone (no setting, no placement): the cost tables
(:class:`autopar.solver.pricing.costs.CostTables`) and the pricing of each kind of op
(:mod:`autopar.solver.pricing.kinds`) read them.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.analysis.chunkable_loss import chunkable_loss
from autopar.core.graph_facts import META_KEY, NodeFacts
from autopar.solver.model.problem import Decision

FLOAT_DTYPES = {"float32", "float64", "float16", "bfloat16"}
AUTOCAST_FP32_TARGETS = frozenset({
    "aten.cross_entropy_loss.default", "aten.log_softmax.int", "aten._log_softmax.default",
    "aten.nll_loss.default", "aten.nll_loss_forward.default", "aten.nll_loss_nd.default",
})
"""Losses ``torch.autocast`` runs in fp32 (CUDA and CPU autocast fp32 lists)."""
MATMUL_TARGETS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default")
"""Ops the ``op`` policy counts as matmuls (a linear layer's, which the runtime sees as
``mm``/``addmm``)."""
PARAM_VIEWS = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
               torch.ops.aten.t.default, torch.ops.aten.view.default,
               torch.ops.aten.reshape.default, torch.ops.aten.alias.default,
               torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default}
"""Ops whose output shares a weight's storage (a transposed weight a grouped matmul keeps)."""

_DROPOUTS = ("aten.dropout.default", "aten.feature_dropout.default",
             "aten.alpha_dropout.default", "aten.feature_alpha_dropout.default")


def matmul_shape(node: fx.Node) -> tuple[int, int, int] | None:
    """(m, n, k) of a matmul-like node, from its traced shapes (for shape-aware efficiency)."""
    facts: NodeFacts = node.meta[META_KEY]
    name = facts.target
    ins = [a.meta[META_KEY].shapes[0] for a in node.all_input_nodes
           if META_KEY in a.meta and a.meta[META_KEY].shapes]
    if not facts.shapes or not ins:
        return None
    out = facts.shapes[0]
    if "linear" in name and len(ins) >= 2:
        k = ins[0][-1]
        return numel(out) // max(out[-1], 1), out[-1], k
    if "addmm" in name and len(ins) >= 3:
        return ins[1][0], ins[2][1], ins[1][1]
    if any(t in name for t in ("aten.mm", "aten.bmm", "aten.matmul", "baddbmm")):
        k = ins[0][-1]
        return numel(out) // max(out[-1], 1), out[-1], k
    if "scaled_dot_product" in name:
        q = ins[0]
        return numel(q) // max(q[-1], 1), ins[1][-2], q[-1]
    return None


def identity_dropout(node: fx.Node) -> bool:
    """A dropout that ATen returns its input from unchanged (``p == 0``, or not training:
    ``_dropout_impl``), so it runs no kernel forward or backward. nanoGPT's default and
    most Llama configurations train with ``p == 0``.

    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> identity_dropout(g.call_function(torch.ops.aten.dropout.default, (x, 0.0, True)))
    True
    >>> identity_dropout(g.call_function(torch.ops.aten.dropout.default, (x, 0.1, True)))
    False
    """
    if node.op != "call_function" or str(node.target) not in _DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return (isinstance(p, (int, float)) and p == 0) or train is False


def has_bias(node: fx.Node) -> bool:
    """Whether a linear or addmm node adds a bias (an input tensor beyond its two operands)."""
    target = node.meta[META_KEY].target
    if "linear" in target:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return isinstance(bias, fx.Node)
    return "addmm" in target


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def itemsize(dtype: str) -> int:
    """Bytes of one element of a non-float dtype (4 for any other)."""
    return {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}.get(dtype, 4)


def param_args(node: fx.Node) -> list[tuple[fx.Node, NodeFacts]]:
    """The parameters ``node`` reads directly (``get_attr`` inputs with parameter facts)."""
    out = []
    for arg in node.all_input_nodes:
        facts = arg.meta.get(META_KEY)
        if arg.op == "get_attr" and facts is not None and facts.param is not None:
            out.append((arg, facts))
    return out


def chunked_loss_shape(d: Decision) -> tuple[int, int] | None:
    """(tokens, classes) as traced of a cross-entropy the runtime computes chunked
    (``passes/chunked_loss.py``), else None."""
    if d.kind != "op" or not chunkable_loss(d.nodes[0]):
        return None
    tokens, classes = d.nodes[0].args[0].meta["val"].shape
    return int(tokens), int(classes)
