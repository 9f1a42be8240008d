"""Which cross-entropies the chunked loss computes a block of tokens at a time, and the fp32
casts and views before them: read by the cost model (which prices the chunked loss) and by
the pass that rewrites them (:mod:`autopar.passes.chunked_loss`)."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.ops.loss_ops import chunkable

aten = torch.ops.aten


def chunkable_loss(node: fx.Node) -> bool:
    """Whether ``node`` is a cross-entropy the runtime computes chunked."""
    if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
        return False
    logits, target = (a.meta.get("val") if isinstance(a, fx.Node) else None
                      for a in node.args[:2])
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return False
    return chunkable(logits.dim(), target.dim(), target.is_floating_point())


VIEWS = (aten.reshape.default, aten.view.default, aten.alias.default,
          aten._unsafe_view.default)
_CASTS = (aten.to.dtype, aten._to_copy.default)


def fp32_cast(node: fx.Node) -> fx.Node | None:
    """The node ``node`` is a cast to fp32 of (Hugging Face's ``logits.float()``), if so."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
    source = node.args[0]
    if dtype is not torch.float32 or not isinstance(source, fx.Node):
        return None
    return source
