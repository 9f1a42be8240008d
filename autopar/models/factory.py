"""``path/to/model.py:make_model``: a model built by a user's own function.

``make_model()`` is called with no arguments and returns ``(model, example_args,
example_kwargs)``: ``model(*example_args, **example_kwargs)`` returns the loss, and the first
tensor's dims 0 and 1 are the batch and the sequence. (A bare module can be built, but not
traced: nothing says how to call it.) A Hugging Face model's ``config.use_cache`` is turned
off (training needs no key/value cache, and torch.export cannot trace one). The file is imported as a script would be, so any
failure in it (a syntax error, a missing import, an exception, ``.cuda()`` on a machine
without CUDA) becomes a ModelSpecError naming the file, the line and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from autopar.core.errors import ModelSpecError
from autopar.models.spec import Device, ModelSpec

RETURNS = ("return (model, example_args, example_kwargs), where model(*example_args, "
           "**example_kwargs) returns the loss, e.g. `return model, (tokens, targets), {}` with "
           "tokens = torch.randint(0, vocab, (batch, seq))")
"""What a factory must return, as error messages say it."""


def resolve_factory(path_text: str, func_name: str, text: str) -> ModelSpec:
    path = Path(os.path.expanduser(path_text))  # "~nobody" stays as written
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ModelSpecError(
            f"model file '{path_text}' {what}",
            where=text,
            fix=f"check the path; a relative path starts at {Path.cwd()}",
        )
    module = _load_file(path, text)
    factory = getattr(module, func_name, None) if func_name.isidentifier() else None
    if not callable(factory):
        functions = [
            n
            for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__
        ]
        raise ModelSpecError(
            f"model file '{path_text}' has no function '{func_name}'",
            where=text,
            fix=f"use one of its functions: {', '.join(functions) or '(none defined)'}",
        )
    _check_takes_no_arguments(factory, func_name, path)
    # Call once on meta to learn the example batch and sequence without allocating.
    with torch.device("meta"):
        model, examples = _call_factory(factory, func_name, path)
    batch, seq = _example_dims(examples, func_name, path)
    forward = _signature(model)

    def build() -> nn.Module:
        return _call_factory(factory, func_name, path)[0]

    def inputs(want_batch: int, want_seq: int, device: Device) -> tuple[tuple, dict]:
        if examples is None:
            raise ModelSpecError(
                f"factory '{func_name}' returned only a module ({type(model).__name__}), so "
                f"autopar does not know what to call it with ({type(model).__name__}.forward"
                f"{forward})",
                where=f"{path}:{factory.__code__.co_firstlineno}" if _is_function(factory)
                else text,
                fix=RETURNS,
            )
        if want_seq != seq:
            raise ModelSpecError(
                f"a custom model's sequence length is fixed by its factory ({seq}), not {want_seq}",
                where=text,
                fix=f"change the example inputs in '{func_name}', or use seq={seq}",
            )
        with torch.device(device):
            _, got = _call_factory(factory, func_name, path)
        return tree_map(partial(_resize_batch, old=batch, new=want_batch, device=device), got)

    config = MappingProxyType({"file": str(path), "factory": func_name})
    return ModelSpec(
        name=text,
        family="custom",
        config=config,
        default_batch=batch,
        default_seq=seq,
        build=build,
        inputs_fn=inputs,
    )


def _load_file(path: Path, text: str) -> ModuleType:
    """Import a user's model file (the user asked to run it), with its folder importable."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    name = f"autopar_user_{resolved.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import model file '{path}' as Python", where=text,
                             fix="name a .py file of Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look classes up here
    sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - every failure is explained
        del sys.modules[name]
        raise _file_error(err, path, "while importing it") from err
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def _check_takes_no_arguments(factory: Callable, func_name: str, path: Path) -> None:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin or C callable: calling it says enough
    required = [p.name for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        line = factory.__code__.co_firstlineno if _is_function(factory) else None
        raise ModelSpecError(
            f"factory '{func_name}' needs arguments ({', '.join(required)}), but autopar calls "
            "it with none",
            where=f"{path}:{line}" if line else str(path),
            fix=f"give {', '.join(required)} defaults, or add a function that takes none: "
            f"def make_default(): return {func_name}(...)",
        )


def _call_factory(factory: Callable, func_name: str, path: Path
                  ) -> tuple[nn.Module, tuple[tuple, dict] | None]:
    try:
        out = factory()
    except (Exception, SystemExit) as err:  # noqa: BLE001 - every failure is explained
        raise _file_error(err, path, f"in {func_name}()") from err
    module = out[0] if isinstance(out, tuple) and out else out
    _no_cache(module)
    if isinstance(out, nn.Module):
        return out, None
    if (
        isinstance(out, tuple)
        and len(out) == 3
        and isinstance(out[0], nn.Module)
        and isinstance(out[1], tuple | list)
        and isinstance(out[2], Mapping)
    ):
        return out[0], (tuple(out[1]), dict(out[2]))
    got = type(out).__name__
    if isinstance(out, tuple):
        got = f"a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
    raise ModelSpecError(
        f"factory returned {got}, not a module with its example inputs",
        where=f"{path}: {func_name}()",
        fix=RETURNS,
    )


def _no_cache(model: Any) -> None:
    """Hugging Face models return their key/value cache unless told not to, and torch.export
    cannot trace that output; training never uses it. The model is autopar's own instance."""
    config = getattr(model, "config", None)
    if isinstance(model, nn.Module) and getattr(config, "use_cache", False) is True:
        config.use_cache = False


def _file_error(err: BaseException, path: Path, when: str) -> ModelSpecError:
    """What failed in the user's file, at which line, and what to do about it."""
    if isinstance(err, SyntaxError):
        return ModelSpecError(
            f"model file '{path}' has a syntax error: {err.msg}",
            where=f"{err.filename or path}:{err.lineno}",
            fix="fix the Python syntax at that line (python -m py_compile shows it)",
        )
    where = f"{path}:{line}" if (line := _line_in(err, path)) else str(path)
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, ImportError):
        missing = f"'{err.name}'" if err.name else "a module"
        return ModelSpecError(
            f"model file '{path}' cannot import {missing}: {text}",
            where=where,
            fix=f"install {missing} in this environment, or fix the import at that line",
        )
    if "CUDA" in text or "NVIDIA" in text or "cuda" in text:
        return ModelSpecError(
            f"model file '{path}' needs CUDA {when}, which this machine lacks: {text}",
            where=where,
            fix="build the model on the current device: drop .cuda() / .to('cuda') / "
            "device='cuda' from the factory; autopar builds it under torch.device('meta') to "
            "plan, and parallelize() places it on each rank's device",
        )
    return ModelSpecError(
        f"model file '{path}' raised {type(err).__name__} {when}: {text}",
        where=where,
        fix="fix the error at that line; autopar calls the factory with no arguments, under "
        "torch.device('meta') while planning (no real tensors: no .item(), no torch.load)",
    )


