"""Swap in the local implementation a strategy names (e.g. vocabulary-parallel embedding)."""

from __future__ import annotations

import torch.fx as fx

from autopar.errors import PassError
from autopar.graph_facts import META_KEY
from autopar.local_ops import LOCAL_IMPLS
from autopar.loss_ops import REDUCTIONS
from autopar.passes.attention_sites import arg
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.plan_view import PlanView


@register_pass
class SubstituteLocalOps(GraphPass):
    name = "substitute-local-ops"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        view = PlanView(gm, ctx.plan)
        changes = []
        for node in gm.graph.nodes:
            for axis in view.axes:
                s = view.strategy(node, axis)
                if s is None or not s.local_impl or view.size(axis) == 1:
                    continue
                impl = LOCAL_IMPLS.get(s.local_impl)
                if impl is None:
                    raise PassError(
                        f"node {node.name} needs local implementation {s.local_impl!r}, "
                        "which this autopar does not have",
                        where=f"strategies.{node.name}.{axis}",
                        fix=f"known implementations: {', '.join(sorted(LOCAL_IMPLS))}",
                    )
                if s.local_impl == "vocab_parallel_embedding":
                    weight, indices = node.args[0], node.args[1]
                    vocab = weight.meta[META_KEY].shapes[0][0]
                    node.target = impl
                    node.args = (weight, indices, axis, vocab)
                    node.kwargs = {}
                    changes.append(f"{node.name}: vocabulary-parallel embedding on {axis}")
                elif s.local_impl == "vocab_parallel_cross_entropy":
                    node.kwargs = {"ignore_index": arg(node, 4, "ignore_index", -100),
                                   "reduction": REDUCTIONS[arg(node, 3, "reduction", 1)],
                                   "label_smoothing": arg(node, 5, "label_smoothing", 0.0)}
                    node.target = impl
                    node.args = (node.args[0], node.args[1], axis)
                    changes.append(f"{node.name}: vocabulary-parallel cross-entropy on {axis}")
        return PassResult(gm, modified=bool(changes), changes=changes)
