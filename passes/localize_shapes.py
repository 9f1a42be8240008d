"""Rewrite shape arguments to this rank's local shapes.

The traced graph spells out global sizes (``view(x, [8, 1024, 12, 64])``); after sharding,
a rank holds ``[4, 1024, 6, 64]`` of that tensor. Ops whose output shape is an argument get
the node's local output shape (from the plan's placements); ``split`` sizes and full
``slice`` ends along a sharded dim shrink by the shard factor.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.analysis.plan_view import PlanView
from autopar.core.graph_facts import META_KEY
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass

aten = torch.ops.aten
# op -> position of its output-shape argument
SHAPE_ARG = {
    aten.view.default: 1,
    aten.reshape.default: 1,
    aten._unsafe_view.default: 1,
    aten.expand.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.full.default: 0,
}
INT64_MAX = 2**63 - 1
VIEWS = (aten.view.default, aten._unsafe_view.default)


def _norm(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


@register_pass
class LocalizeShapes(GraphPass):
    name = "localize-shapes"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        view = PlanView(gm, ctx.plan)
        changes: list[str] = []
        for node in gm.graph.nodes:
            if node.op != "call_function" or view.strategy(node, view.axes[0]) is None:
                continue
            target = node.target
            if target in VIEWS and any(view.size(a) > 1 for a in view.axes):
                # Collectives return contiguous tensors whose strides differ from the traced
                # ones, so a view the trace could take may need a copy: reshape decides.
                node.target = target = aten.reshape.default
            if target in SHAPE_ARG:
                pos = SHAPE_ARG[target]
                local = list(view.local_output_shape(node))
                if pos < len(node.args) and list(node.args[pos]) != local:
                    args = list(node.args)
                    args[pos] = local
                    node.args = tuple(args)
                    changes.append(f"{node.name}: shape -> {local}")
            elif target in (aten.split.Tensor, aten.split_with_sizes.default):
                self._split(node, view, changes)
            elif target is aten.slice.Tensor:
                self._slice(node, view, changes)
            elif target is aten.unflatten.int:
                self._unflatten(node, view, changes)
        return PassResult(gm, modified=bool(changes), changes=changes)

    def _split(self, node: fx.Node, view: PlanView, changes: list[str]) -> None:
        ndim = len(node.args[0].meta[META_KEY].shapes[0])
        dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim)
        factor = view.shard_factor(node, 0, dim)
        if factor == 1:
            return
        args = list(node.args)
        sizes = args[1]
        args[1] = [s // factor for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // factor
        node.args = tuple(args)
        changes.append(f"{node.name}: split sizes {sizes} -> {args[1]}")

    def _unflatten(self, node: fx.Node, view: PlanView, changes: list[str]) -> None:
        ndim = len(node.args[0].meta[META_KEY].shapes[0])
        dim, sizes = _norm(node.args[1], ndim), list(node.args[2])
        local = list(view.local_output_shape(node))[dim : dim + len(sizes)]
        if local != sizes:
            node.args = (node.args[0], node.args[1], local)
            changes.append(f"{node.name}: unflatten sizes -> {local}")

    def _slice(self, node: fx.Node, view: PlanView, changes: list[str]) -> None:
        shape = node.args[0].meta[META_KEY].shapes[0]
        dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(shape))
        factor = view.shard_factor(node, 0, dim)
        if factor == 1:
            return
        args = list(node.args)
        start = args[2] if len(args) > 2 else node.kwargs.get("start")
        end = args[3] if len(args) > 3 else node.kwargs.get("end")
        if (start or 0) != 0 or (end is not None and end < shape[dim]):
            raise ValueError(
                f"{node.name}: slice [{start}:{end}] of sharded dim {dim} is not a full slice"
            )
        if end is not None and end != INT64_MAX and len(args) > 3:
            args[3] = INT64_MAX
            node.args = tuple(args)
            changes.append(f"{node.name}: full slice of sharded dim {dim}")