def _line_in(err: BaseException, path: Path) -> int | None:
    """The innermost line of ``path`` in the error's traceback."""
    resolved = str(path.resolve())
    lines = [line for frame, line in traceback.walk_tb(err.__traceback__)
             if frame.f_code.co_filename == resolved]
    return lines[-1] if lines else None


def _is_function(obj: object) -> bool:
    return inspect.isfunction(obj) or inspect.ismethod(obj)


def _signature(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"


def _example_dims(examples: tuple[tuple, dict] | None, func_name: str, path: Path
                  ) -> tuple[int, int]:
    """Batch and sequence of the first tensor input with a batch dim; (0, 0) if none given."""
    if examples is None:
        return 0, 0
    tensors = [t for t in tree_leaves(examples) if isinstance(t, torch.Tensor) and t.dim()]
    if not tensors:
        raise ModelSpecError(
            f"factory '{func_name}' gave example inputs with no tensor of at least one "
            "dimension, so there is no batch to split",
            where=f"{path}: {func_name}()",
            fix=RETURNS,
        )
    first = tensors[0]
    return first.shape[0], first.shape[1] if first.dim() > 1 else 1


def _resize_batch(x: Any, *, old: int, new: int, device: Device) -> Any:
    """Tile or truncate a batch-major tensor along dim 0; other values pass through."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.to(device)
    if x.dim() == 0 or x.shape[0] != old or new == old:
        return x
    return x.repeat(-(-new // old), *[1] * (x.dim() - 1))[:new]
