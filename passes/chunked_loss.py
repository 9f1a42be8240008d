"""Compute every cross-entropy over class indices a block of tokens at a time.

``aten.cross_entropy_loss`` keeps the ``[tokens, vocab]`` log-softmax (fp32 under autocast)
for backward and makes its gradient beside it; :func:`autopar.ops.loss_ops.chunked_cross_entropy`
keeps one log-sum-exp a token. Same function, same gradients; the plan's memory model prices
the chunked one wherever :func:`autopar.ops.loss_ops.chunkable` holds, so this pass runs on every
program (not only long-context ones) and must rewrite exactly those calls.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.analysis.attention_sites import arg
from autopar.analysis.chunkable_loss import VIEWS, chunkable_loss, fp32_cast
from autopar.ops.loss_ops import REDUCTIONS, chunked_cross_entropy
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass

aten = torch.ops.aten


def _fold_cast(gm: fx.GraphModule, loss: fx.Node) -> bool:
    """Read the logits before a fp32 cast (the loss upcasts a block at a time): the cast's
    fp32 copy then no longer takes part in backward. ``loss(view(cast(x)))`` becomes
    ``loss(view(x))``."""
    views, node = [], loss.args[0]
    while node.op == "call_function" and node.target in VIEWS:
        views.append(node)
        node = node.args[0]
    source = fp32_cast(node)
    if source is None:
        return False
    with gm.graph.inserting_before(loss):
        value = source
        for view in reversed(views):
            value = gm.graph.call_function(view.target, (value, *view.args[1:]), view.kwargs)
            value.meta = dict(view.meta)
    loss.replace_input_with(loss.args[0], value)
    for view in views:  # the old views, now unused
        if not view.users:
            gm.graph.erase_node(view)
    return True


@register_pass
class ChunkedLoss(GraphPass):
    name = "chunked-loss"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        changes = []
        for node in gm.graph.nodes:
            if not chunkable_loss(node):
                continue
            node.kwargs = {"weight": arg(node, 2, "weight"),
                           "reduction": REDUCTIONS[arg(node, 3, "reduction", 1)],
                           "ignore_index": arg(node, 4, "ignore_index", -100),
                           "label_smoothing": arg(node, 5, "label_smoothing", 0.0)}
            node.target = chunked_cross_entropy
            node.args = (node.args[0], node.args[1])
            folded = _fold_cast(gm, node)
            changes.append(f"{node.name}: cross-entropy a block of tokens at a time"
                           + (", upcasting each block (the fp32 cast before it folded in)"
                              if folded else ""))
        return PassResult(gm, modified=bool(changes), changes=changes)
