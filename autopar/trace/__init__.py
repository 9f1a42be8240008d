"""Tracing: model + example inputs -> an fx GraphModule whose nodes carry NodeFacts.

>>> import torch, autopar
>>> from autopar.models.gpt import GPT, GPTConfig
>>> model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
>>> idx = torch.randint(0, 64, (2, 16))
>>> gm = autopar.trace(model, (idx, idx))
>>> gm.meta["autopar"].params > 0
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopar.core.collector import collector_paused
from autopar.core.errors import TraceError
from autopar.core.graph_facts import META_KEY, GraphFacts
from autopar.ops import moe_ops  # noqa: F401  (autopar::grouped_mm and its FLOP formula)
from autopar.trace.annotate import annotate, tensor_vals
from autopar.trace.blocks import assign_blocks, fingerprint
from autopar.trace.capture import export_model
from autopar.trace.inputs import TensorSpec, split_example_inputs

__all__ = ["TensorSpec", "trace"]


def trace(model: nn.Module, example_inputs: Any = None, *,
          agree: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None,
          costs: bool = True) -> torch.fx.GraphModule:
    """Trace ``model`` called with ``example_inputs`` into an annotated GraphModule.

    ``example_inputs``: a tensor, a tuple of positional inputs, a dict of keyword inputs,
    or ``(args, kwargs)``; any input may be a :class:`TensorSpec` (shape and dtype only),
    which is traced as a meta tensor. Build large models under ``torch.device("meta")``.
    ``agree``: given the exported graph, returns the one to annotate (``parallelize`` makes
    every rank's graph rank 0's). ``costs=False`` leaves each op's FLOPs and saved
    tensors unmeasured (zero): a graph that is only run, not planned, needs none of them.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"autopar traces an nn.Module, got {type(model).__name__}",
                         where="trace(model=...)", fix="pass the model object itself")
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    args, kwargs = split_example_inputs(example_inputs, device)
    with collector_paused():
        gm, tracer = export_model(model, args, kwargs)
        if agree is not None:
            gm = agree(gm)
        annotate(gm, costs=costs)
        blocks = assign_blocks(gm)
        gm.meta[META_KEY] = _graph_facts(gm, model, tracer, blocks)
    return gm


def _graph_facts(gm: torch.fx.GraphModule, model: nn.Module, tracer: str, blocks) -> GraphFacts:
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = seq = None
    for node in placeholders:
        vals = tensor_vals(node)
        if vals and vals[0].ndim >= 1:
            shape = node.meta[META_KEY].shapes[0]
            batch = shape[0]
            if not vals[0].is_floating_point() and len(shape) >= 2:
                seq = shape[1]
            break
    nodes = [n.meta[META_KEY] for n in gm.graph.nodes]
    return GraphFacts(
        params=params,
        trainable_params=trainable,
        fingerprint=fingerprint(gm),
        blocks=blocks,
        tracer=tracer,
        input_names=tuple(n.name for n in placeholders),
        batch_size=batch,
        seq_len=seq,
        tokens=batch * seq if batch and seq else None,
        fwd_flops=sum(f.fwd_flops for f in nodes),
        bwd_flops=sum(f.bwd_flops for f in nodes),
    )
