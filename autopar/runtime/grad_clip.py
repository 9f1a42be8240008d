"""Gradient clipping by the norm of the whole model's gradient, agreed over every rank.

``torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)`` takes the norm of what one
rank holds: under tensor parallelism a shard of some weights and a replica of others, under
pipeline parallelism one stage's weights. Each rank would scale its gradients by its own
factor, the replicas of a weight would drift apart, and the step would differ from
single-device training without any error. Here every rank adds the squares of the gradient
pieces it holds, each divided by the number of ranks holding that same piece (dp, cp and tp
replicas, a tied weight on two pipeline stages), and one all-reduce over every launched rank
gives the norm of the whole gradient: every rank scales by the factor one device would.

Why written here: torch's clip handles FSDP2's DTensor shards, but autopar's tensor-parallel
shards are plain tensors and pipeline stages hold disjoint weights; torchtitan's pp-aware
clip is not a library API.

    loss = pm.train_step(*args)
    norm = pm.clip_grad_norm_(1.0)       # the norm before clipping, as torch returns it
    opt.step()
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.core.errors import AutoparError
from autopar.runtime.checkpoint_layout import layout_of, named_parameters
from autopar.runtime.experts import expert_parameters

_EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _piece(param: torch.Tensor, fqn: str, pm: nn.Module, experts: set[int]) -> tuple:
    """Which piece of the whole weight this rank's ``param`` is: ranks with equal pieces
    hold the same values (replicas)."""
    coords = pm.mesh_context.coords
    key: list = [fqn]
    if layout_of(param, fqn, pm).tp is not None:
        key.append(("tp", coords.get("tp", 0)))
    if isinstance(param, DTensor):  # FSDP2: a shard on each mesh dim it shards over
        coordinate = param.device_mesh.get_coordinate() or []
        key.append(("fsdp", tuple(c for c, p in zip(coordinate, param.placements)
                                  if p.is_shard())))
    if id(param) in experts:  # each ep rank holds other experts under the same names
        key.append(("ep", coords.get("ep", 0)))
    return tuple(key)


def _holdings(pm: nn.Module) -> list[tuple[nn.Parameter, float]]:
    """This rank's trainable parameters, each with the number of ranks holding the same
    piece; computed once per module (one all_gather_object over every launched rank)."""
    cached = getattr(pm, "_clip_holdings", None)
    if cached is not None:
        return cached
    mine: list[tuple[nn.Parameter, tuple]] = []
    if getattr(pm, "active", True):
        program = getattr(pm, "_program", None)
        names = set(expert_parameters(program)) if program is not None else set()
        experts = {id(p) for n, p in program.named_parameters() if n in names} if names else set()
        mine = [(p, _piece(p, fqn, pm, experts))
                for fqn, p in named_parameters(pm).items() if p.requires_grad]
    counts: Counter = Counter(key for _, key in mine)
    if _world() > 1:
        gathered: list = [None] * _world()
        dist.all_gather_object(gathered, [key for _, key in mine])
        counts = Counter(key for keys in gathered for key in keys)
    held = [(p, float(counts[key])) for p, key in mine]
    pm._clip_holdings = held
    return held


def clip_grad_norm_(pm: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of the plan by ``min(1, max_norm / (norm + 1e-6))``, ``norm``
    being the ``norm_type``-norm of the whole model's gradient; returns that norm (before
    clipping) on every rank. Every launched rank calls it, after ``train_step``."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise AutoparError(f"max_norm must be a positive number, got {max_norm}",
                           where="clip_grad_norm_(max_norm=...)",
                           fix="pass the largest gradient norm to allow, e.g. 1.0")
    if not (norm_type > 0):
        raise AutoparError(f"norm_type must be positive or inf, got {norm_type}",
                           where="clip_grad_norm_(norm_type=...)",
                           fix="use 2.0 (the Euclidean norm), 1.0, or float('inf')")
    held = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, copies)
            for p, copies in _holdings(pm) if p.grad is not None]
    device = pm.mesh_context.device
    infinite = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad, copies in held:
        if grad.numel() == 0:
            continue
        if infinite:
            total = torch.maximum(total, grad.detach().abs().max().float())
        else:
            norm = torch.linalg.vector_norm(grad.detach().float(), norm_type)
            total = total + norm.pow(norm_type) / copies
    if _world() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
    norm = total if infinite else total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + _EPS), max=1.0)
    for grad, _ in held:
        grad.detach().mul_(coefficient.to(grad.device, grad.dtype))
    return norm
