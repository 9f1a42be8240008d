"""Process groups for a plan's mesh, from the processes torchrun started."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.core.errors import RuntimeSetupError
from autopar.core.plan import Plan
from autopar.ops import comm_ops


@dataclass
class MeshContext:
    mesh: DeviceMesh | None  # None when the plan runs on one device
    coords: dict[str, int]  # this rank's index on each axis
    device: torch.device
    # False on a rank the plan does not use: a plan may use fewer devices than the cluster
    # has (``plan.explanation["devices"]``); it runs on ranks 0 .. plan.world_size - 1.
    active: bool = True
    # With pp > 2: the group of this rank's first and last pipeline ranks (same other
    # coordinates), where a model's tied embedding and head meet; made in ``build_mesh`` by
    # every launched rank, idle ones included (see ``pipeline_ends_group``).
    pipeline_ends: dist.ProcessGroup | None = None
    # The ranks that hold the same weights and average their gradients: dp, or dp x cp
    # flattened into one dim (context parallelism replicates weights as data parallelism
    # does; torchtitan folds cp into its FSDP mesh the same way).
    data_mesh: DeviceMesh | None = None
    # Under expert parallelism: the ranks holding the same experts (``edp``, with cp), over
    # which FSDP2 shards the expert weights.
    expert_data_mesh: DeviceMesh | None = None
    # The mesh FSDP2 shards over: ``data_mesh``, or under HSDP its 2-D view
    # (``dp_replicate``, ``dp_shard`` x cp): sharded within a group, replicated across.
    shard_mesh: DeviceMesh | None = None

    def group(self, axis: str) -> dist.ProcessGroup | None:
        if self.mesh is None or axis not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh[axis].get_group()

    def data_group(self) -> dist.ProcessGroup | None:
        """The gradient-averaging group (dp x cp), or None on one device."""
        return self.data_mesh.get_group() if self.data_mesh is not None else None


def ensure_process_group(backend: str) -> None:
    """Join the process group torchrun describes in the environment, if not joined yet."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return  # a single process: no group needed
    if backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)
    if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A job torchrun restarted (--max-restarts) meets in the store its agent kept from
        # the failed attempt: the old attempt's group keys there made the new processes wait
        # on dead peers in gloo's connect (seen with torch 2.13). Each attempt gets keys of
        # its own, as torchelastic's store once prefixed them.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(minutes=5))
        dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/attempt_{restart}",
                                                                store),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        return
    dist.init_process_group(backend)


