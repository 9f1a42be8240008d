"""Make the loss a rank returns one the runtime may average.

The runtime averages the loss, and the gradients, over the parts of the step's batch: the
data-parallel ranks (DDP and FSDP2 average gradients), the context-parallel ranks and the
microbatches (``ParallelModule.train_step``, the pipeline schedules). That is the batch's
loss where each part's loss is the mean of its own, equal share (``Partial("avg")`` on the
batch's axes) or the whole loss (``Replicate``). A loss that *sums* over the batch -- a
``reduction="sum"``, a sum divided by a count of the whole step's tokens (what a mean over
labelled tokens becomes, :mod:`autopar.trace.mean_losses`), by Hugging Face's
``num_items_in_batch`` or by the traced batch size -- is ``Partial("sum")``: the mean of the
parts would be the loss divided by their number. This pass multiplies such a loss by the
number of parts, so their mean is the sum.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.analysis.step_statistics import parts_scaled
from autopar.core.placements import Partial
from autopar.core.values import tensor_inputs, training_output, value_of
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.sync_batch_statistics import through_collectives

_SUM = Partial("sum")


def parts_summed(plan, node: fx.Node) -> tuple[bool, int]:
    """Whether the loss ``node`` is a sum over the parts of the step's batch (its ranks and
    microbatches), and the context-parallel ranks it sums over (1: none)."""
    producer, index = value_of(node)
    batch = plan.strategy(producer.name, "dp")
    over_batch = batch is not None and index < len(batch.outputs) and batch.outputs[index] == _SUM
    cp = plan.mesh.get("cp", 1)
    tokens = plan.strategy(producer.name, "cp") if cp > 1 else None
    over_tokens = tokens is not None and index < len(tokens.outputs) and \
        tokens.outputs[index] == _SUM
    return over_batch, cp if over_tokens else 1


@register_pass
class MeanLoss(GraphPass):
    name = "mean-loss"
    requires = ("insert-collectives",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        changes = []
        for a in tensor_inputs(output):
            if not training_output(a):
                continue
            root = through_collectives(a)[0]  # made whole on tp: its batch placements
            over_batch, cp = parts_summed(ctx.plan, root)
            dp = ctx.plan.mesh.get("dp", 1) if over_batch else 1
            if not over_batch and cp == 1:
                continue
            with gm.graph.inserting_before(output):
                scaled = gm.graph.call_function(parts_scaled, (a, dp, 1 if over_batch else 0, cp))
            scaled.meta["val"] = a.meta.get("val")
            output.replace_input_with(a, scaled)
            parts = [f"dp={dp}"] * (dp > 1) + ["microbatches"] * over_batch + \
                [f"cp={cp}"] * (cp > 1)
            changes.append(f"{root.name}: a sum over {' x '.join(parts)}, scaled by their "
                           "number for the runtime's mean over them")
        return PassResult(gm, modified=bool(changes), changes=changes)
