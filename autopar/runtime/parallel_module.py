"""What ``autopar.parallelize`` returns: this rank's program, ready for an optimizer loop."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch import nn
from torch.distributed.fsdp import FSDPModule

from autopar.analysis import step_statistics
from autopar.core.errors import RuntimeSetupError
from autopar.core.placements import Shard, parse_placement
from autopar.core.plan import Plan
from autopar.ops import comm_ops
from autopar.ops.step_copies import one_weight_copy_per_step
from autopar.runtime.experts import expert_parameters, reduce_expert_grads
from autopar.runtime.grad_clip import clip_grad_norm_
from autopar.runtime.loss_scale import DynamicLossScaler, LossScaleConfig
from autopar.runtime.mesh import MeshContext
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.record import RunRecorder, ddp_timing_hook


def find_loss(outputs: Any) -> torch.Tensor:
    """The scalar loss in a model's outputs: a scalar tensor, ``.loss``, or the first scalar
    tensor of a tuple/list/dict."""
    if isinstance(outputs, torch.Tensor) and outputs.ndim == 0:
        return outputs
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    items = outputs.values() if isinstance(outputs, Mapping) else outputs
    if isinstance(items, (tuple, list)) or isinstance(outputs, Mapping):
        for item in items:
            if isinstance(item, torch.Tensor) and item.ndim == 0:
                return item
    raise TypeError(
        f"cannot find a scalar loss in the model's outputs ({type(outputs).__name__}); "
        "return the loss as a scalar tensor, in a tuple, or as .loss"
    )


class ParallelModule(nn.Module):
    """This rank's part of the model.

    ``module(*local_inputs)`` runs the per-rank program on this rank's share of the batch;
    ``shard_batch(*global_inputs)`` cuts that share out of a global batch; ``train_step``
    runs forward and backward over the plan's microbatches and returns the global loss.
    Gradients land on this rank's (local) parameters for an ordinary ``optimizer.step()``.

    An fp16 plan scales the loss dynamically (``torch.amp.GradScaler``'s rule, on every rank
    at once): ``train_step`` backpropagates the scaled loss, unscales the gradients and
    checks every rank's for inf/nan with one all-reduce. On overflow every rank drops its
    gradients (``p.grad = None``, so a torch optimizer's ``step()`` changes nothing), halves
    the scale and counts the skip (``skipped_steps``, ``last_step_skipped``);
    :meth:`step` does not even call the optimizer then. The scale grows after
    ``growth_interval`` clean steps (``loss_scale``, the current scale).
    """

    def __init__(self, program: fx.GraphModule, wrapped: nn.Module, plan: Plan,
                 ctx: MeshContext, pipeline: PipelineRunner | None = None,
                 loss_scale: LossScaleConfig | None = None):
        super().__init__()
        self.wrapped = wrapped
        self.plan = plan
        self.mesh_context = ctx
        self._program = program  # the per-rank fx program (printable with .code)
        self._pipeline = pipeline
        self._input_shards = self._input_splits(program, "dp")
        self._token_dims = self._input_splits(program, "cp")
        self._recorder: RunRecorder | None = None
        self._ddp_hooked = False
        if pipeline is not None:
            pipeline.recorder_of = lambda: self._recorder
        self._scaler = scaler_for(plan, loss_scale)
        # batch statistics of the inputs, taken over the whole step before it runs
        self._statistics: step_statistics.StepStatistics | None = program.meta.get(
            step_statistics.META)
        # FSDP2 reduces expert gradients itself under ZeRO-3 (over edp, divided by dp)
        self._experts = expert_parameters(program) if plan.training.get("zero", 0) != 3 else []
        # saved-tensor hooks cost every saved tensor a Python call: only where needed
        self._gathers = any(node.target is comm_ops.gather_scatter_grad
                            for gm in program.modules() if isinstance(gm, fx.GraphModule)
                            for node in gm.graph.nodes)

    # --- fp16 loss scaling ---------------------------------------------------------------
    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless the plan computes in fp16)."""
        return self._scaler.scale if self._scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because some rank's gradients overflowed."""
        return self._scaler.skipped_steps if self._scaler is not None else 0

    @property
    def last_step_skipped(self) -> bool:
        return self._scaler.last_step_skipped if self._scaler is not None else False

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless the last ``train_step`` overflowed; whether it ran."""
        if self.last_step_skipped:
            return False
        optimizer.step()
        return True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients ``train_step`` left by the norm of the whole model's gradient
        (every shard, stage and replica counted once, as on one device); the norm before
        clipping. ``torch.nn.utils.clip_grad_norm_(pm.parameters())`` would take only this
        rank's share. Every launched rank calls it (:mod:`autopar.runtime.grad_clip`)."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def _after_backward(self) -> None:
        """Unscale, agree on overflow over every rank, drop the gradients if so, update."""
        scaler = self._scaler
        found = scaler.unscale_and_check(self.parameters())
        if found:
            for p in self.parameters():
                p.grad = None
        scaler.update(found)

    def record_run(self, directory: str | os.PathLike[str]) -> RunRecorder:
        """Record this rank's training steps and collectives until the returned recorder is
        closed (or its ``with`` block ends), then write ``directory/rank{r}.json`` for
        ``autopar calibrate --from-run DIRECTORY``. Start it before the first
        ``train_step`` (DDP takes its timing hook only then)."""
        if self._recorder is not None:
            raise RuntimeSetupError(
                "this module is already recording a run",
                where="ParallelModule.record_run",
                fix="close the first recorder (or leave its with-block) before starting another")
        recorder = RunRecorder(self, directory)
        if hasattr(self.wrapped, "register_comm_hook") and not self._ddp_hooked:
            try:
                # DDP's own group as the hook's state: on a plan using part of the launched
                # ranks it is a sub-group, and WORLD would wait for the idle ranks forever
                self.wrapped.register_comm_hook(self.wrapped.process_group,
                                                ddp_timing_hook(lambda: self._recorder))
            except RuntimeError as err:
                raise RuntimeSetupError(
                    f"cannot time DDP's gradient all-reduces: {err}",
                    where="ParallelModule.record_run",
                    fix="call record_run before the first train_step") from None
            self._ddp_hooked = True
        if self._ddp_hooked:
            recorder.timed.append("ddp")
        self._recorder = recorder.start()
        return recorder

    @property
    def code(self) -> str:
        """The per-rank program as Python source (with pipeline stages: the root, which
        calls every chunk in order, then this rank's chunks)."""
        return rank_code(self._program, self.plan, self.mesh_context.coords)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise RuntimeSetupError(
                "a pipelined model runs whole training steps, not single forward calls",
                where="ParallelModule.forward",
                fix="call train_step(*inputs) (forward and backward over the microbatches)",
            )
        with comm_ops.keep_gathered_as_shards() if self._gathers else _null():
            return self.wrapped(*args, **kwargs)

    def _input_splits(self, program: fx.GraphModule, axis: str) -> dict[int, int]:
        """Placeholder position -> the dim the plan splits it along on ``axis`` (dp: the
        batch; cp: its tokens); inputs left whole are absent."""
        out = {}
        placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            entry = self.plan.strategies.get(node.name, {}).get(axis)
            if entry and entry["out"] and entry["out"][0].startswith("S("):
                out[i] = parse_placement(entry["out"][0]).dim
        return out

    def shard_batch(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """This rank's slice of a global batch: inputs the plan splits over ``dp`` are cut
        along dim 0, and over ``cp`` along their token dim (zigzag chunk pairs when the
        plan's layout is zigzag); everything else passes through. Returns ``(args, kwargs)``."""
        dp = self.plan.mesh.get("dp", 1)
        rank = self.mesh_context.coords.get("dp", 0)
        cp = self.plan.mesh.get("cp", 1)
        cp_rank = self.mesh_context.coords.get("cp", 0)
        zigzag = self.plan.context.get("layout") == "zigzag"
        flat_inputs = list(args) + list(kwargs.values())
        sharded = [i in self._input_shards for i in range(len(flat_inputs))]
        tokens = [self._token_dims.get(i) for i in range(len(flat_inputs))]

        def cut(value: Any, split: bool, token_dim: int | None) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if split and dp > 1:
                value = value.chunk(dp, 0)[rank]
            if token_dim is not None and cp > 1:
                value = comm_ops.local_slice(value, Shard(token_dim), cp, cp_rank, zigzag)
            return value.to(self.mesh_context.device)

        n = len(args)
        new_args = tuple(cut(a, s, t) for a, s, t in zip(args, sharded[:n], tokens[:n]))
        new_kwargs = {k: cut(v, s, t) for (k, v), s, t in zip(kwargs.items(), sharded[n:],
                                                             tokens[n:])}
        return new_args, new_kwargs

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward over this rank's local batch, split into the plan's
        microbatches (pipelined or not); returns the loss averaged over all data-parallel
        ranks, on every rank."""
        # FSDP2 moves gradients into its shards during backward, so weights' tp partial sums
        # must happen there; with DDP (or none) they wait for one bucketed all-reduce.
        # (Pipeline stages use FSDP2 for data parallelism, so they sum them in backward.)
        recorder = self._recorder
        if recorder is not None:
            recorder.step_begin()
        try:
            # only the loss leaves a training step: the other outputs stay local
            reads = self.plan.batch.get("microbatches", 1)  # each weight's forwards a step
            with one_weight_copy_per_step(reads), comm_ops.outputs_unused():
                loss = self._train_step(args, kwargs)
            if self._scaler is not None:
                self._after_backward()
            return loss
        finally:
            if recorder is not None:
                recorder.step_end()

    def _step_values(self, chunks: list[tuple[tuple, dict]]) -> dict | None:
        """The step's batch statistics of the inputs, from every microbatch (``chunks``)."""
        if self._statistics is None:
            return None
        return self._statistics.evaluate([list(self._named_inputs(a, k).values())
                                          for a, k in chunks])

    def _train_step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        m = self.plan.batch.get("microbatches", 1)
        chunks = _split_microbatches(args, kwargs, m)
        with step_statistics.training_step(self._step_values(chunks), m):
            return self._run_microbatches(args, kwargs, chunks)

    def _run_microbatches(self, args: tuple, kwargs: dict,
                          chunks: list[tuple[tuple, dict]]) -> torch.Tensor:
        if self._pipeline is not None:
            if self._scaler is not None:
                self._pipeline.loss_multiplier = self._scaler.scale
            loss = self._pipeline.step(self._named_inputs(args, kwargs))
            for stage in self._pipeline.modules:  # names absent from a stage are skipped
                reduce_expert_grads(stage, self._experts, self.plan)
            return self._mean_over_dp(loss)
        zero = self.plan.training.get("zero", 0)
        hsdp = self.plan.training.get("dp_replicate", 1) > 1
        defer = zero == 0
        total = torch.zeros((), device=self.mesh_context.device)
        with comm_ops.deferred_weight_grads() if defer else _null():
            for i, (a, k) in enumerate(chunks):
                sync = i == len(chunks) - 1
                if zero in (1, 2) and isinstance(self.wrapped, FSDPModule):
                    # whole weights across the microbatches; stage 1 also whole gradients
                    self.wrapped.set_reshard_after_backward(sync)
                    if zero == 1:
                        self.wrapped.set_requires_gradient_sync(sync)
                if hsdp and isinstance(self.wrapped, FSDPModule):
                    # HSDP: shards all-reduced across the replica groups once per step
                    self.wrapped.set_requires_all_reduce(sync)
                no_sync = not sync and hasattr(self.wrapped, "no_sync")
                with self.wrapped.no_sync() if no_sync else _null():
                    loss = find_loss(self(*a, **k)) / len(chunks)
                    total += loss.detach()
                    if sync:  # the step's loss is known: average it while backward runs
                        mean = _LossMean(total, self.mesh_context.data_group())
                    scaled = self._scaler.scale_loss(loss) if self._scaler is not None else loss
                    scaled.backward()
        reduce_expert_grads(self._program, self._experts, self.plan)
        return mean.wait()

    def _mean_over_dp(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the data-parallel ranks (a blocking all-reduce)."""
        group = self.mesh_context.data_group()  # dp x cp: each holds its tokens' mean
        if group is not None:
            start = time.perf_counter()
            dist.all_reduce(loss, group=group)
            if self._recorder is not None:
                self._recorder.collective("all_reduce", loss.numel() * loss.element_size(),
                                          dist.get_world_size(group),
                                          time.perf_counter() - start, "loss")
            loss /= dist.get_world_size(group)
        return loss

    def _named_inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The program's inputs by placeholder name, flattened as the traced call was."""
        placeholders = [n.name for n in self._program.graph.nodes if n.op == "placeholder"]
        info = getattr(self._program.graph._codegen, "pytree_info", None)
        if info is not None and info.in_spec is not None:
            leaves = fx_pytree.tree_flatten_spec((args, kwargs), info.in_spec)
        else:
            leaves = [*args, *kwargs.values()]
        if len(leaves) != len(placeholders):
            raise RuntimeSetupError(
                f"train_step got {len(leaves)} inputs, the traced model takes "
                f"{len(placeholders)} ({', '.join(placeholders)})",
                where="ParallelModule.train_step",
                fix="pass the inputs the model was traced with (shard_batch's output)",
            )
        return {name: v.to(self.mesh_context.device) if isinstance(v, torch.Tensor) else v
                for name, v in zip(placeholders, leaves)}

    def local_placement(self, fqn: str, axis: str = "tp") -> Shard | None:
        """How parameter ``fqn`` is split on ``axis`` (None when whole)."""
        p = self.plan.param_placement(fqn, axis)
        return p if isinstance(p, Shard) else None


def scaler_for(plan: Plan, config: LossScaleConfig | None) -> DynamicLossScaler | None:
    """A dynamic loss scaler for an fp16 plan (None otherwise; ``config`` then must be None)."""
    if plan.training.get("precision") != "fp16":
        if config is not None:
            raise RuntimeSetupError(
                f"loss_scale was given, but the plan computes in "
                f"{plan.training.get('precision')}, which needs no loss scaling",
                where="autopar.parallelize(loss_scale=...)",
                fix="drop loss_scale, or plan with precision='fp16'")
        return None
    return DynamicLossScaler(config or LossScaleConfig())


class _LossMean:
    """The step's loss averaged over the data-parallel ranks, all-reduced asynchronously from
    the end of the last microbatch's forward: the scalar's latency (two of gloo's ~1 ms hops
    on a busy CPU) hides behind the backward instead of ending the step; autopar's dp=2 step
    on the demo GPT ran 9 ms over plain DDP's with it blocking, 0.2 ms without (measured,
    ``benchmarks/cpu_step_parts.py``). Collectives on one group keep their order on every
    rank (this one before the backward's gradient buckets), as torch.distributed requires.
    Not recorded as a collective: the plan prices it as hidden (``loss_for_caller_s``)."""

    def __init__(self, total: torch.Tensor, group: dist.ProcessGroup | None):
        self.total, self.group = total, group
        self.work = dist.all_reduce(total, group=group, async_op=True) if group else None

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return self.total
        self.work.wait()
        return self.total / dist.get_world_size(self.group)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _split_microbatches(args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
    if m <= 1:
        return [(args, kwargs)]

    def part(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] % m == 0:
            return value.chunk(m, 0)[i]
        return value

    return [
        (tuple(part(a, i) for a in args), {k: part(v, i) for k, v in kwargs.items()})
        for i in range(m)
    ]


def rank_code(program: fx.GraphModule, plan: Plan, coords: dict[str, int]) -> str:
    """This rank's program as Python: the root, then every module it calls (outlined
    layers, pipeline chunks) once — identical layers are printed once and named after."""
    roots: list[tuple[str, fx.GraphModule]] = [("root", program)]
    if plan.mesh.get("pp", 1) > 1:
        mine = [e["chunk"] for e in plan.pipeline["chunks"] if e["rank"] == coords["pp"]]
        roots[0] = (f"root: runs the chunks in order (schedule {plan.pipeline['schedule']}, "
                    f"{plan.pipeline['microbatches']} microbatches); this rank runs "
                    f"{', '.join(f'stage_{c}' for c in mine)}", program)
        roots += [(f"stage_{c}", program.get_submodule(f"stage_{c}")) for c in mine]
    parts: list[str] = []
    seen: dict[str, str] = {}
    for label, root in roots:
        parts.append(f"# {label}\n{root.code.strip()}\n")
        for node in root.graph.nodes:
            if node.op != "call_module" or (root is program and len(roots) > 1):
                continue  # a pipelined root calls the chunks, printed after it
            sub = root.get_submodule(node.target)
            if not isinstance(sub, fx.GraphModule):
                continue
            name = node.target if root is program else f"{label}.{node.target}"
            code = sub.code.strip()
            if code in seen:
                parts.append(f"# {name}: same code as {seen[code]}\n")
            else:
                seen[code] = name
                parts.append(f"# {name}\n{code}\n")
    return "\n".join(parts)
