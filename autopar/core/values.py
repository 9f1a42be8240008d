"""Tensor values of a graph: which node output each input reads.

A node with several tensor outputs (``split``, ``native_layer_norm``) is read through
``operator.getitem`` nodes; a *value* is ``(producer, output index)`` with those getitems
looked through, so placements are decided once per real output.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

Value = tuple[fx.Node, int]


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def value_of(node: fx.Node) -> Value:
    """The (producer, output index) a node's tensor stands for."""
    if is_getitem(node) and isinstance(node.args[0], fx.Node):
        producer, base = value_of(node.args[0])
        if base == 0 and not isinstance(producer.meta.get("val"), torch.Tensor):
            return producer, node.args[1]
    return node, 0


def tensor_nodes(value: Any) -> list[fx.Node]:
    """Nodes carrying one tensor in ``value`` (nested args), in pytree's flattened order
    (depth first; ``fx.node.map_arg`` walks them in that order, faster)."""
    out: list[fx.Node] = []

    def keep(a: fx.Node) -> fx.Node:
        if isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
        return a

    fx.node.map_arg(value, keep)
    return out


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Input nodes carrying one tensor, in the flattened order strategies use (args, then
    kwargs)."""
    return tensor_nodes((node.args, node.kwargs))


def training_output(node: fx.Node) -> bool:
    """Whether a graph output ``node`` is one a training step hands back: a scalar (the
    loss). ``ParallelModule.train_step`` reads only the loss, so every other output (an
    LM's logits) is the forward call's alone: a training step neither makes it whole for
    the caller nor keeps it (:func:`autopar.ops.comm_ops.outputs_unused`)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.ndim == 0


def is_decision(node: fx.Node) -> bool:
    """Nodes that get a strategy: ops with tensor outputs, parameters and inputs."""
    if node.op in ("placeholder", "get_attr"):
        return isinstance(node.meta.get("val"), torch.Tensor)
    if node.op != "call_function" or is_getitem(node):
        return False
    return holds_tensor(node.meta.get("val"))


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` (a node's ``val``: a tensor, or tuples, lists and dicts of them) holds
    a tensor. Walked here rather than with ``torch.utils._pytree.tree_flatten``, whose
    recursive closure is a reference cycle per call: 10,000 of them per plan of a 70B model
    left 100,000 objects for the cycle collector (0.2-0.7 s)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False
