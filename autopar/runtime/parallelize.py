"""``autopar.parallelize``: plan (or take a plan), rewrite the graph for this rank, wrap it.

Launched by torchrun, every rank traces the same model; rank 0 plans and sends the plan's
JSON to the others (as bytes: plans are data), so every rank runs the same plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.cluster import Cluster, load_cluster
from autopar.errors import RuntimeSetupError
from autopar.graph_facts import graph_facts
from autopar.knobs import check_keywords
from autopar.passes import PassContext, PassManager, program_passes
from autopar.plan import Plan
from autopar.planning import PLAN_KEYWORDS
from autopar.planning import plan as make_plan
from autopar.runtime.data_parallel import wrap_data_parallel
from autopar.runtime.mesh import build_mesh, ensure_process_group
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.pipeline import PipelineRunner
from autopar.trace import trace
from autopar.trace.align import rename_like
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
    **plan_options: Any,
) -> ParallelModule:
    """This rank's part of ``model``, planned for ``cluster`` and ready to train.

    ``example_inputs`` is one *global* batch (every rank passes the same); the plan splits
    it. ``dp``/``tp``/``pp`` pin mesh degrees; ``plan`` (a Plan or a JSON file) skips
    planning. Other keywords go to :func:`autopar.plan` (``precision``, ``microbatch``,
    ``microbatches``, ``schedule``, ``virtual_stages``, ``zero``, ...).
    """
    plan_options = check_keywords(
        plan_options, [k for k in PLAN_KEYWORDS if k not in ("dp", "tp", "pp")],
        "autopar.parallelize")
    cluster = load_cluster(cluster)
    ensure_process_group(cluster.backend)
    gm = trace(model, example_inputs)
    if plan is None:
        plan = _plan_on_rank0(gm, cluster, dp=dp, tp=tp, pp=pp, model_name=type(model).__name__,
                              **plan_options)
    elif not isinstance(plan, Plan):
        plan = Plan.load(plan)
    plan.check_model(graph_facts(gm).fingerprint, type(model).__name__)
    ctx = build_mesh(plan, cluster.backend)
    zero = plan.training.get("zero", 0)
    local = _microbatch_graph(model, example_inputs, plan, gm)
    program, _ = PassManager(program_passes(plan)).run(local, PassContext(plan, ctx.coords))
    if plan.mesh.get("pp", 1) > 1:
        runner = PipelineRunner(program, plan, ctx, wrap=lambda module, units: (
            wrap_data_parallel(module.to(ctx.device), ctx, zero, units=units, pipelined=True)))
        return ParallelModule(program, nn.ModuleList(runner.modules), plan, ctx, runner)
    program.to(ctx.device)
    units = [program.get_submodule(p) for p in program.meta.get("autopar_layer_paths", [])]
    wrapped = wrap_data_parallel(program, ctx, zero, units=units)
    return ParallelModule(program, wrapped, plan, ctx)


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
    # Named as in the planned graph (a model may trace differently at another batch size).
    return rename_like(trace(model, microbatch_inputs(example_inputs, traced, microbatch)), gm)


def _plan_on_rank0(gm: fx.GraphModule, cluster: Cluster, **kwargs: Any) -> Plan:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make_plan(gm, cluster, **kwargs)
    text = make_plan(gm, cluster, **kwargs).to_json() if dist.get_rank() == 0 else ""
    return Plan.from_json(_broadcast_text(text), source="plan from rank 0")


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
