"""Build the OpCall a sharding rule sees from an annotated fx node."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from autopar.core.graph_facts import META_KEY
from autopar.core.strategy import OpCall, TensorMeta

_SPLITS = {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"}


def tensor_meta(node: fx.Node, index: int = 0) -> TensorMeta:
    facts = node.meta[META_KEY]
    return TensorMeta(facts.shapes[index], getattr(torch, facts.dtypes[index]))


_REMEMBERED: ContextVar[dict[fx.Node, OpCall] | None] = ContextVar("remembered_calls",
                                                                   default=None)


@contextmanager
def remembered_calls() -> Iterator[None]:
    """Within, :func:`op_call` describes each node once. For planning, which reads a graph
    it does not change and asks for the same node's call from the batch marking, the
    sequence marking and the problem of every tp degree (5,500 nodes for Llama-3-70B).
    Per thread (a context variable): a plan made beside another shares nothing with it."""
    outer = _REMEMBERED.get()
    token = _REMEMBERED.set({} if outer is None else outer)
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def op_call(node: fx.Node) -> OpCall:
    """The node's call with tensor arguments replaced by their TensorMeta."""
    remembered = _REMEMBERED.get()
    if remembered is None:
        return _op_call(node)
    call = remembered.get(node)
    if call is None:
        call = remembered[node] = _op_call(node)
    return call


def _op_call(node: fx.Node) -> OpCall:

    def describe(a: Any) -> Any:
        if isinstance(a, fx.Node):
            facts = a.meta.get(META_KEY)
            if facts is not None and facts.shapes:
                if a.op == "call_function" and a.target is operator.getitem:
                    return tensor_meta(a)
                if len(facts.shapes) == 1 and isinstance(a.meta.get("val"), torch.Tensor):
                    return tensor_meta(a)
            val = a.meta.get("val")
            return val if isinstance(val, (int, float, bool)) else a
        return a

    args, kwargs = tree_map(describe, (tuple(node.args), dict(node.kwargs)))
    facts = node.meta[META_KEY]
    out = tuple(
        TensorMeta(shape, getattr(torch, dtype)) for shape, dtype in zip(facts.shapes, facts.dtypes)
    )
    return OpCall(node.target, args, kwargs, out, hints=_hints(node))


_PASS_THROUGH = {
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
    "aten.add.Tensor", "aten.contiguous.default", "aten.clone.default", "aten.to.dtype",
}


def _hints(node: fx.Node) -> dict[str, Any]:
    """``split_groups``: into how many equal chunks consumers split this node's last dim,
    looking through views and elementwise ops that keep that dim (GPT-2's fused QKV is
    ``addmm -> view -> split``)."""
    facts = node.meta[META_KEY]
    if not facts.shapes or not facts.shapes[0]:
        return {}
    size = facts.shapes[0][-1]
    groups: set[int] = set()
    frontier, seen = [node], {node}
    for _ in range(4):
        following = []
        for current in frontier:
            for user in current.users:
                user_facts = user.meta.get(META_KEY)
                if user in seen or user_facts is None or not user_facts.shapes:
                    continue
                seen.add(user)
                name = str(user.target)
                if name in _SPLITS and user.args[0] is current:
                    groups.update(_split_groups(user, current, size))
                elif name in _PASS_THROUGH and user_facts.shapes[0][-1:] == (size,):
                    following.append(user)
        frontier = following
    return {"split_groups": tuple(sorted(groups))} if groups else {}


def _split_groups(split: fx.Node, source: fx.Node, size: int) -> set[int]:
    ndim = len(source.meta[META_KEY].shapes[0])
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim % ndim != ndim - 1:
        return set()
    pieces = len(split.meta[META_KEY].shapes)
    shapes = split.meta[META_KEY].shapes
    if pieces > 1 and all(s[-1] == size // pieces for s in shapes):
        return {pieces}
    return set()
