"""One low-precision copy of each weight per optimizer step, shared by its microbatches.

Mixed precision with fp32 parameters casts a 16-bit working copy of a weight where a matmul
reads it, and the matmul keeps that copy for backward. Made per use (``torch.autocast``'s
cache lives only as long as one ``autocast`` region), every microbatch in flight keeps a copy
of its own: a pipeline stage holding ``pp`` microbatches of a 1F1B schedule keeps ``pp``
copies of its weights (GPT-175B at tp8 x pp8: 43 GB of an 80 GB device). Within
:class:`one_weight_copy_per_step` (``ParallelModule.train_step``) a weight is cast once and
the copy serves every microbatch and every recomputation of the step, as Megatron-LM's
16-bit parameters and Transformer Engine's weight workspaces do.

- Each use still gets an autograd node of its own (:class:`_StepCast`) that returns its
  gradient to the fp32 parameter: one node shared by the microbatches would carry the first
  microbatch's sequence number, and autograd runs such a node last in every later backward,
  holding every weight's 16-bit gradient until the end (measured: +1 copy of the weights).
- The table holds a copy until the weight's last forward read of the step (the step's
  microbatches, ``reads``); then only the backward graphs that saved it do, and it is freed
  after its last backward, as a per-use copy would be (else the copies would outlive
  backward beside the gradients).

Safe because no weight changes inside a step: a weight written in place (its version) or a
different tensor is cast again. Written here because torch has no per-step cache: autocast's
is per region and cannot span a pipeline schedule's interleaved forwards and backwards.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import _disable_current_modes


class one_weight_copy_per_step:
    """While active, :func:`cast_weight` and :func:`step_copy` hand back one copy per weight
    and kind; ``reads``: forward reads of each weight in the step (its microbatches)."""

    active = False
    reads = 1
    copies: dict[tuple[int, object], tuple] = {}  # step_copy's (fp8)
    casts: dict[tuple[int, torch.dtype], list] = {}  # cast_weight's (16-bit)

    def __init__(self, reads: int = 1) -> None:
        self._reads = max(int(reads), 1)

    def __enter__(self) -> one_weight_copy_per_step:
        cls = type(self)
        cls.active, cls.reads = True, self._reads
        return self

    def __exit__(self, *exc) -> bool:
        cls = type(self)
        cls.active, cls.reads = False, 1
        cls.copies.clear()
        cls.casts.clear()
        return False


def step_copy(table: dict, tensor: torch.Tensor, kind: object,
              make: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``make()`` (a tuple, its first item the copy) for ``tensor`` as it is now (its
    version), made once per ``kind`` while the copy is alive: the table keeps it weakly
    (only whoever saved it for backward keeps it) and the tuple's other items strongly. The
    entry goes when ``tensor`` does."""
    if tensor.is_inference():  # no version counter to tell a write by: make it every time
        return make()
    key = (id(tensor), kind)
    hit = table.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        copy = hit[2]()
        if copy is not None:
            return (copy, *hit[3])
    made = make()
    table[key] = (weakref.ref(tensor, lambda _: table.pop(key, None)), tensor._version,
                  weakref.ref(made[0]), made[1:])
    return made


class _StepCast(torch.autograd.Function):
    """The step's copy of a weight, its gradient cast back to the weight's dtype."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, holder: list) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return holder[0].view_as(holder[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``: within a step, one copy for the whole step."""
    if weight.dtype == dtype:
        return weight
    return _CAST(weight, dtype)


def _cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    step = one_weight_copy_per_step
    if not step.active or weight.is_inference():
        return weight.to(dtype)
    copy = _step_cast(step, weight, dtype)
    if weight.requires_grad and torch.is_grad_enabled():
        return _StepCast.apply(weight, [copy])
    return copy


_CAST = _cast


def opaque_to_compile() -> None:
    """Make torch.compile run the cast eagerly, a graph break (its table is Python state
    Dynamo cannot trace); called before compiling (:mod:`autopar.runtime.compiled`), not at
    import: ``torch.compiler.disable`` imports Dynamo, whose threads outlive a process's
    exit path (a launch that only plans then aborted now and then: "terminate called
    without an active exception")."""
    global _CAST
    if _CAST is _cast:
        _CAST = torch.compiler.disable(_cast)


def _step_cast(step: type[one_weight_copy_per_step], weight: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The step's copy of ``weight`` in ``dtype``; counts the forward reads (a
    recomputation in backward is none) and lets go of it at the last."""
    key = (id(weight), dtype)
    entry = step.casts.get(key)  # [weight ref, version, copy or None, copy ref, reads]
    copy = None
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        copy = entry[2] if entry[2] is not None else entry[3]()
    forward = torch._C._current_graph_task_id() == -1  # not a recomputation in backward
    if copy is None:
        with torch.no_grad(), (nullcontext() if forward else _disable_current_modes()):
            # a recomputation's cast where forward's hit: unseen by selective checkpointing,
            # which replays only the ops forward ran
            copy = weight.detach().to(dtype)
        reads = entry[4] if entry is not None and entry[0]() is weight else 0
        entry = [weakref.ref(weight, lambda _: step.casts.pop(key, None)), weight._version,
                 copy, weakref.ref(copy), reads]
        step.casts[key] = entry
        if reads >= step.reads:  # made again after the last read (a later recomputation)
            entry[2] = None
    if forward:
        entry[4] += 1
        if entry[4] >= step.reads:
            entry[2] = None  # the backward graphs that saved it keep it from here
    return copy
