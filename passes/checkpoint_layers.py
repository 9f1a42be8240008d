"""Activation recomputation for outlined layers, through ``torch.utils.checkpoint``.

- ``full``: every layer call runs under non-reentrant checkpointing, so a layer keeps only
  its inputs and reruns its forward (with its collectives, and FSDP's gathers) in backward.
- ``selective``: the same wrapper with a selective-checkpoint policy
  (``create_selective_checkpoint_contexts``): ops whose input holds the sequence length
  twice (attention scores, their softmax and dropout) are recomputed, everything else is
  kept — Korthikanti et al.'s selective recomputation. A layer with no such tensor (its
  attention fused) is left as is: the checkpoint would recompute nothing, and it would cache
  every other output of the layer, more than autograd keeps.
- a plan with ``recompute`` "mixed" gives each layer its own mode
  (``training.recompute_layers``, in the order the layers run); "none" leaves a layer as is.
- ``op``: torchtitan's per-op selective policy (``selective_ac_option = "op"``): the
  outputs of matrix multiplies are kept except every second one in each layer, and so are
  attention's; every other op (norms, rotary embedding, activations) is recomputed.

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

from autopar.core.errors import PassError
from autopar.core.graph_facts import META_KEY
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


def _quadratic_policy(seq_len: int, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and list(first.shape).count(seq_len) >= 2:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def selective_context(seq_len: int):
    """Context factory for checkpoint(): recompute only the sequence-squared tensors."""
    return create_selective_checkpoint_contexts(functools.partial(_quadratic_policy, seq_len))


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
"""A linear layer's matmul (``addmm`` with a bias); torchtitan counts ``mm`` (no biases)."""

SAVED_OPS = (
    *MATMULS,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
"""What the ``op`` policy keeps: matmul outputs (all but every second) and attention's."""


def op_context():
    """Context factory for checkpoint() under the ``op`` policy: one counter of matmuls per
    forward and one per recomputation, so both make the same choices."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMULS:
            phase = "recompute" if ctx.is_recompute else "forward"
            counts[phase] += 1
            if counts[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def checkpointed(module: torch.nn.Module, mode: str, seq_len: int, *args):
    """Call ``module`` under non-reentrant activation checkpointing (what the graph calls):
    ``mode`` "full" keeps only the inputs, "selective" also keeps all but the
    sequence-squared tensors, "op" follows :func:`op_context`."""
    if mode == "op":
        return checkpoint(module, *args, use_reentrant=False, context_fn=op_context)
    if mode == "selective":
        context = functools.partial(selective_context, seq_len)
        return checkpoint(module, *args, use_reentrant=False, context_fn=context)
    return checkpoint(module, *args, use_reentrant=False)


def _sequence_squared(layer: torch.nn.Module, seq_len: int) -> bool:
    """Does the layer make a tensor that holds the sequence length twice and needs a
    gradient (attention scores: what selective recomputation drops)?"""
    if not isinstance(layer, fx.GraphModule) or seq_len <= 1:
        return True  # cannot tell: checkpoint as asked
    for node in layer.graph.nodes:
        facts = node.meta.get(META_KEY)
        if node.op == "call_function" and facts is not None and facts.requires_grad and any(
                list(shape).count(seq_len) >= 2 for shape in facts.shapes):
            return True
    return False


@register_pass
class CheckpointLayers(GraphPass):
    name = "checkpoint-layers"
    requires = ("outline-layers",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        training = ctx.plan.training
        ordered = list(gm.meta.get("autopar_layer_paths", []))
        per_layer = training.get("recompute_layers") or [training.get("recompute", "none")] * len(
            ordered)
        if len(per_layer) != len(ordered):
            raise PassError(
                f"the plan gives {len(per_layer)} layer recomputation mode(s) for the "
                f"{len(ordered)} layers of this program", where="training.recompute_layers",
                fix="re-plan for this model")
        modes = dict(zip(ordered, per_layer))
        if all(m == "none" for m in modes.values()):
            return PassResult(gm, modified=False)
        seq_len = int(ctx.plan.batch.get("seq", 0))
        changes = []
        for node in list(gm.graph.nodes):
            if node.op != "call_module" or modes.get(node.target, "none") == "none":
                continue
            mode = modes[node.target]
            if mode == "selective" and not _sequence_squared(gm.get_submodule(node.target),
                                                             seq_len):
                # Nothing to recompute (attention fused): a checkpoint would only cache every
                # other output of the layer (measured: more than autograd keeps), so the
                # layer runs as is, which is what the cost model prices.
                changes.append(f"{node.target}: selective, nothing sequence-squared: as is")
                continue
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(node.target)
                call = gm.graph.call_function(checkpointed, (module, mode, seq_len, *node.args))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            changes.append(f"{node.target}: {mode} recomputation")
        return PassResult(gm, modified=bool(changes), changes=changes)
