"""Turn a model into an ATen-level fx graph: torch.export first, symbolic_trace as fallback.

``torch.export`` (non-strict) gives the training IR: whole ``aten.linear`` and
``aten.scaled_dot_product_attention`` nodes, parameters as ``get_attr`` nodes named by
their place in the model, and a fake-tensor value on every node, so nothing is computed and
meta-device models trace without memory. ``torch.fx.symbolic_trace`` is tried only when
export fails; its graph is module-level, so fewer ops have sharding rules.
"""

from __future__ import annotations

import contextlib
import io
import traceback
from types import TracebackType

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from autopar.core.errors import TraceError
from autopar.trace.decompose import decompose_unruled
from autopar.trace.mean_losses import split_mean_losses
from autopar.trace.no_grad import inline_no_grad_blocks

_LIB_MARKERS = ("site-packages/torch/", "/torch/_", "<string>", "autopar/trace/")


def export_model(model: nn.Module, args: tuple, kwargs: dict, repeat: bool = True
                 ) -> tuple[fx.GraphModule, str]:
    """The model's graph, and which tracer made it. ``repeat``: a deep stack of alike layers
    may be exported at two and three layers and repeated (:mod:`autopar.trace.repeat`)."""
    from autopar.trace.repeat import export_repeated

    gm = export_repeated(model, args, kwargs, _export) if repeat else None
    if gm is not None:
        return gm, "torch.export"
    try:
        gm = _export(model, args, kwargs)
    except Exception as export_error:  # noqa: BLE001 - every failure is translated below
        gm = _symbolic_fallback(model, args, kwargs)
        if gm is None:
            raise translate_trace_error(export_error, model) from export_error
        return gm, "symbolic_trace"
    canonicalize(gm)
    return gm, "torch.export"


def _export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``torch.export`` (non-strict), as a GraphModule with parameters as get_attr nodes."""
    # torch.export prints the partial graph of a failed trace to stderr; the error autopar
    # raises says what matters, so keep that dump out of the user's terminal. Lazy graph
    # modules: export rebuilds the graph module many times, and each rebuild would compile
    # its Python code (seconds for an 80-layer model) though only the final one is run.
    with contextlib.redirect_stderr(io.StringIO()), _use_lazy_graph_module(True):
        return torch.export.export(model, args, kwargs, strict=False).module()


def canonicalize(gm: fx.GraphModule) -> None:
    """Make the graph independent of where it was traced, and ready to run on local shapes.

    - Inline ``torch.no_grad()`` blocks (:mod:`autopar.trace.no_grad`), so the planner sees
      what they compute from the batch.
    - Drop export's input-shape guards: the per-rank program runs on local shapes.
    - Drop unused reads of parameters (export reads a tied weight under every name but uses
      one; keep one reader so the weight is planned and counted once).
    - Write composite ops that have no sharding rule as the ops torch composes them of
      (:mod:`autopar.trace.decompose`).
    - Write mean losses over a count of labelled targets as their sum over that count
      (:mod:`autopar.trace.mean_losses`), so splitting the batch keeps them exact.
    - Drop ``contiguous`` and turn ``view`` into ``reshape``: export keeps a ``contiguous``
      only where the tracing device's kernels return a non-contiguous tensor (the CPU
      attention kernel's output is contiguous where the meta one's is not), so the same model
      would give different graphs on meta, CPU and CUDA. ``reshape`` copies exactly when a
      view is impossible, which the dropped ``contiguous`` did.
    """
    aten = torch.ops.aten
    inline_no_grad_blocks(gm, recompile=False)  # recompiled below
    for key, hook in list(gm._forward_pre_hooks.items()):
        if "check_input_constraints" in getattr(hook, "__name__", ""):
            del gm._forward_pre_hooks[key]
            gm._forward_pre_hooks_with_kwargs.pop(key, None)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
        elif node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
            if hasattr(gm, node.target):
                delattr(gm, node.target)
        elif node.op == "call_function" and node.target is aten.contiguous.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default
    decompose_unruled(gm)
    split_mean_losses(gm)
    gm.graph.lint()
    gm.recompile()


def _symbolic_fallback(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule | None:
    if kwargs:
        return None  # symbolic_trace cannot bind keyword-only example inputs reliably
    try:
        gm = fx.symbolic_trace(model)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        FakeTensorProp(gm, mode).propagate(*fake_args)
        return gm
    except Exception:  # noqa: BLE001 - the export error is the one worth reporting
        return None


def translate_trace_error(error: BaseException, model: nn.Module) -> TraceError:
    """A TraceError naming the failure's kind, the module and source line, and a fix."""
    kind, fix = _classify(error)
    where = _user_location(error.__traceback__, model)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return TraceError(f"cannot trace the model: {kind}: {first_line}", where=where, fix=fix)


def _classify(error: BaseException) -> tuple[str, str]:
    name = type(error).__name__
    text = str(error)
    if "data-dependent" in text or name in ("GuardOnDataDependentSymNode", "DataDependentOutputException"):
        return (
            "data-dependent control flow",
            "Python control flow (if/while) or a size depends on tensor values; use "
            "torch.where / torch.cond, or move the decision out of forward()",
        )
    if "Cache" in text and ("cache_utils" in text or "use_cache" in text):
        return (
            "the model returns its key/value cache (use_cache=True)",
            "pass use_cache=False with the example inputs (e.g. {'input_ids': ids, 'labels': "
            "ids, 'use_cache': False}), or set model.config.use_cache = False before tracing",
        )
    if "not a known type" in text or "pytree" in text:
        return (
            "unsupported output type",
            "return tensors, tuples, lists, dicts or dataclasses registered with "
            "torch.utils._pytree.register_dataclass",
        )
    if "Dynamic control flow" in text or "symbolically traced variables" in text:
        return ("data-dependent control flow", "replace Python branches on tensors with torch.where")
    if isinstance(error, (TypeError, ValueError)) and ("argument" in text or "positional" in text):
        return (
            "example inputs do not match forward()",
            "pass the inputs forward() expects: a tuple of positional inputs or a dict of "
            "keyword inputs",
        )
    return (f"{name} while tracing", "see the source line above; simplify that code path")


def _user_location(tb: TracebackType | None, model: nn.Module) -> str:
    """Module path and source line of the innermost user frame of a traceback."""
    names = {id(m): name for name, m in model.named_modules()}
    module_path = None
    location = None
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        if any(marker in filename for marker in _LIB_MARKERS):
            continue
        location = f"{filename}:{lineno} in {frame.f_code.co_name}"
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            module_path = names[id(owner)] or "<root>"
    if location is None:
        return "model.forward"
    if module_path is not None:
        return f"module '{module_path}' ({type(_get(model, module_path)).__name__}) at {location}"
    return location


def _get(model: nn.Module, path: str) -> nn.Module:
    return model if path == "<root>" else model.get_submodule(path)
