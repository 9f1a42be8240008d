"""Create every tensor on the device this rank runs on, not the one the model was traced on.

Tracing records factory calls with the device they ran on: a GPT's position
``torch.arange(t, device=idx.device)`` becomes ``aten.arange(..., device=cpu)`` when the
model was traced on the CPU (as ``parallelize`` does, before moving the program to its GPU).
Moving the module moves its parameters and buffers, not these arguments, so the program's
first ``embedding(wpe, arange)`` on CUDA failed with "index is on cpu". Moves are recorded
the same way: HF Llama's rotary embedding reads ``inv_freq.to(x.device)``, traced as
``aten.to.device(inv_freq, cpu, float32)``, which on CUDA moved the buffer back to the CPU.
This pass rewrites every device argument (``device=`` or a positional ``torch.device``) to
the rank's device (``PassContext.device``); on the device the model was traced on it
changes nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


@register_pass
class PlaceCreatedTensors(GraphPass):
    name = "place-created-tensors"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        target = torch.device(ctx.device)
        changes = []
        for node in gm.graph.nodes:
            device = node.kwargs.get("device")
            if isinstance(device, (str, torch.device)) and torch.device(device) != target:
                node.kwargs = {**node.kwargs, "device": target}
                changes.append(f"{node.name}: device {device} -> {target}")
            moved = [target if isinstance(a, torch.device) and a != target else a
                     for a in node.args]
            if moved != list(node.args):
                changes.append(f"{node.name}: device argument -> {target}")
                node.args = tuple(moved)
        if changes:
            gm.recompile()
        return PassResult(gm, modified=bool(changes), changes=changes)
