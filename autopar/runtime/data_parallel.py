"""Data parallelism through the real engines: DDP for ZeRO-0, FSDP2 for ZeRO-3."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from autopar.errors import RuntimeSetupError
from autopar.runtime.mesh import MeshContext


def wrap_data_parallel(
    module: nn.Module, ctx: MeshContext, zero_stage: int, units: list[nn.Module],
    pipelined: bool = False, param_dtype: torch.dtype = torch.float32,
    experts: list[str] | None = None,
) -> nn.Module:
    """Wrap ``module`` for data parallelism over the ``dp`` axis (with ``cp``: over dp x cp,
    the ranks that hold the same weights).

    ``units`` are the submodules FSDP2 shards and gathers one at a time (the outlined
    layers), so at most the root's weights and about two layers are whole at once. A
    pipeline stage gets FSDP2's ``replicate`` for ZeRO-0 instead of DDP: the pipeline's
    first step runs a shape-inference backward that DDP's reducer counts as a real one.

    ``param_dtype`` (the plan's ``precision_policy.params``): ZeRO-3 gathers parameters in
    it (FSDP2's ``MixedPrecisionPolicy``) and reduce-scatters gradients in fp32; the sharded
    parameters the optimizer steps stay fp32. Inputs are not cast (the program's own casts
    say what computes in which dtype).

    ``experts``: parameters held by part of the group only (expert parallelism); DDP leaves
    them to :func:`autopar.runtime.experts.reduce_expert_grads`.
    """
    group = ctx.data_group()
    if group is None or group.size() == 1:
        return module
    if experts and (zero_stage != 0 or pipelined):
        raise RuntimeSetupError(
            "expert parallelism runs with ZeRO-0 and without pipeline stages yet",
            where="plan.mesh.ep", fix="re-plan with zero=0 and pp=1, or ep=1")
    if zero_stage == 0 and pipelined:
        replicate(module, mesh=ctx.data_mesh)
        return module
    if zero_stage == 0:
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, experts)
        return DistributedDataParallel(
            module,
            process_group=group,
            gradient_as_bucket_view=True,
            device_ids=None if ctx.device.type == "cpu" else [ctx.device],
        )
    if zero_stage == 3:
        dp_mesh = ctx.data_mesh
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
        for unit in units:
            fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
        fully_shard(module, mesh=dp_mesh, mp_policy=policy)
        return module
    raise RuntimeSetupError(
        f"ZeRO stage {zero_stage} is modelled but not executable yet",
        where="plan.training.zero",
        fix="re-plan with zero=(0, 3)",
    )
