"""Make a mean loss over tokens exact under context parallelism.

A cross-entropy with ``reduction="mean"`` on a rank's tokens averages over that rank's
non-ignored targets. Under cp the ranks of one sequence hold different numbers of them (HF
shifts labels and ignores each sequence's last position, which only one rank holds), so the
average of the ranks' means is not the mean over the sequence. This pass rewrites such a
loss into :func:`autopar.context_ops.token_mean_cross_entropy`: the rank's sum over its
tokens, divided by the count over the cp group and scaled by cp, whose average over the
group (what gradient averaging and the reported loss take) is the exact mean.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.context_ops import token_mean_cross_entropy
from autopar.local_ops import vocab_parallel_loss
from autopar.passes.attention_sites import arg
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.plan_view import PlanView
from autopar.placements import Partial

aten = torch.ops.aten
CP = "cp"


@register_pass
class TokenMeanLoss(GraphPass):
    name = "token-mean-loss"
    requires = ("localize-shapes",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        view = PlanView(gm, ctx.plan)
        if CP not in view.axes or view.size(CP) == 1:
            return PassResult(gm, modified=False)
        changes = []
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is vocab_parallel_loss:
                self._scale_vocab_parallel(view, node, changes)
                continue
            if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
                continue
            s = view.strategy(node, CP)
            if s is None or arg(node, 3, "reduction", 1) != 1 or s.outputs[0] != Partial("avg"):
                continue
            node.kwargs = {"weight": arg(node, 2, "weight"),
                           "ignore_index": arg(node, 4, "ignore_index", -100),
                           "label_smoothing": arg(node, 5, "label_smoothing", 0.0), "axis": CP}
            node.target = token_mean_cross_entropy
            node.args = (node.args[0], node.args[1])
            changes.append(f"{node.name}: mean over the cp group's tokens")
        return PassResult(gm, modified=bool(changes), changes=changes)

    @staticmethod
    def _scale_vocab_parallel(view: PlanView, node: fx.Node,
                              changes: list[str]) -> None:
        """A vocabulary-parallel loss (substituted already): the same mean over the cp
        group's tokens, by its ``token_mean_axis``."""
        s = view.strategy(node, CP)
        if s is None or node.kwargs.get("reduction") != "mean" or s.outputs[0] != Partial("avg"):
            return
        node.kwargs = {**node.kwargs, "token_mean_axis": CP}
        changes.append(f"{node.name}: mean over the cp group's tokens (vocabulary-parallel)")
