"""Trace a deep stack of identical layers by tracing two and repeating the last.

``torch.export`` costs time in proportion to the graph it records, so an 80-layer model
takes 40 times as long as a 2-layer one though its layers repeat. When a model holds a
stack of layers (an ``nn.ModuleList`` or ``nn.Sequential``) whose members are alike — same
class, same parameter and buffer names, shapes, dtypes and ``requires_grad``, same
submodule classes and plain attributes (an attribute equal to the layer's own index, such
as Hugging Face's ``layer_idx``, apart) — the model is exported with its first two layers
and with its first three; the two-layer graph, with its last layer repeated once, must equal
the three-layer graph exactly: node names, ops, targets, wiring, shapes, dtypes, module
paths and source lines. Only then is it repeated to the full depth (each copy reads its own
layer's parameters, the copy before it where the original read the layer before, and what
comes after the stack reads the last layer). Otherwise — any difference, any failure —
the model is exported whole. Tests check that the repeated graph equals the full export
on the built-in GPT and Hugging Face models.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from autopar.trace.capture import canonicalize

MIN_LAYERS = 4  # below this, two shallow exports cost about what the whole one does
_SUFFIX = re.compile(r"^(.*)_(\d+)$")


def find_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, container) of the largest stack of alike layers, or None."""
    best = None
    for path, module in model.named_modules():
        if not path or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        layers = list(module.children())
        if len(layers) < MIN_LAYERS or len(layers) != len(module._modules):
            continue
        if [str(i) for i in range(len(layers))] != list(module._modules):
            continue
        first = _structure(layers[0])
        if all(_alike(first, 0, _structure(layer), i) for i, layer in enumerate(layers[1:], 1)):
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, path, module)
    return None if best is None else (best[1], best[2])


