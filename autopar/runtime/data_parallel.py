"""Data parallelism through the real engines: DDP for ZeRO-0, FSDP2 for ZeRO-3."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from autopar.errors import RuntimeSetupError
from autopar.runtime.mesh import MeshContext


def wrap_data_parallel(
    module: nn.Module, ctx: MeshContext, zero_stage: int, units: list[nn.Module],
    pipelined: bool = False,
) -> nn.Module:
    """Wrap ``module`` for data parallelism over the ``dp`` axis (with ``cp``: over dp x cp,
    the ranks that hold the same weights).

    ``units`` are the submodules FSDP2 shards and gathers one at a time (the outlined
    layers), so at most the root's weights and about two layers are whole at once. A
    pipeline stage gets FSDP2's ``replicate`` for ZeRO-0 instead of DDP: the pipeline's
    first step runs a shape-inference backward that DDP's reducer counts as a real one.
    """
    group = ctx.data_group()
    if group is None or group.size() == 1:
        return module
    if zero_stage == 0 and pipelined:
        replicate(module, mesh=ctx.data_mesh)
        return module
    if zero_stage == 0:
        return DistributedDataParallel(
            module,
            process_group=group,
            gradient_as_bucket_view=True,
            device_ids=None if ctx.device.type == "cpu" else [ctx.device],
        )
    if zero_stage == 3:
        dp_mesh = ctx.data_mesh
        for unit in units:
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(module, mesh=dp_mesh)
        return module
    raise RuntimeSetupError(
        f"ZeRO stage {zero_stage} is modelled but not executable yet",
        where="plan.training.zero",
        fix="re-plan with zero=(0, 3)",
    )
