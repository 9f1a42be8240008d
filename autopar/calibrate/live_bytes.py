"""Bytes of tensor storage alive during a piece of work, on any device (the CPU included).

CUDA's allocator counts what is allocated (``torch.cuda.max_memory_allocated``); the CPU has
no such counter, and torch's ``MemTracker`` follows modules (it cannot follow a module
called several times per step, nor frozen weights). This watches every storage an op
creates while it is active, through a ``TorchDispatchMode``, and frees it from the count
when Python drops the storage: so ``peak`` is the most bytes the work made alive at once,
and ``live`` what it still holds (e.g. the activations kept for backward after forward).
Storages that existed before (weights, optimizer states) are not counted, and neither are
allocators' caches or fragmentation: this is the model's own unit, the tensors. A storage
resized in place (``UntypedStorage.resize_``, no op the mode sees: FSDP2 allocates and frees
its whole weights and gradient buffers so) counts by what it grows or shrinks.

>>> import torch
>>> x = torch.randn(1024, 1024, requires_grad=True)
>>> with LiveBytes() as lb:
...     y = (x * 2).sin()       # x * 2 kept for sin's backward, y returned
>>> lb.live == 2 * 1024 * 1024 * 4
True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Counts the storages ops create while active: ``live`` now, ``peak`` since entry (or
    the last :meth:`reset_peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}  # storage key -> bytes, while alive

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self) -> LiveBytes:
        self._resize = torch.UntypedStorage.resize_
        counter, resize = self, self._resize

        def counted_resize(storage: torch.UntypedStorage, size: int):
            before, key = storage.nbytes(), storage.data_ptr()
            out = resize(storage, size)
            delta = storage.nbytes() - before
            if key in counter._seen:  # made while active: its release frees what it has now
                counter._seen[key] += delta
            counter.live += delta
            counter.peak = max(counter.peak, counter.live)
            return out

        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _track(self, tensor: torch.Tensor) -> None:
        if not _plain(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        nbytes = self._seen.pop(key, 0)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: not new memory (and the
        # input's may predate this mode, e.g. a weight's transpose)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if _plain(t)}
        for value in tree_flatten(out)[0]:
            if _plain(value) and value.untyped_storage().data_ptr() not in inputs:
                self._track(value)
        return out


def _plain(value: Any) -> bool:
    """A tensor with storage of its own: not meta, not a wrapper subclass (a DTensor holds
    plain tensors that ops made, which are counted when made)."""
    return (isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter)
            and value.device.type != "meta")
