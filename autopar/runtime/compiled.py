"""Compiled rank programs: ``torch.compile`` (Inductor) per outlined layer, or the whole program.

torchtitan compiles each transformer block (``apply_compile``), before FSDP2 wraps it: a
block is where the elementwise work between matmuls fuses. Here each module's ``forward``
is compiled, not its call, so the hooks around it (FSDP2's gathers, checkpointing) stay
eager, and what Dynamo cannot trace (the step's weight casts, which
``passes/hoist_weight_casts.py`` moves to a layer's first lines; collectives) breaks the
graph at its edges rather than failing. A module Dynamo or Inductor cannot compile runs
eagerly from then on, the reason logged (``autopar.compile``) and kept
(:data:`FALLBACK_ATTR`), never a crash. (Inductor compiles a backward graph at the first
backward: an error there is not caught.)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from autopar.core.plan import Plan
from autopar.ops.step_copies import opaque_to_compile

log = logging.getLogger("autopar.compile")

FALLBACK_ATTR = "_autopar_compile_fallback"
"""Set on a module whose compilation failed: why (it then runs eagerly)."""

BACKEND = "inductor"
"""The ``torch.compile`` backend (a test replaces it with one that fails)."""


def compiles(plan: Plan) -> bool:
    """Does the plan's program run compiled? It asks for it (``training.compile``), and its
    layout is one checked exact compiled: not yet recomputed layers under tensor or expert
    parallelism (their recomputation's collectives came out of step across ranks on CPU:
    a gloo size mismatch), which run eagerly, said in the log."""
    if not plan.training.get("compile", False):
        return False
    sharded = plan.mesh.get("tp", 1) > 1 or plan.mesh.get("ep", 1) > 1
    if sharded and plan.training.get("recompute", "none") != "none":
        log.warning("autopar: compile=True, but recomputed layers under tensor or expert "
                    "parallelism run eagerly (not yet exact compiled)")
        return False
    return True


def compile_modules(modules: Iterable[nn.Module], where: str = "program") -> int:
    """Compile each module's ``forward`` (once: a module already compiled is left); how
    many were compiled."""
    opaque_to_compile()
    count = 0
    for module in modules:
        if getattr(module, "_autopar_compiled", False):
            continue
        module.forward = _guarded(module, module.forward, where)
        module._autopar_compiled = True
        count += 1
    return count


def _guarded(module: nn.Module, forward: Callable, where: str) -> Callable:
    with warnings.catch_warnings():  # torch.compile's first import warns of torch.jit's own
        warnings.filterwarnings("ignore", message=".*torch.jit", category=DeprecationWarning)
        compiled = torch.compile(forward, backend=BACKEND)
    state = {"eager": False}

    def call(*args: Any, **kwargs: Any) -> Any:
        if state["eager"]:
            return forward(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            state["eager"] = True
            cause = getattr(e, "inner_exception", None) or e.__cause__ or e
            lines = [line for line in str(cause).splitlines() if line.strip()]
            reason = f"{type(cause).__name__}: {lines[0] if lines else ''}"
            setattr(module, FALLBACK_ATTR, reason)
            log.warning("autopar: %s (%s) runs eagerly: torch.compile failed (%s)", where,
                        type(module).__name__, reason)
            return forward(*args, **kwargs)

    return call
