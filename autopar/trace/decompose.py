"""Ops without a sharding rule, written as the ops torch composes them of.

``torch.export``'s training IR keeps composite ops whole (``expand_as``, ``numpy_T``,
``min.other``, ``adaptive_avg_pool1d``, ``kl_div``...). An op without a sharding rule runs
replicated, and on the batch axis it would keep the batch from being split at all, though
what it computes is only ``expand``, ``permute`` or ``minimum``. Where torch defines such an
op by composition (a CompositeImplicitAutograd kernel) and autopar has no rule for it, the op
is traced once more through that composition (``make_fx`` on the node's fake values) and its
pieces take its place, each with the op's module path and source line: the planner then
sees ops it has rules for, in any model, with no rule written per op.

>>> import torch, autopar
>>> class Tile(torch.nn.Module):
...     def forward(self, x, y):
...         return (y.expand_as(x) * x).sum()
>>> gm = autopar.trace(Tile(), (torch.randn(4, 3), torch.randn(4, 1)))
>>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
['aten.expand.default', 'aten.mul.Tensor', 'aten.sum.default']
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.strategies import has_rule
from autopar.trace.expected_rows import PICKS

_KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node")


def decompose_unruled(gm: fx.GraphModule) -> int:
    """Replace every composite op of ``gm`` that has no sharding rule by its pieces; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _decomposable(node.target) and _inline(gm, node):
            done += 1
    return done


def _decomposable(op) -> bool:
    """A composite without a rule, and not one autopar reads whole (``where(mask)`` finds
    routed tokens: :mod:`autopar.trace.expected_rows`, the batch axis's token sets)."""
    return (isinstance(op, torch._ops.OpOverload) and not has_rule(op) and op not in PICKS
            and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                               "CompositeImplicitAutograd"))


def _inline(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Trace ``node``'s op through its composition and splice the pieces in; False (and
    nothing changed) where that cannot be done."""
    leaves, spec = tree_flatten((node.args, node.kwargs))
    slots = [i for i, a in enumerate(leaves) if isinstance(a, fx.Node)]
    vals = [leaves[i].meta.get("val") for i in slots]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False  # symbolic sizes or non-tensor values: leave the op whole

    def composed(*tensors):
        args = list(leaves)
        for i, t in zip(slots, tensors):
            args[i] = t
        a, k = tree_unflatten(args, spec)
        return node.target(*a, **k)

    mode = detect_fake_mode(vals)
    try:  # in the graph's fake mode: tensors the composition makes are of the graph too
        with mode if mode is not None else contextlib.nullcontext():
            sub = make_fx(composed)(*vals)
    except Exception:  # noqa: BLE001 - a composition make_fx cannot trace: keep the op
        return False
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node) and any(
            u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return False  # several outputs read other than one by one
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    inputs = iter(leaves[i] for i in slots)
    result = None
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(inputs)
            elif inner.op == "get_attr":  # a constant the composition made
                name = f"_decomposed_{node.name}_{inner.target}"
                setattr(gm, name, getattr(sub, str(inner.target)))
                env[inner] = graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
            elif inner.op == "call_function":
                env[inner] = graph.node_copy(inner, env.__getitem__)
                env[inner].meta = {**dict(inner.meta),
                                   **{k: node.meta[k] for k in _KEEP_META if k in node.meta}}
            elif inner.op == "output":
                result = fx.node.map_arg(inner.args[0], env.__getitem__)
    if isinstance(result, fx.Node):
        node.replace_all_uses_with(result)
    else:  # several outputs, read through getitem
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
    graph.erase_node(node)
    return True