def _structure(layer: nn.Module) -> tuple:
    """What must be equal for two layers to trace alike."""
    out: list[tuple] = []
    for name, m in layer.named_modules(remove_duplicate=False):
        attrs = []
        for key, value in sorted(vars(m).items()):
            if key.startswith("_"):
                continue
            try:
                text = repr(value)
            except Exception:  # noqa: BLE001 - an attribute we cannot compare
                text = object()
            number = value if isinstance(value, int) and not isinstance(value, bool) else None
            attrs.append((key, text, number))
        hooks = (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        out.append((name, type(m), tuple(attrs), hooks))
    for name, p in layer.named_parameters(remove_duplicate=False):
        out.append((name, tuple(p.shape), p.dtype, p.requires_grad, "param"))
    for name, b in layer.named_buffers(remove_duplicate=False):
        out.append((name, tuple(b.shape), b.dtype, "buffer"))
    return tuple(out)


def _alike(a: tuple, i: int, b: tuple, j: int) -> bool:
    """Are layers ``i`` and ``j`` alike: equal structures, where an int attribute may
    differ only by holding each layer's own index (``layer_idx``)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != 4 or len(y) != 4:
            if x != y:
                return False
            continue
        if x[0] != y[0] or x[1] is not y[1] or x[3] != y[3] or len(x[2]) != len(y[2]):
            return False
        for (key, text, number), (key2, text2, number2) in zip(x[2], y[2]):
            if key != key2:
                return False
            if text != text2 and not (number == i and number2 == j):
                return False
    return True


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def export_repeated(model: nn.Module, args: tuple, kwargs: dict,
                    export) -> fx.GraphModule | None:
    """The model's graph from shallow exports (see the module docstring), or None when the
    model has no stack of alike layers or the check fails. ``export(model, args, kwargs)``
    exports a model and returns its GraphModule (or raises)."""
    found = find_stack(model)
    if found is None:
        return None
    path, stack = found
    n = len(stack)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    try:
        graphs = {}
        # A model may need its whole stack (experts counted by len(self.experts)): a
        # shallow export may fail, and then torch's fake tensors log the error loudly,
        # though the whole export that follows is what counts.
        with _quiet("torch._subclasses.fake_tensor"):
            for k in (2, 3):
                setattr(parent, attr, type(stack)(*[stack[i] for i in range(k)])
                        if isinstance(stack, nn.Sequential) else nn.ModuleList(stack[:k]))
                graphs[k] = export(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the whole export decides what to report
        return None
    finally:
        setattr(parent, attr, stack)
    try:
        three = _repeat(graphs[2], path, 2, 3)
        if three is None or not _same(three, graphs[3].graph):
            return None
        graph = _repeat(graphs[2], path, 2, n)
    except Exception:  # noqa: BLE001 - anything unexpected: export the whole model
        return None
    if graph is None:
        return None
    gm = graphs[2]
    for node in graph.nodes:
        if node.op == "get_attr" and not _has_attr(gm, str(node.target)):
            _assign(gm, str(node.target), _get(model, str(node.target)))
    # The graph setter would compile the graph's Python code, which canonicalize() does
    # again at its end: set it as the setter does, less that (half a second at 80 layers).
    gm._graph = graph
    graph.owning_module = gm
    canonicalize(gm)
    return gm


def _layer_index(path: str, stack: str) -> int | None:
    if not path.startswith(stack + "."):
        return None
    head = path[len(stack) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _node_layer(node: fx.Node, stack: str) -> int | None:
    if node.op == "get_attr":
        return _layer_index(str(node.target), stack)
    if node.op != "call_function":
        return None
    module_stack = node.meta.get("nn_module_stack") or {}
    found = None
    for mod_path, _ in module_stack.values():
        index = _layer_index(str(mod_path), stack)
        if index is not None:
            found = index
    return found


def _swap(text: str, stack: str, old: int, new: int) -> str:
    """``text`` with the layer ``old`` of ``stack`` renamed ``new`` (dotted and flattened
    spellings)."""
    for spelling in (stack, stack.replace(".", "_")):
        sep = "." if spelling == stack else "_"
        pattern = re.compile(re.escape(f"{spelling}{sep}{old}") + r"(?=$|[._\[])")
        text = pattern.sub(f"{spelling}{sep}{new}", text)
    return text


def _repeat(gm: fx.GraphModule, stack: str, k: int, n: int
            ) -> fx.Graph | None:
    """The graph of ``gm`` (a ``k``-layer export) with its last layer repeated up to ``n``
    layers; nodes are named as export names them (counters in graph order)."""
    last = k - 1
    layer_of = {node: _node_layer(node, stack) for node in gm.graph.nodes}
    position: dict[fx.Node, int] = {}
    sizes = [0] * k
    for node in gm.graph.nodes:
        layer = layer_of[node]
        if layer is not None:
            if not 0 <= layer < k:
                return None
            position[node] = sizes[layer]
            sizes[layer] += 1
    if not sizes[last] or len(set(sizes)) != 1:
        return None
    # Names: a layer's get_attr spells its target; the others are a base name and a
    # counter, which grows by the same stride from one layer to the next.
    stride: dict[str, int] = {}
    by_position = {(layer_of[node], position[node]): node for node in position}
    for node in gm.graph.nodes:
        if layer_of[node] == last and node.op != "get_attr":
            base, number = _counter(node.name)
            before = by_position[(last - 1, position[node])]
            base_before, number_before = _counter(before.name)
            if base_before != base or stride.setdefault(base, number - number_before) != (
                    number - number_before):
                return None
        elif layer_of[node] is not None and node.op == "get_attr":
            if node.name != _attr_name(str(node.target)):
                return None
    first_of_last = next(i for i, node in enumerate(gm.graph.nodes)
                         if layer_of[node] == last and node.op != "get_attr")

    def name(node: fx.Node, index: int, layer: int | None, target: str) -> str:
        if node.op == "get_attr" and layer_of[node] is not None:
            return _attr_name(target)
        base, number = _counter(node.name)
        if base not in stride:
            return node.name
        if layer_of[node] is not None:
            number += (layer - layer_of[node]) * stride[base]
        elif index > first_of_last:
            number += (n - k) * stride[base]
        return f"{base}_{number}" if number else base

    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    made: dict[object, fx.Node] = {}  # ("out", original) or (layer, position) -> new node

    index_of = {node: i for i, node in enumerate(gm.graph.nodes)}

    def emit(node: fx.Node, layer: int | None) -> None:
        reader = layer_of[node]

        def arg(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            source = layer_of[a]
            if source is None:
                return made[("out", a)]
            if reader is None:  # after the stack: the last layers
                return made[(source + n - k, position[a])]
            return made[(layer - (reader - source), position[a])]

        target = node.target
        if node.op == "get_attr" and reader is not None and layer != reader:
            target = _swap(str(target), stack, reader, layer)
        wanted = name(node, index_of[node], layer, str(target))
        new = graph.create_node(node.op, target, tree_map(arg, node.args),
                                tree_map(arg, node.kwargs), name=wanted)
        if new.name != wanted:
            raise ValueError(f"name {wanted} taken")
        new.meta = _meta(node.meta, stack, reader, layer)
        made[("out", node) if reader is None else (layer, position[node])] = new

    nodes = list(gm.graph.nodes)
    i = 0
    while i < len(nodes):
        if layer_of[nodes[i]] != last:
            emit(nodes[i], layer_of[nodes[i]])
            i += 1
            continue
        j = i
        while j < len(nodes) and layer_of[nodes[j]] == last:
            j += 1
        for layer in range(last, n):  # the last layer's run, once per layer from it on
            for node in nodes[i:j]:
                emit(node, layer)
        i = j
    graph.lint()
    return graph


def _attr_name(target: str) -> str:
    return target.replace(".", "_")


def _counter(name: str) -> tuple[str, int]:
    match = _SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _meta(meta: dict, stack: str, old: int | None, new: int) -> dict:
    out = dict(meta)
    if old is None or old == new:
        return out
    module_stack = meta.get("nn_module_stack")
    if module_stack:
        out["nn_module_stack"] = {
            _swap(key, stack, old, new): (_swap(str(path), stack, old, new), kind)
            for key, (path, kind) in module_stack.items()
        }
    out.pop("from_node", None)
    return out


def _same(a: fx.Graph, b: fx.Graph) -> bool:
    """Do two graphs hold the same nodes: names, ops, targets, wiring, values' shapes,
    dtypes and strides, module paths and source lines?"""
    left, right = list(a.nodes), list(b.nodes)
    if len(left) != len(right):
        return False
    for x, y in zip(left, right):
        if (x.name, x.op, str(x.target)) != (y.name, y.op, str(y.target)):
            return False
        if _described(x.args, x.kwargs) != _described(y.args, y.kwargs):
            return False
        if _value(x.meta.get("val")) != _value(y.meta.get("val")):
            return False
        if x.meta.get("stack_trace") != y.meta.get("stack_trace"):
            return False
        if list((x.meta.get("nn_module_stack") or {}).items()) != list(
                (y.meta.get("nn_module_stack") or {}).items()):
            return False
    return True


def _described(args: Any, kwargs: Any) -> str:
    return repr(tree_map(lambda v: ("node", v.name) if isinstance(v, fx.Node) else v,
                         (args, kwargs)))


def _value(val: Any) -> Any:
    leaves, spec = tree_flatten(val)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append((tuple(leaf.shape), leaf.dtype, tuple(leaf.stride()), leaf.requires_grad,
                        leaf.device.type))
        else:
            out.append(repr(leaf))
    return (str(spec), tuple(out))


def _has_attr(gm: fx.GraphModule, target: str) -> bool:
    try:
        _get(gm, target)
        return True
    except AttributeError:
        return False


def _get(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _assign(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    *path, leaf = target.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)
