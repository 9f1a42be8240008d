"""Mean losses over a data-dependent count, written as their sum over that count.

``cross_entropy(reduction="mean")`` and ``nll_loss`` with class-index targets divide by the
number (with class weights, the weight) of targets that are not ``ignore_index``: a padded
batch, or a masked LM's 15% of labelled tokens, has a different count in every part of a
split batch, so the mean of the parts' means is not the batch's mean. As one op the count
is invisible to the planner; written out as ``sum / count`` it is a statistic of the labels
like any other, which the program takes over the whole step (every data-parallel rank,
context-parallel rank and microbatch: ``passes/sync_batch_statistics.py``). Torch computes
the mean the same way (the sum, then one division by the total weight).

>>> import torch, torch.nn.functional as F, autopar
>>> class Head(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.proj = torch.nn.Linear(4, 3)
...     def forward(self, x, t):
...         return F.cross_entropy(self.proj(x), t)
>>> gm = autopar.trace(Head(), (torch.randn(4, 4), torch.tensor([0, 2, -100, 1])))
>>> [n.name for n in gm.graph.nodes if n.op == "call_function"][1:]
['cross_entropy_loss', 'ne', 'sum_1', 'div']
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten

_MEAN_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default,
                aten.nll_loss_nd.default, aten.nll_loss2d.default)
_MEAN, _SUM = 1, 2


def split_mean_losses(gm: fx.GraphModule) -> int:
    """Rewrite every class-index mean loss of ``gm`` as ``loss(sum) / count``; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MEAN_LOSSES:
            continue
        args = _positional(node)
        x, t = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in args[:2])
        if not (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)):
            continue
        if t.is_floating_point() or args[3] != _MEAN:  # class probabilities: a fixed count
            continue
        _split(gm.graph, node, args, detect_fake_mode([x, t]))
        done += 1
    return done


def _positional(node: fx.Node) -> list:
    """The loss's arguments by position: (input, target, weight, reduction, ignore_index,
    [label_smoothing]), defaults filled in."""
    schema = node.target._schema.arguments
    args = list(node.args)
    for a in schema[len(args):]:
        args.append(node.kwargs[a.name] if a.name in node.kwargs else a.default_value)
    return args


def _split(graph: fx.Graph, node: fx.Node, args: list, mode) -> None:
    """``node`` itself becomes the sum (plans and messages keep its name), divided after."""
    target, weight, ignore = args[1], args[2], int(args[4])
    node.args, node.kwargs = (*args[:3], _SUM, *args[4:]), {}
    node.meta["val"] = _value(node, mode)
    with graph.inserting_before(node.next):
        valid = _call(graph, node, aten.ne.Scalar, (target, ignore), mode)
        if weight is None:
            count = _call(graph, node, aten.sum.default, (valid,), mode)
        else:  # the class weight of every counted target
            safe = _call(graph, node, aten.where.ScalarOther, (valid, target, 0), mode)
            picked = _call(graph, node, aten.index_select.default,
                           (weight, 0, _flat(graph, node, safe, mode)), mode)
            kept = _call(graph, node, aten.mul.Tensor,
                         (picked, _flat(graph, node, valid, mode)), mode)
            count = _call(graph, node, aten.sum.default, (kept,), mode)
        mean = _call(graph, node, aten.div.Tensor, (node, count), mode)
    node.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)


def _flat(graph: fx.Graph, node: fx.Node, value: fx.Node, mode) -> fx.Node:
    return _call(graph, node, aten.reshape.default, (value, [-1]), mode)


def _call(graph: fx.Graph, like: fx.Node, target, args: tuple, mode) -> fx.Node:
    """A new node computing ``target(*args)`` (named as torch.export names it), its fake
    value computed, and placed and sourced like the loss ``like`` (module path and source
    line in messages)."""
    new = graph.create_node("call_function", target, args, name=target._opname)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["val"] = _value(new, mode)
    return new


def _value(node: fx.Node, mode) -> torch.Tensor:
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    with mode if mode is not None else contextlib.nullcontext():
        return node.target(*fx.node.map_aggregate(node.args, val))
