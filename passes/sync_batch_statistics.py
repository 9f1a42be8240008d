"""Make batch statistics whole under data parallelism, so batch-coupled models train exactly.

Each data-parallel rank runs the graph on its own sequences. A reduction over the batch
(a mean of router probabilities, a token count per expert, a batch norm's mean) then gives
that rank's part of the value: ``Partial`` on ``dp`` in the plan. Where the plan has a
consumer need it whole (a product of two batch means in a load-balancing loss), this pass
all-reduces it over the data-parallel group first, with the backward that keeps every
rank's gradient that of the global batch (:mod:`autopar.comm_ops`). A partial value that
only reaches the loss linearly is left alone: gradient averaging already makes it exact.

Runs after the collectives of the other axes are in, reading through them to each value's
producer; only plans whose batch-coupled values the planner found exact get here
(``plan.training["batch_coupling"]``).
"""

from __future__ import annotations

import torch.fx as fx

from autopar import comm_ops
from autopar.errors import PassError
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.insert_collectives import replace_tensor_inputs
from autopar.placements import Partial, Replicate
from autopar.values import tensor_inputs, value_of

DP = "dp"
_COMM = (comm_ops.redistribute, comm_ops.redistribute_output, comm_ops.grad_all_reduce,
         comm_ops.gather_scatter_grad)


@register_pass
class SyncBatchStatistics(GraphPass):
    name = "sync-batch-statistics"
    requires = ("insert-collectives",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        plan = ctx.plan
        if plan.mesh.get(DP, 1) == 1:
            return PassResult(gm, modified=False)
        graph = gm.graph
        synced: dict[tuple[fx.Node, int], fx.Node] = {}
        changes: list[str] = []
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target in _COMM:
                continue
            strategy = plan.strategy(node.name, DP)
            if strategy is None:
                continue
            new_by_slot: dict[int, fx.Node] = {}
            for slot, a in enumerate(tensor_inputs(node)):
                need = strategy.inputs[slot]
                root, chain = _through_collectives(a)
                producer, index = value_of(root)
                made = plan.strategy(producer.name, DP)
                have = made.outputs[index] if made and index < len(made.outputs) else None
                if not isinstance(have, Partial) or isinstance(need, Partial):
                    continue
                if not isinstance(need, Replicate):
                    raise PassError(
                        f"{node.name} needs {root.name} as {need} on dp, made as {have}: a batch "
                        "statistic is only made whole here",
                        where=f"strategies.{node.name}.dp",
                        fix="re-plan this model: the planner makes batch statistics whole")
                key = (producer, index)
                if key not in synced:
                    with graph.inserting_after(root):
                        sync = graph.call_function(comm_ops.redistribute,
                                                   (root, DP, str(have), "R"))
                    sync.meta["val"] = root.meta.get("val")
                    synced[key] = sync
                    changes.append(f"{root.name}: batch statistic {have} -> R on dp "
                                   f"({sync.name})")
                sync = synced[key]
                if chain is None:
                    new_by_slot[slot] = sync
                else:
                    chain.replace_input_with(root, sync)
            if new_by_slot:
                replace_tensor_inputs(node, new_by_slot)
        return PassResult(gm, modified=bool(changes), changes=changes)


def _through_collectives(a: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """The value ``a`` was redistributed from on other axes, and the first collective that
    reads it (None when ``a`` is the value itself)."""
    first = None
    while a.op == "call_function" and a.target in _COMM:
        first, a = a, a.args[0]
    return a, first
