"""The kernels autograd runs for one op's backward, and the bytes they move.

A memory-bound op's backward is not a fixed multiple of its forward: ``add`` passes its
gradient through with no kernel at all, ``_to_copy`` casts it back in one kernel as large as
its forward, ``mul`` runs two kernels (a gradient per input), and ``pow``/``rsqrt`` run three
(their derivative's own power and products). The meter (``op_costs.OpCostMeter``) already
replays each op's backward on fake tensors to count its FLOPs; this mode, entered around that
replay, records each aten call it dispatches -- the same calls eager autograd makes on the
GPU -- so the cost model prices the backward that runs instead of a rule of thumb.

Views, aliases and fresh uninitialised buffers run no kernel and are not counted. A tensor
is counted at the bytes its kernel touches: an expanded operand (stride 0) once per distinct
element.

>>> import torch
>>> x = torch.ones(4, 8, requires_grad=True)
>>> y = torch.ones(4, 8, requires_grad=True)
>>> z, grad = x * y, torch.ones(4, 8)
>>> with BackwardKernels() as k:
...     _ = torch.autograd.grad(z, (x, y), grad)
>>> k.kernels, k.bytes_moved  # grad * y and grad * x: each reads two, writes one
(2, 768)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten

NO_KERNEL = frozenset({
    _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default,
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
    _aten.new_empty.default, _aten.new_empty_strided.default,
})
"""Ops that return a tensor without launching a kernel (besides views)."""


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes of ``t``: its distinct elements (an expanded
    dimension, stride 0, holds one element however long it is)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    return n * t.element_size()


class BackwardKernels(TorchDispatchMode):
    """Counts the kernels and the bytes they move of the ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.bytes_moved = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in NO_KERNEL or getattr(func, "is_view", False):
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:  # a metadata query (sizes, strides), not a kernel
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.kernels += 1
        self.bytes_moved += sum(touched_bytes(t) for t in ins) + sum(touched_bytes(t)
                                                                     for t in outs)
        return out
