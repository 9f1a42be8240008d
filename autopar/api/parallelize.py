"""``autopar.parallelize``: plan (or take a plan), rewrite the graph for this rank, wrap it.

Launched by torchrun, every rank traces the same model; rank 0 plans and sends the plan's
JSON to the others (as bytes: plans are data), so every rank runs the same plan. When
planning fails on rank 0 it sends the error instead (its class name, what, where and fix,
as JSON), so every rank raises the same error rather than waiting forever.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.analysis.attention_sites import find_attention_sites
from autopar.analysis.precision import TORCH_DTYPES
from autopar.api.planning import PLAN_KEYWORDS
from autopar.api.planning import plan as make_plan
from autopar.core import errors
from autopar.core.cluster import Cluster, load_cluster
from autopar.core.errors import AutoparError, RuntimeSetupError
from autopar.core.graph_facts import graph_facts
from autopar.core.knobs import check_keywords
from autopar.core.placements import Shard
from autopar.core.plan import Plan
from autopar.passes import PassContext, PassManager
from autopar.passes.program import program_for
from autopar.runtime.compiled import compile_modules, compiles
from autopar.runtime.data_parallel import wrap_data_parallel
from autopar.runtime.experts import expert_parameters
from autopar.runtime.idle import IdleRank, PartOfWorld
from autopar.runtime.loss_scale import LossScaleConfig
from autopar.runtime.mesh import build_mesh, check_world_size, ensure_process_group
from autopar.runtime.parallel_module import ParallelModule, scaler_for
from autopar.runtime.pipeline import PipelineRunner
from autopar.trace import trace
from autopar.trace.align import align_to, describe, rename_like, restore_batch_constants
from autopar.trace.inputs import microbatch_inputs


def parallelize(
    model: nn.Module,
    cluster: Cluster | str | Path,
    example_inputs: Any,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    plan: Plan | str | Path | None = None,
    record_run: str | Path | None = None,
    loss_scale: LossScaleConfig | None = None,
    passes: Sequence[Any] = (),
    disable_passes: Sequence[str] = (),
    **plan_options: Any,
) -> ParallelModule | IdleRank:
    """This rank's part of ``model``, planned for ``cluster`` and ready to train.

    ``example_inputs`` is one *global* batch (every rank passes the same); the plan splits
    it. ``dp``/``tp``/``pp`` pin mesh degrees; ``plan`` (a Plan or a JSON file) skips
    planning. Other keywords go to :func:`autopar.plan` (``precision``, ``microbatch``,
    ``microbatches``, ``schedule``, ``virtual_stages``, ``zero``, ``devices``, ...).

    Launch one process per device of the cluster. A plan may use fewer devices (when that is
    predicted faster; ``plan.explanation["devices"]``): ranks 0 .. ``plan.world_size - 1``
    run it, and every other rank gets an :class:`~autopar.runtime.idle.IdleRank`, which
    trains nothing and whose ``train_step`` returns the same loss. A plan on fewer devices
    may also be launched on just those (``plan=`` the plan's file).

    ``loss_scale`` tunes fp16's dynamic loss scaling (``LossScaleConfig``: initial scale,
    growth and backoff factors, growth interval; ``torch.amp.GradScaler``'s defaults).

    ``passes`` adds graph passes to every rank's program for this call (``GraphPass``
    instances, or names of registered or plugin passes), placed by their ``runs_after`` /
    ``runs_before``; installed plugin passes (entry points, :mod:`autopar.core.plugins`) always
    join. ``disable_passes`` removes plugin passes or optional built-ins by name.

    ``record_run`` (a directory) records every training step's time and collectives there
    (``ParallelModule.record_run``), for ``autopar calibrate --from-run DIR`` to refit this
    machine's profile from.
    """
    plan_options = check_keywords(
        plan_options, [k for k in PLAN_KEYWORDS if k not in ("dp", "tp", "pp")],
        "autopar.parallelize")
    cluster = load_cluster(cluster)
    ensure_process_group(cluster.backend)
    if plan is None:
        check_world_size(cluster.world_size, f"the cluster {cluster.name!r}")
    else:
        pinned = {**{k: v for k, v in (("dp", dp), ("tp", tp), ("pp", pp)) if v is not None},
                  **plan_options}
        if pinned:  # silently ignored otherwise: the plan fixes every choice
            raise AutoparError(
                f"autopar.parallelize() got a plan and planning keywords ({', '.join(pinned)})",
                where=f"autopar.parallelize({next(iter(pinned))}=...)",
                fix="drop them (the plan fixes every choice), or re-plan with them and pass "
                "that plan")
        # A Plan object is checked like a file: it may have been edited since it was made.
        plan = Plan.from_dict(plan.to_dict()) if isinstance(plan, Plan) else Plan.load(plan)
        plan.check_cluster(cluster)
        if _launched() != plan.world_size:  # a plan on fewer devices may run on just those
            check_world_size(cluster.world_size, f"the cluster {cluster.name!r}")
    # op costs only where a plan is made (rank 0); the others only run the graph
    planning_here = plan is None and (not dist.is_initialized() or dist.get_rank() == 0)
    gm = trace(model, example_inputs, agree=same_graph_as_rank0, costs=planning_here)
    if plan is None:
        plan = _plan_on_rank0(gm, cluster, dp=dp, tp=tp, pp=pp, model_name=type(model).__name__,
                              **plan_options)
    scaler_for(plan, loss_scale)  # a loss_scale an fp16-less plan cannot use: on every rank
    facts = graph_facts(gm)
    check_cp_runs(plan, gm)
    plan.check_model(facts.fingerprint, type(model).__name__)
    plan.check_batch(facts.batch_size, facts.seq_len)
    # on every launched rank (idle ones too): the retrace agrees with rank 0's
    local = _microbatch_graph(model, example_inputs, plan, gm)
    ctx = build_mesh(plan, cluster.backend)
    if not ctx.active:
        return IdleRank(model, plan, ctx)
    # With ranks idle beside it (a plan on fewer devices), each step's loss goes to them too.
    module_class = PartOfWorld if _launched() > plan.world_size else ParallelModule
    zero = plan.training.get("zero", 0)
    offload = plan.training.get("offload", "none")
    param_dtype = TORCH_DTYPES[plan.precision_policy.get("params", "fp32")]
    program, _ = PassManager(program_for(plan, passes, disable_passes)).run(
        local, PassContext(plan, ctx.coords, str(ctx.device)))
    compiled = compiles(plan)  # each layer's forward, before FSDP2 wraps it
    if plan.mesh.get("pp", 1) > 1:
        def wrap(module: nn.Module, units: list[nn.Module]) -> nn.Module:
            if compiled:
                compile_modules(units, "a pipeline stage's layer")
            return wrap_data_parallel(module.to(ctx.device), ctx, zero, units=units,
                                      pipelined=True, param_dtype=param_dtype,
                                      offload=offload, **_experts_of(program, module))
        runner = PipelineRunner(program, plan, ctx, wrap=wrap)
        pm = module_class(program, nn.ModuleList(runner.modules), plan, ctx, runner,
                          loss_scale=loss_scale)
    else:
        program.to(ctx.device)
        units = [program.get_submodule(p) for p in program.meta.get("autopar_layer_paths", [])]
        if compiled:  # the layers, or the whole program when none is outlined
            compile_modules(units or [program], "a layer" if units else "the program")
        wrapped = wrap_data_parallel(program, ctx, zero, units=units, param_dtype=param_dtype,
                                     offload=offload, **_experts_of(program, program))
        pm = module_class(program, wrapped, plan, ctx, loss_scale=loss_scale)
    if record_run is not None:
        pm.record_run(record_run)
    return pm


def _experts_of(program: fx.GraphModule, module: nn.Module) -> dict[str, Any]:
    """The expert parameters (names) and expert modules (outline-experts) of ``module``,
    the whole program or one pipeline stage of it (which keeps the program's names)."""
    params = dict(module.named_parameters())
    units = []
    for path in program.meta.get("autopar_expert_units", []):
        try:
            units.append(module.get_submodule(path))
        except AttributeError:
            continue  # in another stage
    return {"experts": [n for n in expert_parameters(program) if n in params],
            "expert_units": units}


def check_cp_runs(plan: Plan, gm: fx.GraphModule) -> None:
    """Context parallelism runs on SDPA sites: refuse eager attention chains under cp
    rather than train something else."""
    if plan.mesh.get("cp", 1) <= 1:
        return
    eager = [s.name for s in find_attention_sites(gm) if s.pattern != "sdpa"]
    if eager:
        raise AutoparError(
            f"attention {eager[0]} is an eager chain; under cp only SDPA sites are executed yet",
            where=f"plan.attention ({len(eager)} eager site(s))",
            fix="build the model with scaled_dot_product_attention, or plan with cp=1")


def same_graph_as_rank0(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as rank 0 traced it: its nodes in rank 0's order with rank 0's names, so the
    plan (made on rank 0's graph, keyed by node names) means the same on every rank. A
    model may trace in another order in another process (a loop over a ``set`` of strings
    follows the hash seed, which differs per process); a graph that differs otherwise is
    refused on every rank with the same error, rather than crashing one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return gm
    text = json.dumps(describe(gm))
    digest = hashlib.sha256(text.encode()).hexdigest()
    same = _broadcast_text(digest if dist.get_rank() == 0 else "") == digest
    if _everywhere(same):
        return gm
    reference = json.loads(_broadcast_text(text if dist.get_rank() == 0 else ""))
    aligned = gm if same else align_to(gm, reference)
    if not _everywhere(aligned is not None):
        raise errors.PlanError(
            "the ranks traced different graphs of the model (beyond the order of independent "
            "ops), so no one plan means the same on all of them",
            where=f"autopar.parallelize on rank {dist.get_rank()} "
            f"({'same as' if aligned is not None else 'differs from'} rank 0)",
            fix="make forward() trace the same in every process: no control flow on random "
            "numbers, the environment or the process; set PYTHONHASHSEED for the launch if it "
            "iterates over sets or hashes")
    return aligned


def _everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one all-reduce)."""
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _launched() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _microbatch_graph(model: nn.Module, example_inputs: Any, plan: Plan,
                      gm: fx.GraphModule) -> fx.GraphModule:
    """The model traced on one microbatch of one rank, which the passes rewrite."""
    traced, microbatch = plan.batch["traced"], plan.batch["microbatch"]
    if microbatch == traced:
        return gm
    if microbatch > traced:
        raise RuntimeSetupError(
            f"the plan runs microbatches of {microbatch} sequences, more than the "
            f"{traced} of the example batch",
            where="plan.batch.microbatch",
            fix="pass one global batch as example_inputs (its size is the plan's global batch)",
        )
    # Named as in the planned graph (a model may trace differently at another batch size),
    # computing with its numbers where the batch size entered arithmetic.
    local = rename_like(trace(model, microbatch_inputs(example_inputs, traced, microbatch),
                              agree=same_graph_as_rank0, costs=False), gm)
    restore_batch_constants(local, gm)
    check_batch_split(local, gm, plan, traced // microbatch)
    return local


def check_batch_split(local: fx.GraphModule, gm: fx.GraphModule, plan: Plan, parts: int) -> None:
    """Every value the plan splits over the batch is ``parts`` times smaller along the split
    dim in the program traced on one microbatch: otherwise the plan misread where the batch
    is, and the program would compute something else. (A value kept whole may be made for
    the microbatch's own samples, ``arange(batch)``.)"""
    planned = {n.name: n for n in gm.graph.nodes}
    for node in local.graph.nodes:
        ref = planned.get(node.name)
        strategy = plan.strategy(node.name, "dp") if ref is not None else None
        mine, theirs = node.meta.get("val"), ref.meta.get("val") if ref is not None else None
        if strategy is None or not strategy.outputs or not isinstance(
                strategy.outputs[0], Shard) or not all(
                isinstance(v, torch.Tensor) for v in (mine, theirs)):
            continue
        dim = strategy.outputs[0].dim
        if mine.ndim != theirs.ndim or dim >= mine.ndim:
            continue
        got, whole = mine.shape[dim], theirs.shape[dim]
        if not (isinstance(got, int) and isinstance(whole, int)):
            continue  # a data-dependent size (tokens routed to an expert)
        if got * parts != whole:
            raise RuntimeSetupError(
                f"the plan splits {node.name} along dim {dim} over the batch ({whole} -> "
                f"{whole // parts} on a microbatch), but traced on a microbatch it has {got}",
                where=f"strategies.{node.name}.dp",
                fix="this is a bug in autopar's batch analysis: report it with the model; "
                "plan with dp=1 and microbatches=1 meanwhile")


def _plan_on_rank0(gm: fx.GraphModule, cluster: Cluster, **kwargs: Any) -> Plan:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make_plan(gm, cluster, **kwargs)
    failure: BaseException | None = None
    message: dict[str, Any] = {}
    if dist.get_rank() == 0:
        try:
            message = {"plan": make_plan(gm, cluster, **kwargs).to_dict()}
        except BaseException as e:  # every rank must hear of it, or the others wait forever
            failure, message = e, {"error": error_to_json(e)}
    message = json.loads(_broadcast_text(json.dumps(message) if dist.get_rank() == 0 else ""))
    if failure is not None:
        raise failure
    if "error" in message:
        raise error_from_json(message["error"])
    return Plan.from_dict(message["plan"], source="plan from rank 0")


def error_to_json(e: BaseException) -> dict[str, str]:
    """An error as data another rank can raise again (no pickling)."""
    if isinstance(e, AutoparError):
        return {"class": type(e).__name__, "what": e.what, "where": e.where or "",
                "fix": e.fix or ""}
    return {"class": "AutoparError", "what": f"planning failed on rank 0: "
            f"{type(e).__name__}: {e}", "where": "autopar.plan on rank 0",
            "fix": "see rank 0's traceback"}


def error_from_json(data: dict[str, str]) -> AutoparError:
    """The error rank 0 sent, of the same class when it is one of autopar.core.errors'."""
    cls = getattr(errors, data.get("class", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, AutoparError)):
        cls = AutoparError
    return cls(data["what"], where=data["where"] or None, fix=data["fix"] or None)


def _broadcast_text(text: str) -> str:
    """Send a string from rank 0 to every rank as bytes (no pickling)."""
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    payload = text.encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return data.cpu().numpy().tobytes().decode()
