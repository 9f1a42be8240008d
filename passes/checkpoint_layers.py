"""Activation recomputation for outlined layers, through ``torch.utils.checkpoint``.

- ``full``: every layer call runs under non-reentrant checkpointing, so a layer keeps only
  its inputs and reruns its forward (with its collectives, and FSDP's gathers) in backward.
- ``selective``: the same wrapper with a selective-checkpoint policy
  (``create_selective_checkpoint_contexts``): ops whose input holds the sequence length
  twice (attention scores, their softmax and dropout) are recomputed, everything else is
  kept — Korthikanti et al.'s selective recomputation.

Requires :class:`OutlineLayers` first (it makes each layer a module the root calls).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


def _quadratic_policy(seq_len: int, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and list(first.shape).count(seq_len) >= 2:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def selective_context(seq_len: int):
    """Context factory for checkpoint(): recompute only the sequence-squared tensors."""
    return create_selective_checkpoint_contexts(functools.partial(_quadratic_policy, seq_len))


def checkpointed(module: torch.nn.Module, mode: str, seq_len: int, *args):
    """Call ``module`` under non-reentrant activation checkpointing (what the graph calls):
    ``mode`` "full" keeps only the inputs, "selective" also keeps all but the
    sequence-squared tensors."""
    if mode == "selective":
        context = functools.partial(selective_context, seq_len)
        return checkpoint(module, *args, use_reentrant=False, context_fn=context)
    return checkpoint(module, *args, use_reentrant=False)


@register_pass
class CheckpointLayers(GraphPass):
    name = "checkpoint-layers"
    requires = ("outline-layers",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        mode = ctx.plan.training.get("recompute", "none")
        paths = set(gm.meta.get("autopar_layer_paths", []))
        if mode == "none" or not paths:
            return PassResult(gm, modified=False)
        seq_len = int(ctx.plan.batch.get("seq", 0))
        changes = []
        for node in list(gm.graph.nodes):
            if node.op != "call_module" or node.target not in paths:
                continue
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(node.target)
                call = gm.graph.call_function(checkpointed, (module, mode, seq_len, *node.args))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            changes.append(f"{node.target}: {mode} recomputation")
        return PassResult(gm, modified=bool(changes), changes=changes)
