"""Attach a NodeFacts to every node: shapes, dtypes, FLOPs, bytes, parameters, owners."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten

from autopar.core.graph_facts import META_KEY, NodeFacts, ParamFacts
from autopar.trace.expected_rows import expected_sizes
from autopar.trace.op_measure import EXPECTED, OpCostMeter, concrete

_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    """The tensor outputs of a node, flattened (a split gives several)."""
    val = node.meta.get("val")
    return [t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)]


def tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """Input nodes that carry a tensor, in the flattened order strategies use."""
    leaves, _ = tree_flatten((node.args, node.kwargs))
    return [
        a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


def is_view_op(target: Any) -> bool:
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None for r in schema.returns) and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


_RESHAPES = {"aten.reshape.default", "aten.flatten.using_ints", "aten.reshape_as.default"}
_CASTS = {"aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other",
          "aten.type_as.default"}


def _copied(node: fx.Node, outs: list[torch.Tensor], inputs: list[fx.Node],
            outs_of: dict[fx.Node, list[torch.Tensor]]) -> bool:
    """Whether an op whose schema may alias (``reshape``, ``contiguous``, ``to``) makes a
    new tensor: a reshape of a transposed or expanded tensor copies it (eager Llama's
    ``repeat_kv``, attention heads merged back), and then it runs a copy kernel. Told from
    the input's shape and strides, as torch decides (a view where the strides allow one).
    A cast the fp32 trace makes a no-op follows the plan's precision at run time
    (``passes/cast_precision``)."""
    target = str(node.target)
    if not outs or not inputs or not outs_of.get(inputs[0]):
        return False
    source = outs_of[inputs[0]][0]
    if target == "aten.contiguous.default":
        return not source.is_contiguous()
    if target in _CASTS:
        return outs[0].dtype != source.dtype
    if target in _RESHAPES:
        try:
            torch.empty_strided(source.shape, source.stride(), dtype=source.dtype,
                                device="meta").view(outs[0].shape)
        except RuntimeError:  # the strides allow no view: reshape copies
            return True
    return False


def _nbytes(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= concrete(s)
    return n * t.element_size()


def _module_owner(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    kind_name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return str(path), kind_name.rsplit(".", 1)[-1]


def _source(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    found = _FILE_LINE.findall(trace)
    user = [f for f in found if "site-packages/torch/" not in f[0]]
    pick = (user or found or [None])[-1]
    return f"{pick[0]}:{pick[1]}" if pick else ""


def _param_facts(gm: fx.GraphModule, node: fx.Node) -> ParamFacts | None:
    target = str(node.target)
    try:
        value = operator.attrgetter(target)(gm)
    except AttributeError:
        return None
    if not isinstance(value, torch.Tensor):
        return None  # a submodule (the body of a higher-order op)
    is_buffer = not isinstance(value, torch.nn.Parameter)
    return ParamFacts(
        fqn=target,
        shape=tuple(value.shape),
        dtype=str(value.dtype).removeprefix("torch."),
        trainable=(not is_buffer) and value.requires_grad,
        is_buffer=is_buffer,
    )


def _output_requires_grad(node: fx.Node, input_grads: list[bool],
                          vals: list[torch.Tensor] | None = None) -> bool:
    vals = tensor_vals(node) if vals is None else vals
    if not vals or not any(t.is_floating_point() or t.is_complex() for t in vals):
        return False  # complex values carry gradients too (rotary embeddings as products)
    name = str(node.target)
    if "wrap_with_set_grad_enabled" in name and node.args and node.args[0] is False:
        return False
    if name.startswith("aten.detach") or "_assert" in name:
        return False
    return any(input_grads)


def annotate(gm: fx.GraphModule, *, costs: bool = True) -> None:
    """Fill ``node.meta["autopar"]`` for every node of ``gm``; data-dependent row counts
    at their expected values (:mod:`autopar.trace.expected_rows`). ``costs``: measure each
    op's FLOPs and saved tensors (the planner's inputs; a third of a trace's time)."""
    token = EXPECTED.set(expected_sizes(gm))
    try:
        _annotate(gm, costs)
    finally:
        EXPECTED.reset(token)


