"""The contract between a sharding rule and the solver.

A *sharding rule* looks at one call of an op (shapes, dtypes and non-tensor arguments) and
lists every way to run it on one mesh axis of a given size such that running the **same op
locally** on each device's local tensors (with shape arguments localized by the
tensor-parallel pass) yields the local part of the output in the stated placement. The solver
picks one strategy per node; the passes then execute it. A rule that lists a strategy whose
local execution is wrong produces wrong training, so each rule is tested numerically and
against DTensor in ``tests/test_rules.py``.

Conventions:

- ``Strategy.inputs`` has one placement per *tensor* input, in the order
  ``torch.utils._pytree.tree_flatten((args, kwargs))`` visits them (lists of tensors, as in
  ``cat``, are flattened in place). ``Strategy.outputs`` has one placement per tensor output.
- Tensor dims in placements are normalized (non-negative).
- Sharding is even: a rule offers ``Shard(d)`` only if the dim divides by the axis size.
- The all-``Replicate`` strategy is always valid for a deterministic op; rules list it.

Plugins register rules for their own ops with :func:`autopar.strategies.register_rule`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from autopar.core.placements import Placement, Replicate


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor argument or output, all a rule may know of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel() * (self.dtype.itemsize if hasattr(self.dtype, "itemsize") else 4)


@dataclass(frozen=True)
class OpCall:
    """One call of an op, as a sharding rule sees it.

    ``args``/``kwargs`` are the fx node's arguments with every tensor replaced by its
    :class:`TensorMeta`; ``out`` lists the tensor outputs (one for a single tensor).
    ``hints`` carries facts from graph analysis a rule may use, e.g. ``split_groups``: the
    numbers of equal chunks consumers split this node's last dim into (a fused QKV
    projection is split into 3).
    """

    target: Any
    args: tuple
    kwargs: Mapping[str, Any]
    out: tuple[TensorMeta, ...]
    hints: Mapping[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def tensor_args(self) -> tuple[TensorMeta, ...]:
        leaves, _ = tree_flatten((self.args, dict(self.kwargs)))
        return tuple(x for x in leaves if isinstance(x, TensorMeta))

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument by position, else by keyword, else ``default``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class Strategy:
    """How one node runs on one mesh axis: what it needs on its inputs, what it gives."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    # The name of a local implementation the pass must substitute for the op (e.g. a
    # vocabulary-parallel embedding); None means "run the same op on local tensors".
    local_impl: str | None = None

    def __hash__(self) -> int:
        """Hashed once: strategies key the cost tables' caches, ~10^6 lookups a plan."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.inputs, self.outputs, self.local_impl))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __str__(self) -> str:
        ins = ",".join(str(p) for p in self.inputs)
        outs = ",".join(str(p) for p in self.outputs)
        return f"({ins})->({outs})" + (f"[{self.local_impl}]" if self.local_impl else "")

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in (*self.inputs, *self.outputs))

    @property
    def splits_work(self) -> bool:
        """Whether devices compute different parts of the node, so that the gradient of a
        replicated input comes out partial (one term per device) and must be all-reduced.

        True when an output is split over the axis (sharded, or pending a sum), or when a
        local implementation with collectives of its own (vocabulary-parallel cross-entropy)
        reads split inputs. An op whose outputs are all whole reads a split input only for
        its metadata (``type_as``'s dtype, ``new_zeros``'s device, ``zeros_like``'s shape):
        every device computes the same whole output from the same replicated inputs, whose
        gradients are then whole, and all-reducing them would multiply them by the axis size.
        """
        if any(not isinstance(p, Replicate) for p in self.outputs):
            return True
        return self.local_impl is not None and not self.is_replicated


Rule = Callable[[OpCall, int], list[Strategy]]


def replicate_all(call: OpCall) -> Strategy:
    """The strategy every deterministic op supports: everything whole on every device."""
    return Strategy(
        inputs=tuple(Replicate() for _ in call.tensor_args),
        outputs=tuple(Replicate() for _ in call.out),
    )


def norm_dim(dim: int, ndim: int) -> int:
    """Normalize a possibly negative dim (``ndim`` 0 counts as 1, as torch does)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} out of range for {ndim}-d tensor")
    return dim % n
