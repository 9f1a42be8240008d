"""Run a pipelined program with ``torch.distributed.pipelining``.

The pipeline-split pass made one module per chunk of layers; this rank keeps the chunks the
plan gives its pipeline index, wraps each for data parallelism, makes a ``PipelineStage``
of it and runs the plan's schedule (GPipe, 1F1B, interleaved 1F1B, ZB-V zero bubble). The
schedule splits the batch into the plan's microbatches; their summed gradients are scaled by
their number, so they are those of the whole batch. Weights that chunks on several ranks read (a
tied embedding and output head) have their gradients summed over those ranks after each
step, as Megatron does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    reverse_closure,
)
from torch.distributed.tensor import DTensor

from autopar.core.errors import RuntimeSetupError
from autopar.core.plan import Plan
from autopar.ops.comm_ops import all_reduce_in_place
from autopar.runtime.mesh import MeshContext

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb_v": ScheduleZBVZeroBubble,
}
MULTI_CHUNK = ("interleaved", "zb_v")


def _loss_of(outputs: Any, target: Any) -> torch.Tensor:
    """The scalar among the last stage's outputs (the model's loss, already computed in the
    graph: ``target`` is only there because the schedules pass it)."""
    values = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            return value
    raise RuntimeSetupError(
        "the last pipeline stage returns no scalar loss",
        where="pipeline loss",
        fix="make the model return its loss (a scalar tensor) among its outputs",
    )


class _Stage(PipelineStage):
    """``PipelineStage`` whose shape-inference inputs are zeros, and whose input gradients
    are sent contiguous.

    On its first step a stage learns its input shapes by running its forward on tensors
    made from the previous stage's metadata, which ``torch.distributed.pipelining`` leaves
    uninitialized (``torch.empty``). Integer inputs carried between stages (the targets of
    the loss, token ids, an attention mask) then hold garbage, and the loss or an embedding
    fails with "index out of bounds". Integer inputs are made ones (valid ids, a mask
    whose count less one is still an index: a last-token pick) and floating ones zeros, so
    inference runs; the real step is unchanged.

    The gradient of an input that the stage only reads through a view (a transpose) comes
    out of autograd with that view's strides; gloo sends only contiguous tensors, and the
    previous stage receives into a contiguous buffer (its outputs are made contiguous by
    the pipeline-split pass).
    """

    _split_loses_weights: bool | None = None  # decided on the first split backward

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> tuple:
        """Zero-bubble schedules split a stage's backward into input gradients, then weight
        gradients from the autograd nodes where the weights' paths meet the inputs'.
        ``torch.distributed.pipelining`` follows only the paths where a weight meets a
        stage input that needs a gradient: a weight that reaches the stage's outputs another
        way (a decoder's embedding of integer inputs, a relative-position bias the stage also
        sends on) would lose that part of its gradient. Such a stage runs its full backward
        at the input step instead (correct, with less overlap); its weight step then has
        nothing left to do."""
        if backward_type == "input":
            if self._split_loses_weights is None:
                self._split_loses_weights = _split_loses_weights(self.submod, bwd_kwargs)
            if self._split_loses_weights:
                return super().backward_maybe_with_nosync("full", bwd_kwargs, last_backward)
        if backward_type == "weight" and bwd_kwargs["param_groups"] is None:
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        grads = self.bwd_cache.get(bwd_chunk_id)
        if grads is not None:
            self.bwd_cache[bwd_chunk_id] = tuple(
                g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return super().get_bwd_send_ops(bwd_chunk_id)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        """Receive buffers for output gradients, contiguous: torch takes their layout from
        the next stage's input gradients, which keep the strides of the view autograd
        computed them through (a transposed activation), and gloo receives only into
        contiguous tensors (the next stage sends them contiguous)."""
        infos = super()._create_grad_recv_info(act_send_info)
        for info in infos:
            if info.buffer is not None and not info.buffer.is_contiguous():
                info.buffer = torch.empty(info.buffer.shape, dtype=info.buffer.dtype,
                                          device=info.buffer.device)
        return infos

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                tensor.fill_(0 if tensor.is_floating_point() else 1)
        return tensor


def _split_loses_weights(module: nn.Module, bwd_kwargs: dict) -> bool:
    """Whether some weight reaches this stage's outputs by a path that meets no stage input
    needing a gradient: ``stage_backward_weight`` starts from the autograd nodes where the
    weights' paths meet the inputs', so that part of its gradient would be lost."""
    outputs = [t for t in bwd_kwargs["stage_output"]
               if isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None)]
    roots = {_get_grad_fn_or_grad_acc(t) for t in outputs} - {None}
    graph = construct_reverse_graph(list(roots))
    inputs = [_get_grad_fn_or_grad_acc(t) for t in bwd_kwargs["input_values"]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    from_inputs, _ = reverse_closure(inputs, set(), graph)
    for weight in module.parameters():
        fn = _get_grad_fn_or_grad_acc(weight) if weight.requires_grad else None
        if fn in graph and reverse_closure([fn], from_inputs, graph)[0] & roots:
            return True
    return False


def chunk_ranks(plan: Plan, chunks: int) -> list[int]:
    """Pipeline rank of each chunk, as the plan placed them."""
    entries = plan.pipeline.get("chunks") or []
    if len(entries) != chunks:
        raise RuntimeSetupError(
            f"the plan lists {len(entries)} pipeline chunks but the program has {chunks}",
            where="plan.pipeline.chunks",
            fix="re-plan with this autopar (autopar plan ... --json FILE)",
        )
    return [int(e["rank"]) for e in entries]


class PipelineRunner:
    """This rank's stages and the schedule that drives them."""

    def __init__(self, program: fx.GraphModule, plan: Plan, ctx: MeshContext,
                 wrap: Callable[[nn.Module, list[nn.Module]], nn.Module]):
        info = program.meta["autopar_pipeline"]
        self.chunks, self.pp = info["chunks"], info["pp"]
        self.input_names: list[str] = info["outputs"]["inputs"]
        self.ctx = ctx
        ranks = chunk_ranks(plan, self.chunks)
        my_rank = ctx.coords["pp"]
        self.mine = [c for c in range(self.chunks) if ranks[c] == my_rank]
        schedule = plan.pipeline.get("schedule", "1f1b")
        if schedule not in SCHEDULES:
            raise RuntimeSetupError(f"unknown pipeline schedule {schedule!r}",
                                    where="plan.pipeline.schedule",
                                    fix=f"use one of {', '.join(SCHEDULES)}")
        if (schedule in MULTI_CHUNK) != (len(self.mine) > 1):
            raise RuntimeSetupError(
                f"schedule {schedule!r} with {len(self.mine)} chunk(s) on pipeline rank {my_rank}",
                where="plan.pipeline",
                fix="interleaved and zb_v run several chunks per rank; gpipe and 1f1b one",
            )
        self._tied = _tied_groups(program, ranks, ctx)
        group = ctx.group("pp")
        self.modules: list[nn.Module] = []
        self._stage_modules: dict[int, nn.Module] = {}
        stages = []
        for c in self.mine:
            module = program.get_submodule(f"stage_{c}")
            self._stage_modules[c] = module
            units = [module.get_submodule(p) for p in info["layers"][c] if _has(module, p)]
            wrapped = wrap(module, units)
            self.modules.append(wrapped)
            stages.append(_Stage(wrapped, c, self.chunks, ctx.device, group=group))
        for c in range(self.chunks):  # other ranks' chunks: their weights are not ours
            if c not in self.mine:
                delattr(program, f"stage_{c}")
        m = int(plan.batch.get("microbatches", 1))
        cls = SCHEDULES[schedule]
        # The schedules sum the microbatches' gradients; scaling them by 1/m here, once per
        # parameter, and not per stage (scale_grads=True), keeps a weight that two chunks of
        # this rank share (a tied embedding and head under ZB-V) from being scaled twice.
        self.schedule = cls(stages if schedule in MULTI_CHUNK else stages[0], m,
                            loss_fn=self._scaled_loss, scale_grads=False)
        self.microbatches = m
        unique = {id(p): p for module in self.modules for p in module.parameters()}
        self._params = list(unique.values())
        self.holds_first = 0 in self.mine
        self.last_rank = ranks[-1]
        self.recorder_of: Callable[[], Any] = lambda: None  # set by ParallelModule
        # fp16 loss scaling: what the last stage multiplies each microbatch's loss by before
        # backward (set by ParallelModule every step; the reported loss is unscaled)
        self.loss_multiplier = 1.0

    def _scaled_loss(self, outputs: Any, target: Any) -> torch.Tensor:
        loss = _loss_of(outputs, target)
        return loss * self.loss_multiplier if self.loss_multiplier != 1.0 else loss

    def step(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Forward and backward over the microbatches; the mean loss, on every pp rank."""
        args = [inputs[name] for name in self.input_names]
        target = next((a for a in args if isinstance(a, torch.Tensor)), None)
        losses: list[torch.Tensor] = []
        if self.holds_first:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        for p in self._params:
            if p.grad is not None:
                p.grad.div_(self.microbatches)
        self._sum_tied_grads()
        # Every rank must broadcast the same dtype, and only the last knows the loss's: use
        # the default dtype, as train_step does without pipelines (a bf16 loss broadcast into
        # a float32 buffer arrives as garbage).
        dtype = torch.get_default_dtype()
        if losses:
            loss = torch.stack([x.detach().reshape(()).to(dtype) for x in losses]).mean()
            loss /= self.loss_multiplier
        else:
            loss = torch.zeros((), dtype=dtype, device=self.ctx.device)
        group = self.ctx.group("pp")
        if group is not None:  # the last stage's loss, everywhere
            start = time.perf_counter()
            dist.broadcast(loss, src=dist.get_global_rank(group, self.last_rank), group=group)
            recorder = self.recorder_of()
            if recorder is not None:
                recorder.collective("broadcast", loss.numel() * loss.element_size(),
                                    group.size(), time.perf_counter() - start, "loss")
        return loss

    def _sum_tied_grads(self) -> None:
        for named, group in self._tied:
            params = [self._stage_modules[c].get_parameter(name) for c, name in named]
            for p in params:  # every holder joins the sum, even one its chunks left at None
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # FSDP2 keeps gradients as DTensors; both holders shard them alike over dp
            all_reduce_in_place([_local(p.grad) for p in params], group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _tied_groups(program: fx.GraphModule, ranks: list[int], ctx: MeshContext
                 ) -> list[tuple[list[tuple[int, str]], dist.ProcessGroup]]:
    """Weights read by chunks on different pipeline ranks: for each set of ranks holding
    some, a group of them (same data- and tensor-parallel coordinates) and this rank's
    (chunk, parameter name) pairs. Names, not tensors: data parallelism may replace the
    parameters when it wraps a stage. Ties across all pipeline ranks use the pp group, ties
    of the first and last rank (embedding and head) the group ``build_mesh`` made on every
    launched rank. Only other sets get a group made here, and only when every launched rank
    runs the plan: idle ranks never get here, and a group made without them would name the
    next plan's groups apart (see ``mesh.pipeline_ends_group``)."""
    owners: dict[int, set[int]] = {}
    names: dict[int, list[tuple[int, str]]] = {}
    for c in range(len(ranks)):
        for name, p in program.get_submodule(f"stage_{c}").named_parameters():
            owners.setdefault(id(p), set()).add(ranks[c])
            names.setdefault(id(p), []).append((c, name))
    tied = {pid: tuple(sorted(r)) for pid, r in owners.items() if len(r) > 1}
    if not tied or ctx.mesh is None:
        return []
    grid = ctx.mesh.mesh  # (pp, ...) rank grid
    flat = grid.reshape(grid.shape[0], -1)
    me = dist.get_rank()
    my_pp = ctx.coords["pp"]
    out = []
    pp = grid.shape[0]
    for pp_ranks in sorted(set(tied.values())):
        if pp_ranks == tuple(range(pp)):
            shared = ctx.group("pp")
        elif pp_ranks == (0, pp - 1) and ctx.pipeline_ends is not None:
            shared = ctx.pipeline_ends
        else:
            shared = None
            if dist.get_world_size() != grid.numel():
                raise RuntimeSetupError(
                    f"weights are tied across pipeline ranks {list(pp_ranks)} of {pp}, and "
                    "this plan leaves launched ranks idle, which cannot join a group for them",
                    where="plan.explanation.devices",
                    fix="launch exactly the plan's devices (torchrun --nproc-per-node "
                    f"{grid.numel()}), or re-plan with devices= the whole cluster")
        for column in range(flat.shape[1]):
            members = [int(flat[q, column]) for q in pp_ranks]
            # every active rank makes every such group, in the same order (see above)
            group = shared if shared is not None else dist.new_group(members)
            if me in members:
                mine = [next((c, n) for c, n in names[pid] if ranks[c] == my_pp)
                        for pid, r in tied.items() if r == pp_ranks]
                out.append((mine, group))
    return out
