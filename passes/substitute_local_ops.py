"""Swap in the local implementation a strategy names (e.g. vocabulary-parallel embedding)."""

from __future__ import annotations

import torch.fx as fx

from autopar.analysis.attention_sites import arg
from autopar.analysis.plan_view import PlanView
from autopar.core.errors import PassError
from autopar.core.graph_facts import META_KEY
from autopar.ops.local_ops import LOCAL_IMPLS, SYNC_BATCH_NORM, sync_batch_norm
from autopar.ops.loss_ops import REDUCTIONS
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


def substitute_sync_batch_norm(node: fx.Node, axis: str) -> None:
    """``node`` (an ``aten.batch_norm``) taking its statistics over ``axis``'s ranks."""
    node.target = sync_batch_norm
    node.kwargs = {**node.kwargs, "axis": axis}


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
                elif s.local_impl == SYNC_BATCH_NORM:
                    substitute_sync_batch_norm(node, axis)
                    changes.append(f"{node.name}: batch norm synchronised over {axis}")
        return PassResult(gm, modified=bool(changes), changes=changes)
