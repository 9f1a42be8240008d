"""Expected sizes for the data-dependent row counts of routing.

An expert written as its own module runs on the rows ``torch.where(indices == e)`` picks.
Their number is known only at run time: the traced graph has an unbacked size (``u0``).
Pricing it at one row would make the experts look free. Pricing it at every row would
price each expert on every token. The expected count is ``numel x density`` of the
condition:

- an ``eq`` of top-k expert indices with one expert, or a slice of ``one_hot(indices, E)``:
  ``1 / E``, tokens choosing experts evenly (the balancing loss's aim; the plan reports
  the imbalance this ignores);
- any other condition: 1, every element (an upper bound: never an underestimate).

:func:`expected_sizes` maps each unbacked symbol of a graph to its expected value;
:func:`autopar.trace.op_measure.concrete` reads it while the graph is annotated.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
# ops whose output's elements are the input's, rearranged or selected
_THROUGH = {aten.reshape.default, aten.view.default, aten.permute.default,
            aten.transpose.int, aten.select.int, aten.slice.Tensor, aten.unsqueeze.default,
            aten.squeeze.dim, aten.squeeze.default, aten.flatten.using_ints,
            aten.expand.default, aten.clone.default, aten.contiguous.default,
            aten._to_copy.default, aten.to.dtype, operator.getitem}
PICKS = {aten.where.default, aten.nonzero.default, aten.argwhere.default}


def expected_sizes(gm: fx.GraphModule) -> dict:
    """{unbacked symbol: expected int} for the row counts ``where``/``nonzero`` make."""
    out: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in PICKS or len(node.args) != 1:
            continue
        cond = node.args[0]
        val = cond.meta.get("val") if isinstance(cond, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
            continue
        expected = max(1, math.ceil(val.numel() * density(cond)))
        for result in _results(node):
            size = result.shape[0] if result.ndim else None
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and getattr(expr, "is_Symbol", False):
                out.setdefault(expr, expected)
    return out


def density(cond: fx.Node) -> float:
    """The expected fraction of true elements of a boolean ``cond``."""
    node = cond
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is aten.one_hot.default:
            return 1.0 / _classes(node)
        if node.target in (aten.eq.Scalar, aten.eq.Tensor):
            experts = _topk_choices(node.args[0])
            if experts and not isinstance(node.args[1], fx.Node):
                return 1.0 / experts
            return 1.0
        if node.target not in _THROUGH or not node.args:
            break
        node = node.args[0]
    return 1.0


def _topk_choices(node) -> int | None:
    """E when ``node`` is (a view of) the indices ``topk`` chose among E."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].target is aten.topk.default and node.args[1] == 1:
            topk = node.args[0]
            dim = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("dim", -1)
            shape = topk.args[0].meta["val"].shape
            return int(shape[dim])
        if node.target not in _THROUGH:
            return None
        node = node.args[0]
    return None


def _classes(one_hot: fx.Node) -> int:
    return int(one_hot.meta["val"].shape[-1])


def _results(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    return [v for v in val or () if isinstance(v, torch.Tensor)]