def device_for(backend: str) -> torch.device:
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_world_size(needed: int, what: str) -> None:
    """Refuse a launch whose process count is not the ``needed`` ranks of ``what`` (a plan's
    mesh, a cluster), before any work: torchrun must start one process per device."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != needed:
        raise RuntimeSetupError(
            f"{what} needs {needed} processes but {world} {'was' if world == 1 else 'were'} "
            "launched",
            where="world size",
            fix=f"launch with torchrun --nproc-per-node {needed} (or re-plan for a cluster of "
            f"{world} device{'s' if world != 1 else ''})",
        )


def build_mesh(plan: Plan, backend: str) -> MeshContext:
    """The plan's device mesh (``dp`` outer, ``tp`` inner), bound for the collectives.

    The launch has one process per device of the plan's mesh, or, for a plan that uses fewer
    devices than its cluster has, one per device of the cluster: the mesh is then built on
    ranks 0 .. ``plan.world_size`` - 1 (every rank takes part in creating its groups) and the
    others get an inactive context."""
    ensure_process_group(backend)
    mesh_text = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    needed = plan.world_size
    launched = dist.get_world_size() if dist.is_initialized() else 1
    if launched != needed and launched != plan.cluster["devices"]:
        check_world_size(needed, f"the plan ({mesh_text})")
    rank = dist.get_rank() if dist.is_initialized() else 0
    active = rank < needed
    device = device_for(backend)
    if needed == 1:
        comm_ops.bind_axis_groups({})
        return MeshContext(None, {axis: 0 for axis in plan.mesh}, device, active)
    names, sizes = device_axes(plan)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
    ends = pipeline_ends_group(mesh, rank) if plan.mesh.get("pp", 1) > 2 else None
    if "cp" in names and launched != needed:
        # the flattened dp x cp group is made by the mesh's ranks; idle ranks have no part
        raise RuntimeSetupError(
            f"a plan with cp={plan.mesh['cp']} runs on exactly its {needed} devices, but "
            f"{launched} processes were launched", where="plan.mesh.cp",
            fix=f"launch {needed} processes (torchrun --nproc-per-node {needed})")
    if not active:
        comm_ops.bind_axis_groups({})
        return MeshContext(mesh, {}, device, active=False)
    coords = {axis: mesh.get_local_rank(axis) for axis in names}
    axes = {axis: mesh[axis] for axis in names}
    replicas: tuple[str, ...] = ("dp",)
    for outer, inner in (("edp", "ep"), ("dp_replicate", "dp_shard")):
        if inner in names:  # dp carved in two: rank in dp = outer * (inner's size) + inner
            replicas = (outer, inner)
            coords["dp"] = coords[outer] * mesh[inner].size() + coords[inner]
            axes["dp"] = mesh[replicas]._flatten("dp")
    data = mesh[(*replicas, "cp")]._flatten("dp_cp") if "cp" in names else axes["dp"]
    experts = None
    if "ep" in names:
        experts = mesh[("edp", "cp")]._flatten("edp_cp") if "cp" in names else mesh["edp"]
    sharded = data
    if "dp_shard" in names and "cp" in names:  # the dp x cp ranks as (replica, shard) groups
        replicate = mesh["dp_replicate"].size()
        sharded = data._unflatten(0, (replicate, data.size() // replicate),
                                  ("dp_replicate", "dp_shard_cp"))
    elif "dp_shard" in names:
        sharded = mesh[("dp_replicate", "dp_shard")]
    zigzag = ("cp",) if plan.context.get("layout") == "zigzag" else ()
    comm_ops.bind_axis_groups({axis: sub.get_group() for axis, sub in axes.items()
                               if sub.size() > 1}, zigzag=zigzag)
    return MeshContext(mesh, coords, device, pipeline_ends=ends, data_mesh=data,
                       expert_data_mesh=experts, shard_mesh=sharded)


def device_axes(plan: Plan) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The device mesh's dims: the plan's axes, with ``dp`` split into ``edp`` (ranks
    holding the same experts) x ``ep`` when the plan spreads experts, or under HSDP into
    ``dp_replicate`` (groups replicating the states) x ``dp_shard`` (ranks sharding them)."""
    names: list[str] = []
    sizes: list[int] = []
    ep = plan.mesh.get("ep", 1)
    replicate = plan.training.get("dp_replicate", 1)
    for axis, size in plan.mesh.items():
        if axis == "ep":
            continue
        if axis == "dp" and "ep" in plan.mesh:
            names += ["edp", "ep"]
            sizes += [size // ep, ep]
            continue
        if axis == "dp" and replicate > 1:
            names += ["dp_replicate", "dp_shard"]
            sizes += [replicate, size // replicate]
            continue
        names.append(axis)
        sizes.append(size)
    return tuple(names), tuple(sizes)


_ENDS_GROUPS: dict[tuple[int, tuple[int, int]], dist.ProcessGroup] = {}
"""Groups :func:`pipeline_ends_group` made, reused by later plans of the same launch."""


def pipeline_ends_group(mesh: DeviceMesh, rank: int) -> dist.ProcessGroup | None:
    """Groups of the first and last pipeline rank of each column of the mesh (pp is its first
    dim); this rank's, or None. Every launched rank must call this, in the same order as the
    mesh's own groups: ``new_group`` names groups by a counter all processes advance together,
    and a group made on some ranks only (the active ones of a plan on fewer devices) would
    leave the next plan's groups named apart on the others, and their creation hanging."""
    flat = mesh.mesh.reshape(mesh.mesh.shape[0], -1)
    mine = None
    for column in range(flat.shape[1]):
        members = (int(flat[0, column]), int(flat[-1, column]))
        key = (id(dist.group.WORLD), members)
        if key not in _ENDS_GROUPS:  # every rank makes it once, in the same order
            _ENDS_GROUPS[key] = dist.new_group(list(members))
        if rank in members:
            mine = _ENDS_GROUPS[key]
    return mine