def _annotate(gm: fx.GraphModule, costs: bool) -> None:
    # each node's tensors, flattened once (inputs are read again by every consumer)
    outs_of = {n: tensor_vals(n) for n in gm.graph.nodes}
    fake_mode = detect_fake_mode([t for ts in outs_of.values() for t in ts]) if costs else None
    meter = OpCostMeter(fake_mode, gm) if fake_mode is not None else None
    requires_grad: dict[fx.Node, bool] = {}

    for node in gm.graph.nodes:
        outs = outs_of[node]
        module_path, module_type = _module_owner(node)
        facts = NodeFacts(
            name=node.name,
            op=node.op,
            target=str(node.target),
            shapes=tuple(tuple(concrete(s) for s in t.shape) for t in outs),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in outs),
            module_path=module_path,
            module_type=module_type,
            source=_source(node),
        )
        inputs = tensor_input_nodes(node)
        input_grads = [requires_grad.get(a, False) for a in inputs]
        if node.op == "get_attr":
            facts.param = _param_facts(gm, node)
            requires_grad[node] = bool(facts.param and facts.param.trainable)
            facts.module_path = facts.param.fqn.rsplit(".", 1)[0] if facts.param else ""
        elif node.op == "placeholder":
            requires_grad[node] = False
        elif node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            requires_grad[node] = requires_grad.get(source, False) and bool(outs) and (
                outs[0].is_floating_point() or outs[0].is_complex()
            )
            facts.is_view = True
        elif node.op == "call_function":
            requires_grad[node] = _output_requires_grad(node, input_grads, outs)
            facts.params = tuple(
                a.meta[META_KEY].param.fqn
                for a in inputs
                if a.op == "get_attr" and a.meta[META_KEY].param is not None
            )
            facts.is_view = is_view_op(node.target) and not _copied(node, outs, inputs,
                                                                           outs_of)
            if not facts.is_view:
                facts.bytes_read = sum(_nbytes(t) for a in inputs for t in outs_of[a])
                facts.bytes_written = sum(_nbytes(t) for t in outs)
            if meter is not None:
                m = meter.measure(node, input_grads)
                facts.fwd_flops, facts.bwd_flops = m.fwd_flops, m.bwd_flops
                facts.bwd_bytes, facts.bwd_kernels = m.bwd_bytes, m.bwd_kernels
                if requires_grad[node]:
                    facts.saved_inputs = m.saved_inputs
                    facts.saves_output = m.saves_output
                    facts.extra_saved_bytes = m.extra_saved_bytes
                    facts.extra_saved_float_numel = m.extra_saved_float_numel
                    facts.extra_saved_other_bytes = m.extra_saved_other_bytes
        facts.requires_grad = requires_grad.get(node, False)
        node.meta[META_KEY] = facts
    _grads_through_writes(gm)


def _grads_through_writes(gm: fx.GraphModule) -> None:
    """A buffer written in place with a value that requires grad requires grad from then on,
    and so do its views and what reads them: mark them (conservatively, also readers before
    the write), or the tensor-parallel pass would skip their gradients' all-reduce."""
    from autopar.strategies.mutation import roots, writes

    root = roots(gm.graph)
    while True:
        seeds = {base for write, base in writes(gm.graph)
                 if write.meta[META_KEY].requires_grad and not base.meta[META_KEY].requires_grad}
        if not seeds:
            return
        for node in gm.graph.nodes:
            facts = node.meta.get(META_KEY)
            if facts is None or facts.requires_grad:
                continue
            inputs = [a.meta[META_KEY].requires_grad for a in tensor_input_nodes(node)
                      if META_KEY in a.meta]
            if root.get(node) in seeds or (node.op == "call_function" and _output_requires_grad(
                    node, inputs)):
                facts.requires_grad = True
