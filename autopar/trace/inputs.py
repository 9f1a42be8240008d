"""Example inputs: what a model is called with while it is traced.

A user gives real tensors, or only their shapes and dtypes (an input spec), which become
meta tensors so that nothing is allocated::

    trace(model, {"input_ids": TensorSpec((8, 2048), "int64")})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.errors import TraceError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


MAX_ELEMENTS = 2**62
"""Elements of one input at most: tensor sizes are int64, and ops multiply them further."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one example input; traced as a meta tensor."""

    shape: tuple[int, ...]
    dtype: str = "int64"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise TraceError(
                f"unknown dtype {self.dtype!r} in an input spec",
                where="TensorSpec.dtype",
                fix=f"use one of {', '.join(sorted(DTYPES))}",
            )
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or any(
                isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in shape):
            raise TraceError(
                f"input spec shape {shape!r} must be a tuple of positive integers",
                where="TensorSpec.shape",
                fix="give every dimension as a positive int, e.g. (8, 1024)",
            )
        if math.prod(shape) > MAX_ELEMENTS:
            raise TraceError(
                f"input spec shape {tuple(shape)} has {math.prod(shape)} elements, more than a "
                f"tensor can hold ({MAX_ELEMENTS})",
                where="TensorSpec.shape",
                fix="give the shape of one global batch, e.g. (8, 1024)",
            )
        object.__setattr__(self, "shape", tuple(shape))

    def make(self, device: str | torch.device = "meta") -> torch.Tensor:
        dtype = DTYPES[self.dtype]
        return torch.empty(self.shape, dtype=dtype, device=device)


def split_example_inputs(
    example_inputs: Any, device: str | torch.device = "meta"
) -> tuple[tuple, dict]:
    """Normalize the ways a user can pass example inputs into ``(args, kwargs)``.

    Accepted: a tensor; a tuple of positional arguments; a dict of keyword arguments; or a
    pair ``(args_tuple, kwargs_dict)``. ``TensorSpec`` values become (uninitialized)
    tensors on ``device``: the model's device, meta for a model built on meta.
    """
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, (torch.Tensor, TensorSpec)):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], Mapping)
    ):
        args, kwargs = tuple(example_inputs[0]), dict(example_inputs[1])
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TraceError(
            f"example inputs of type {type(example_inputs).__name__} are not understood",
            where="example_inputs",
            fix="pass a tensor, a tuple of positional inputs, a dict of keyword inputs, "
            "or (args, kwargs)",
        )
    seen: set[int] = set()
    args = _materialize(args, device, seen)
    kwargs = {k: _materialize(v, device, seen) for k, v in kwargs.items()}
    return args, kwargs


def _materialize(value: Any, device: str | torch.device, seen: set[int]) -> Any:
    """Specs become tensors on ``device``; a tensor passed twice (``model(idx, idx)``) is
    copied, because torch.export would merge the two inputs into one and the traced graph
    would then read the second one for both."""
    if isinstance(value, TensorSpec):
        return value.make(device)
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return value.clone()
        seen.add(id(value))
        return value
    if isinstance(value, tuple):
        return tuple(_materialize(v, device, seen) for v in value)
    if isinstance(value, list):
        return [_materialize(v, device, seen) for v in value]
    return value


def microbatch_inputs(example_inputs: Any, batch: int, microbatch: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one microbatch: the first ``microbatch`` rows of every tensor
    whose first dimension is the ``batch`` (what each rank runs at a time); everything else
    as given. Per-rank programs are traced on this, as PiPPy traces on a microbatch, so
    batch-sized constants (an ``arange`` over the batch in a mask) come out local.
    """
    args, kwargs = split_example_inputs(example_inputs, "meta")

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == batch:
            return value[:microbatch]
        return value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
