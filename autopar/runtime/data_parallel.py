"""Data parallelism through the real engines: DDP for ZeRO-0, FSDP2 for ZeRO-1, 2 and 3.

ZeRO-1 and 2 are FSDP2 with ``reshard_after_forward=False``: each step gathers the weights
once and keeps them whole through forward and backward (stages 1 and 2 keep whole weights),
the optimizer steps only this rank's shard of every weight (its states are sharded), and
the updated shards are gathered again at the next step's forward (ZeRO's all-gather after
the step). Stage 2 reduce-scatters every microbatch's gradients and keeps only their
shards; stage 1 accumulates whole gradients over the microbatches and reduce-scatters
once, at the last (``ParallelModule`` sets FSDP2's ``set_requires_gradient_sync``). torch's
``ZeroRedundancyOptimizer`` would also give stage 1, but it must replace the user's
optimizer; FSDP2 shards the states of whatever optimizer the user builds on
``pm.parameters()``.

HSDP is FSDP2 on a 2-D mesh (``MeshContext.shard_mesh``): it shards over the inner dim and
all-reduces the gradient shards over the outer one; with several microbatches the
all-reduce runs at the last one only (``ParallelModule``, ``set_requires_all_reduce``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from autopar.core.errors import RuntimeSetupError
from autopar.runtime.mesh import MeshContext


def wrap_data_parallel(
    module: nn.Module, ctx: MeshContext, zero_stage: int, units: list[nn.Module],
    pipelined: bool = False, param_dtype: torch.dtype = torch.float32,
    experts: list[str] | None = None, expert_units: list[nn.Module] | None = None,
    offload: str = "none",
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
    them to :func:`autopar.runtime.experts.reduce_expert_grads`. Under ZeRO-3 FSDP2 shards
    them, as ``expert_units`` (the modules ``outline-experts`` made), over the ranks holding
    the same experts, and divides their summed gradients by the whole data-parallel degree
    as every other gradient is (torchtitan shards its experts the same way).
    """
    group = ctx.data_group()
    if group is None or group.size() == 1:
        return module
    if experts and zero_stage not in (0, 3):
        raise RuntimeSetupError(
            f"expert parallelism runs with ZeRO-0 or 3, not {zero_stage}",
            where="plan.mesh.ep", fix="re-plan with zero=0 or 3, or ep=1")
    if zero_stage == 0 and pipelined:
        params = dict(module.named_parameters())
        replicate(module, mesh=ctx.data_mesh,
                  ignored_params={params[n] for n in experts or []} or None)
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
    if zero_stage in (1, 2, 3):
        dp_mesh = ctx.shard_mesh or ctx.data_mesh  # 2-D under HSDP: FSDP2 replicates over dim 0
        reshard = zero_stage == 3  # stages 1, 2: weights stay whole through the step
        extra = {}
        if offload != "none":  # shards, gradients and optimizer states in host memory
            extra["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
        if experts and not expert_units:
            raise RuntimeSetupError(
                "ZeRO-3 with expert parallelism needs the experts outlined as modules",
                where="plan.training.zero", fix="re-plan with zero=0, or ep=1")
        for unit in expert_units or []:
            fully_shard(unit, mesh=ctx.expert_data_mesh, mp_policy=policy)
            unit.set_gradient_divide_factor(float(group.size()))
            # gloo has no PREMUL_SUM: sum, then divide. (Not on one rank, where FSDP2 copies
            # the gradient divided by the factor and would then divide it again.)
            if dist.get_backend(group) == "gloo" and ctx.expert_data_mesh.size() > 1:
                unit.set_force_sum_reduction_for_comms(True)
        for unit in units:
            fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard,
                        **extra)
        fully_shard(module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard,
                    **extra)
        if expert_units:
            _prefetch_layers_only(units, expert_units)
        return module
    raise RuntimeSetupError(
        f"ZeRO stage {zero_stage} does not exist", where="plan.training.zero",
        fix="re-plan with zero 0, 1, 2 or 3")


def _prefetch_layers_only(units: list[nn.Module], expert_units: list[nn.Module]) -> None:
    """In backward each layer prefetches the previous layer's weights (over dp), and an
    expert module prefetches nothing. FSDP2's default prefetches the module before in
    forward order, which for a layer's first expert is the previous layer: a dp all-gather
    issued where that expert's backward runs. Ranks of one ep group hold different experts
    (a list of expert modules runs them at different places), so they would issue it
    between different all-to-alls, and wait on each other forever. (An empty list means
    FSDP2's default; a module's prefetch of itself is a no-op.)"""
    for unit in expert_units:
        unit.set_modules_to_backward_prefetch([unit])
    for before, unit in zip(units, units[1:]):
        unit.set_modules_to_backward_prefetch([before])
