"""Gradients of expert weights under expert parallelism.

Expert weights are not replicated over the whole data-parallel group: each ``ep`` rank
holds a block of experts, and only the ranks of the other ``ep`` groups (``edp``, the
expert data-parallel ranks) hold the same block. DDP, which averages over all of dp, must
leave them alone; after backward their gradients are summed over ``edp`` and divided by
dp. Each rank's expert gradient already sums the loss terms of every ``ep`` rank whose
tokens it served (:mod:`autopar.ops.expert_ops`), so that division gives the same average over
the global batch as every other weight gets.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from autopar.core.plan import Plan
from autopar.ops import comm_ops


def expert_parameters(program: nn.Module) -> list[str]:
    """Names of the parameters the expert-parallel pass kept a block of."""
    meta = getattr(program, "meta", {}) or {}
    return list(meta.get("autopar_expert_params", ()))


def reduce_expert_grads(module: nn.Module, names: list[str], plan: Plan) -> None:
    """Sum expert gradients over the ranks holding the same experts, divide by dp."""
    if not names:
        return
    params = dict(module.named_parameters())
    group, n, _ = comm_ops._group("edp")
    dp = plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1)
    for name in names:
        p = params.get(name)
        if p is None or p.grad is None:
            continue
        if group is not None and n > 1:
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(dp)
