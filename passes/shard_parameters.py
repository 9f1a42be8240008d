"""Keep only this rank's shard of every parameter and buffer the plan shards.

A weight placed ``S(0)`` on ``tp`` becomes its ``tp``-th row block; ``S(0)g3`` (a fused
QKV weight) takes this rank's rows of each of the three blocks. The parameter stays an
``nn.Parameter`` under its original name, so optimizers, state dicts and DDP see ordinary
parameters (of local shape).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from autopar.analysis.plan_view import PlanView
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Shard
from autopar.ops.comm_ops import local_slice
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


def _set(root: nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner_name, _, attr = fqn.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if isinstance(value, nn.Parameter):
        owner.register_parameter(attr, value)
    elif attr in owner._buffers:
        owner.register_buffer(attr, value, persistent=attr not in owner._non_persistent_buffers_set)
    else:
        setattr(owner, attr, value)


@register_pass
class ShardParameters(GraphPass):
    name = "shard-parameters"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        view = PlanView(gm, ctx.plan)
        changes = []
        done: set[str] = set()
        aliases: dict[int, list[str]] = {}  # tied weights: one tensor under several names
        for fqn, tensor in [*gm.named_parameters(remove_duplicate=False),
                            *gm.named_buffers(remove_duplicate=False)]:
            aliases.setdefault(id(tensor), []).append(fqn)
        for node in gm.graph.nodes:
            if node.op != "get_attr" or META_KEY not in node.meta:
                continue
            param = node.meta[META_KEY].param
            if param is None or param.fqn in done:
                continue
            done.add(param.fqn)
            value = operator.attrgetter(param.fqn)(gm)
            local = value
            for axis in view.axes:
                p = view.placement(node, axis)
                if isinstance(p, Shard) and view.size(axis) > 1:
                    local = local_slice(local, p, view.size(axis), ctx.coords[axis])
                    changes.append(f"{param.fqn}: kept {p} part {ctx.coords[axis]} of "
                                   f"{view.size(axis)} on {axis}")
            if local is value:
                continue
            local = local.detach().clone().contiguous()
            if isinstance(value, nn.Parameter):
                local = nn.Parameter(local, requires_grad=value.requires_grad)
            for name in aliases.get(id(value), [param.fqn]):
                _set(gm, name, local)
        return PassResult(gm, modified=bool(changes), changes=changes)


