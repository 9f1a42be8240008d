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
from autopar.graph_facts import graph_facts
from autopar.passes import (
    CheckpointLayers,
    OutlineLayers,
    PassContext,
    PassManager,
    sharding_passes,
)
from autopar.plan import Plan
from autopar.planning import plan as make_plan
from autopar.runtime.data_parallel import wrap_data_parallel
from autopar.runtime.mesh import build_mesh, ensure_process_group
from autopar.runtime.parallel_module import ParallelModule
from autopar.trace import trace


def parallelize(
    model: nn.Module,
    cluster: Cluster | str | Path,
    example_inputs: Any,
    *,
    dp: int | None = None,
    tp: int | None = None,
    plan: Plan | str | Path | None = None,
    **plan_options: Any,
) -> ParallelModule:
    """This rank's part of ``model``, planned for ``cluster`` and ready to train.

    ``example_inputs`` is one *global* batch (every rank passes the same); the plan splits
    it. ``dp``/``tp`` pin mesh degrees; ``plan`` (a Plan or a JSON file) skips planning.
    Other keywords go to :func:`autopar.plan` (``precision``, ``microbatch``, ...).
    """
    cluster = load_cluster(cluster)
    ensure_process_group(cluster.backend)
    gm = trace(model, example_inputs)
    if plan is None:
        plan = _plan_on_rank0(gm, cluster, dp=dp, tp=tp, model_name=type(model).__name__,
                              **plan_options)
    elif not isinstance(plan, Plan):
        plan = Plan.load(plan)
    plan.check_model(graph_facts(gm).fingerprint, type(model).__name__)
    ctx = build_mesh(plan, cluster.backend)
    zero = plan.training.get("zero_stage", 0)
    recompute = plan.training.get("recompute", "none")
    passes = sharding_passes()
    if (zero == 3 and plan.mesh.get("dp", 1) > 1) or recompute != "none":
        # FSDP2 gathers one layer module at a time; checkpointing reruns one at a time.
        passes.append(OutlineLayers())
    if recompute != "none":
        passes.append(CheckpointLayers())
    program, _ = PassManager(passes).run(gm, PassContext(plan, ctx.coords))
    program.to(ctx.device)
    units = [program.get_submodule(p) for p in program.meta.get("autopar_layer_paths", [])]
    wrapped = wrap_data_parallel(program, ctx, zero, units=units)
    return ParallelModule(program, wrapped, plan, ctx)


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
