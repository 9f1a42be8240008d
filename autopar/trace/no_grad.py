"""Inline the ``torch.no_grad()`` blocks torch.export wraps in a higher-order op.

``torch.export`` keeps a ``with torch.no_grad():`` block of ``forward`` as one
``wrap_with_set_grad_enabled(False, submodule, *inputs)`` call. Nothing inside it is visible
to the planner. Such a block may still update state from the batch, as DeepSeek-V3's
auxiliary-loss-free balancing does: a routing bias is nudged by each step's tokens per
expert. Under data parallelism, each rank would then count its own tokens only, and the
ranks' biases would drift apart without any error.

So the block's ops are inlined into the graph, where the batch-coupling analysis sees them
(``autopar.analysis.batch_coupling``). Its inputs are read through ``detach``, which computes
what the block computed and keeps autograd out, as ``no_grad`` did. Buffers are read
directly: they never need gradients, and an in-place update must reach the buffer itself.

>>> import torch, autopar
>>> class Counter(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.register_buffer("seen", torch.zeros(()))
...     def forward(self, x):
...         with torch.no_grad():
...             self.seen.add_(x.sum())
...         return x * 2
>>> gm = autopar.trace(Counter(), (torch.ones(2, 3),))
>>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
['aten.detach.default', 'aten.sum.default', 'aten.add_.Tensor', 'aten.mul.Tensor']
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx


def inline_no_grad_blocks(gm: fx.GraphModule, recompile: bool = True) -> None:
    """Replace every ``wrap_with_set_grad_enabled(False, ...)`` call of ``gm`` by its ops;
    ``recompile=False`` leaves the Python code to a caller that recompiles anyway (half a
    second for an 80-layer graph)."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    if hop is None:
        return
    buffers = {name for name, _ in gm.named_buffers()}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not hop or node.args[0] is not False:
            continue
        holder, inputs = node.args[1], node.args[2:]
        body = getattr(gm, str(holder.target))
        env: dict[fx.Node, object] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        results: tuple = ()
        with gm.graph.inserting_before(node):
            for placeholder, value in zip(placeholders, inputs):
                env[placeholder] = _detached(gm.graph, value, buffers, node.meta)
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    results = tuple(fx.node.map_arg(inner.args[0], env.__getitem__))
                    break
                if inner.op == "get_attr":  # a constant of the block: move it to the root
                    name = f"{holder.target}_{inner.target}"
                    setattr(gm, name, getattr(body, str(inner.target)))
                    env[inner] = gm.graph.get_attr(name)
                    env[inner].meta = dict(inner.meta)
                    continue
                env[inner] = gm.graph.node_copy(inner, env.__getitem__)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not holder.users:
            gm.graph.erase_node(holder)
            delattr(gm, str(holder.target))
    gm.graph.lint()
    if recompile:
        gm.recompile()


def _detached(graph: fx.Graph, value, buffers: set[str], meta: dict):
    """``value`` as the block read it: detached, unless it is a buffer (or not a tensor)."""
    if not isinstance(value, fx.Node):
        return value
    if value.op == "get_attr" and str(value.target) in buffers:
        return value
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return value
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = {k: v for k, v in meta.items() if k != "val"}  # where the block is
    out.meta["val"] = val.detach()
    return out
