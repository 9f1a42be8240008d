"""How this rank's part of each weight maps onto the whole weight, for distributed checkpoints.

``torch.distributed.checkpoint`` (DCP) reshards by itself when every value it is given says
which part of the whole tensor it holds: a DTensor does, a plain tensor stands for the whole
(replicas on several ranks are written once). So each parameter (and each optimizer state of
its shape) becomes one of:

- ``whole``: a plain tensor, every rank that holds it holds all of it (dp/cp replicas);
- ``dtensor``: one contiguous shard, described as a DTensor — FSDP2's own parameters
  (ZeRO-1/2/3 over dp), or a tensor-parallel shard ``Shard(dim)`` over the tp mesh;
- ``gathered``: a shard DCP cannot describe as one chunk — a grouped tensor-parallel shard
  (a fused QKV weight is split into q, k, v, each sharded), or tensor parallelism with FSDP2
  on top — is gathered whole for saving, and read whole then sliced for loading. This costs
  the whole tensor's memory on each rank for the time of the save or load, for these
  weights only.

Reading goes into clones (``destination``), copied into the live tensors only once the whole
read succeeded (``copy_back``): a failed load leaves the model as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

from autopar.core.placements import Shard, parse_placement
from autopar.ops.comm_ops import _gather, local_slice
from autopar.runtime.mesh import MeshContext

_PREFIX = re.compile(r"^(wrapped|_program)\.(\d+\.)?(module\.)?")


def model_name(name: str) -> str:
    """A parameter's name in the model from its name under the ParallelModule (DDP's
    ``module.``, a pipeline stage's list index)."""
    return _PREFIX.sub("", name)


def named_parameters(pm: nn.Module) -> dict[str, nn.Parameter]:
    """The model's name -> this rank's parameter (a tied weight under its plan name)."""
    plan_names = set(pm.plan.params)
    out: dict[str, nn.Parameter] = {}
    seen: dict[int, str] = {}
    for name, p in pm.named_parameters(remove_duplicate=False):
        fqn = model_name(name)
        if id(p) in seen:
            if fqn in plan_names and seen[id(p)] not in plan_names:
                out[fqn] = out.pop(seen[id(p)])
                seen[id(p)] = fqn
            continue
        seen[id(p)] = fqn
        out[fqn] = p
    return out


def tied_aliases(pm: nn.Module) -> dict[str, str]:
    """Other names of a tied weight -> the name the checkpoint keeps it under."""
    canonical = {id(p): fqn for fqn, p in named_parameters(pm).items()}
    return {model_name(n): canonical[id(p)] for n, p in pm.named_parameters(remove_duplicate=False)
            if model_name(n) != canonical[id(p)]}


@dataclass(frozen=True)
class Layout:
    """Where this rank's tensor sits in the whole one (see the module docstring)."""

    kind: str  # "whole" | "dtensor" | "gathered"
    global_shape: tuple[int, ...]
    tp: Shard | None = None  # the tensor-parallel shard, when there is one
    fsdp: bool = False  # the local tensor is an FSDP2 DTensor (a dp shard of the tp part)


def layout_of(param: torch.Tensor, fqn: str, pm: nn.Module) -> Layout:
    placement = pm.plan.params.get(fqn, {}).get("tp", "R")
    tp = parse_placement(placement) if placement.startswith("S(") else None
    fsdp = isinstance(param, DTensor)
    shape = tuple(param.shape)  # an FSDP2 DTensor's shape is its (tp-local) whole
    n = pm.plan.mesh.get("tp", 1)
    if tp is not None and n > 1:
        shape = shape[:tp.dim] + (shape[tp.dim] * n,) + shape[tp.dim + 1:]
    else:
        tp = None
    if tp is None:
        return Layout("dtensor" if fsdp else "whole", shape, None, fsdp)
    if tp.groups == 1 and not fsdp:
        return Layout("dtensor", shape, tp, False)
    return Layout("gathered", shape, tp, fsdp)


def _tp_context(ctx: MeshContext) -> tuple[dist.ProcessGroup, int, int]:
    group = ctx.group("tp")
    return group, dist.get_world_size(group), ctx.coords.get("tp", 0)


def save_value(tensor: torch.Tensor, layout: Layout, ctx: MeshContext) -> torch.Tensor:
    """What DCP is given to write for ``tensor`` (a parameter or an optimizer state)."""
    local = tensor.detach()
    if layout.kind == "whole":
        return local
    if layout.kind == "dtensor":
        if layout.fsdp:
            return local
        return DTensor.from_local(local, ctx.mesh["tp"], [DShard(layout.tp.dim)],
                                  run_check=False, shape=torch.Size(layout.global_shape),
                                  stride=_contiguous_stride(layout.global_shape))
    part = local.full_tensor() if layout.fsdp else local
    group, n, _ = _tp_context(ctx)
    return _gather(part, layout.tp, group, n)


def destination(tensor: torch.Tensor, layout: Layout, ctx: MeshContext) -> torch.Tensor:
    """A fresh tensor DCP reads this rank's part of the value into."""
    local = tensor.detach()
    if layout.kind == "whole":
        return torch.empty_like(local)
    if layout.kind == "dtensor":
        if layout.fsdp:
            return DTensor.from_local(torch.empty_like(local.to_local()), local.device_mesh,
                                      local.placements, run_check=False, shape=local.shape,
                                      stride=local.stride())
        return DTensor.from_local(torch.empty_like(local), ctx.mesh["tp"],
                                  [DShard(layout.tp.dim)], run_check=False,
                                  shape=torch.Size(layout.global_shape),
                                  stride=_contiguous_stride(layout.global_shape))
    dtype = local.dtype
    return torch.empty(layout.global_shape, dtype=dtype, device=_device(local))


def copy_back(tensor: torch.Tensor, value: torch.Tensor, layout: Layout,
              ctx: MeshContext) -> None:
    """Write what was read (``destination``'s tensor, now filled) into the live tensor."""
    with torch.no_grad():
        if layout.kind == "whole":
            tensor.copy_(value)
            return
        if layout.kind == "dtensor":
            target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            target.copy_(value.to_local())
            return
    copy_whole(tensor, value, layout, ctx)


def copy_whole(tensor: torch.Tensor, whole: torch.Tensor, layout: Layout,
               ctx: MeshContext) -> None:
    """Write this rank's part of the ``whole`` tensor into the live one."""
    part = whole
    if layout.tp is not None:
        _, n, rank = _tp_context(ctx)
        part = local_slice(whole, layout.tp, n, rank)
    with torch.no_grad():
        if layout.fsdp:  # FSDP2 holds chunk(dp)[rank] of dim 0 of the (tp) part
            # on its mesh's sharding dim (HSDP's mesh is (replicate, shard): the last one)
            mesh, dim = tensor.device_mesh, tensor.device_mesh.ndim - 1
            chunks = part.chunk(mesh.size(dim), 0)
            rank = mesh.get_local_rank(dim)
            if rank < len(chunks) and chunks[rank].numel():
                tensor.to_local().copy_(chunks[rank])
            return
        tensor.copy_(part)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device
