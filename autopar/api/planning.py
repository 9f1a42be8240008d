"""``autopar.plan``: trace (if needed) and solve, with no process group."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from autopar.analysis.precision import assign_precision
from autopar.core.cluster import Cluster, load_cluster
from autopar.core.cluster.subset import sub_cluster
from autopar.core.collector import collector_paused
from autopar.core.constraints import (
    Constraint,
    DeviceBudget,
    ModuleDtype,
    check_stage_cuts,
    parse_constraints,
)
from autopar.core.errors import AutoparError, NoFeasiblePlanError, TraceError
from autopar.core.graph_facts import META_KEY, graph_facts
from autopar.core.knob_docs import with_knob_list
from autopar.core.knob_table import KNOBS, OPTION_KNOBS
from autopar.core.knobs import (
    PRECISION_CHOICES,
    SEARCHED_RECOMPUTE_MODES,
    ZERO_STAGES_RUNNABLE,
    check_keywords,
    zero_stages,
)
from autopar.core.plan import Plan
from autopar.core.plugins import discover as discover_plugins
from autopar.core.units import format_seconds
from autopar.cost_models.matmul_efficiency import best_efficiency
from autopar.models.spec import SPEC_LIMITS
from autopar.solver.explain.to_plan import make_plan
from autopar.solver.options import PlanOptions
from autopar.solver.search.constraint_core import conflicting
from autopar.solver.search.mesh_search import SearchResult, search
from autopar.solver.search.meshes import n_layers_of
from autopar.strategies.calls import remembered_calls
from autopar.trace import trace


def default_precision(cluster: Cluster) -> str:
    """bf16 mixed precision on accelerators that run it, fp32 on CPU (gloo) clusters and on
    those that do not (a V100: fp16 changes training numerics, so it is asked for by name)."""
    if cluster.backend == "gloo":
        return "fp32"
    return "bf16" if "bf16" in cluster.device.peak_flops else "fp32"


def resolve_precision(precision: str | None, cluster: Cluster) -> str:
    """The plan's precision word: ``None`` -> :func:`default_precision`; ``"auto"`` -> the
    fastest the device runs without loss scaling (bf16, else fp32; fp8 and fp16 change
    training numerics, so they are asked for by name). A word the device cannot run is an
    error naming it: fp8 needs fp8 tensor cores (H100, H200, B200, MI300X); bf16/fp16 a
    device that lists them."""
    if precision is None:
        return default_precision(cluster)
    if not isinstance(precision, str) or precision not in PRECISION_CHOICES:
        raise AutoparError(f"unknown precision {precision!r}", where="precision",
                           fix=f"use one of {', '.join(PRECISION_CHOICES)}")
    device = cluster.device
    if precision == "auto":
        return "bf16" if "bf16" in device.peak_flops else "fp32"
    if precision not in device.peak_flops:
        has = ", ".join(w for w in PRECISION_CHOICES if w in device.peak_flops)
        need = "fp8 tensor cores (H100, H200, B200, MI300X)" if precision == "fp8" else (
            f"{precision} arithmetic")
        raise AutoparError(
            f"precision {precision!r} needs {need}; device {device.name} has none",
            where=f"precision (cluster {cluster.name!r}, device {device.name})",
            fix=f"use one of {has} (or auto), or a cluster file whose device lists "
            f"{precision} under peak_tflops")
    return precision


def plan(
    model: nn.Module | fx.GraphModule,
    cluster: Cluster | str | Path,
    example_inputs: Any = None,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
    cp_algorithm: str | None = None,
    cp_layout: str = "zigzag",
    devices: int | None = None,
    global_batch: int | None = None,
    microbatch: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    precision: str | None = None,
    precision_overrides: dict[str, str] | None = None,
    master_weights: str = "optimizer",
    optimizer: str = "adamw",
    zero: int | tuple[int, ...] = ZERO_STAGES_RUNNABLE,
    recompute: str | tuple[str, ...] = SEARCHED_RECOMPUTE_MODES,
    recompute_layers: tuple[str, ...] | None = None,
    tp_splits_batch: bool | None = None,
    fuse_attention: bool = True,
    attention_kernel: str = "generated",
    chunked_loss: bool = True,
    compile: bool = False,
    batch_coupling: str = "exact",
    memory_fraction: float = 0.9,
    time_limit_s: float = 20.0,
    extrapolation_margin: float | None = None,
    max_solves: int | None = 300,
    offload: str | tuple[str, ...] = ("none", "optimizer+params"),
    dp_replicate: int | None = None,
    constraints: Sequence[Constraint | str] | None = None,
    model_name: str | None = None,
    **old_spellings: Any,
) -> Plan:
    """Plan ``model`` for ``cluster`` without starting any process.

    ``model`` is a module (traced with ``example_inputs``, which may be TensorSpecs) or a
    GraphModule from :func:`autopar.trace`. ``cluster`` is a Cluster, a shorthand such as
    ``"8xH100-80GB"`` or ``"2xcpu"``, or a YAML/JSON file. Every other keyword but
    ``model_name`` (the name the plan records; default: the model's class) is a knob of the
    knob table, :data:`autopar.core.knob_table.KNOBS` (listed below, and in docs/cli.md
    with their flags): a knob given pins what it names, and the solver chooses the rest.
    ``ep`` spreads each MoE layer's experts over that many dp ranks (all-to-all each way:
    :mod:`autopar.solver.axes.expert_axis`), ``cp`` splits each sequence, ``dp_replicate``
    pins HSDP (:mod:`autopar.solver.axes.hsdp`), and layers may recompute differently.

    The plan says what was chosen and why: ``plan.explanation`` (how tp is used and, if it
    shards no weight, why; ``["devices"]``: how many devices, and why), ``plan.context``
    (the cp algorithm, with the others' modelled costs), ``plan.batch_coupled`` (the ops
    that couple a batch's samples), ``plan.precision`` (which node computes in what:
    :mod:`autopar.analysis.precision`), ``plan.training["recompute"]`` ("mixed": per layer)
    and ``plan.predicted["ground"]`` (validated or extrapolated ground). When constraints
    leave no plan, the error names the smallest set of them that conflict.

    Knobs:

    <knob list>

    >>> import torch, autopar
    >>> from autopar.models import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    >>> idx = torch.randint(0, 64, (4, 16))
    >>> autopar.plan(gpt, "2xcpu", (idx, idx), dp=2).mesh
    {'dp': 2, 'tp': 1}
    """
    given = dict(locals())
    if old_spellings:
        explicit = [k for k in PLAN_KEYWORDS if given[k] is not _DEFAULTS[k]]
        given.update(check_keywords(old_spellings, PLAN_KEYWORDS, "autopar.plan", explicit))
    check_plannable(model)
    discover_plugins()  # installed packages' rules and op costs join before tracing
    cluster = load_cluster(cluster)
    constraints = parse_constraints([*cluster.constraints, *(constraints or ())])
    precision_overrides = {**{c.module: c.dtype for c in constraints
                              if isinstance(c, ModuleDtype)}, **(precision_overrides or {})}
    gm = model if isinstance(model, fx.GraphModule) and META_KEY in model.meta else None
    if gm is None:
        gm = trace(model, example_inputs)
    check_returns_loss(gm)
    check_stage_cuts(constraints, n_layers_of(gm))
    check_batch_size(global_batch or graph_facts(gm).batch_size or 1)
    options = plan_options({**given, "precision_overrides": precision_overrides,
                            "constraints": constraints}, cluster)
    if options.precision_overrides:  # a key naming nothing fails here, before any solve
        assign_precision(gm, options.precision, dict(options.precision_overrides))
    counts = device_counts(cluster, devices, pinned_mesh=any(v is not None for v in (dp, tp, pp))
                           or (cp or 1) > 1)  # cp=1 (what parallelize runs) fixes no count
    budget = [k for k in counts if all(k <= c.devices for c in constraints
                                       if isinstance(c, DeviceBudget))] or counts[-1:]
    return _plan_on(gm, cluster, options, model_name or type(model).__name__, budget,
                    pinned=devices is not None)


def check_plannable(model: Any) -> None:
    """``plan`` plans a module: a model's name is for the command line (or resolve_model)."""
    if not isinstance(model, nn.Module):
        raise AutoparError(
            f"autopar.plan() plans an nn.Module, got {type(model).__name__}",
            where="autopar.plan(model=...)",
            fix="pass the model object (or a graph from autopar.trace); for a model name such "
            "as 'gpt2', use `autopar plan gpt2 --cluster ...` or autopar.models.resolve_model",
        )


def plan_options(knobs: dict[str, Any], cluster: Cluster) -> PlanOptions:
    """The knobs ``plan`` was given, as PlanOptions: precision resolved for the cluster's
    device, overrides as pairs, ZeRO stages and recomputation modes as tuples (``knobs``:
    every keyword of ``plan``, ``constraints`` parsed)."""
    recompute = knobs["recompute"]
    return PlanOptions(
        **{name: knobs[name] for name in _GIVEN_AS_IS},
        precision=resolve_precision(knobs["precision"], cluster),
        precision_overrides=tuple(knobs["precision_overrides"].items()),
        zero=zero_stages(knobs["zero"]),
        recompute=(recompute,) if isinstance(recompute, str) else tuple(recompute),
        constraints=knobs["constraints"],
    )


def _plan_on(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions, name: str,
             budget: list[int], pinned: bool) -> Plan:
    """The plan on the device counts of ``budget``; when the constraints leave none, the
    error names the smallest set of them that conflict."""
    try:
        with remembered_calls(), collector_paused():  # the graph is read, not changed
            if budget == [cluster.world_size]:
                result, used = _search_offloading_last(gm, cluster, options)
                return make_plan(gm, result, cluster, used, name)
            return _plan_fewest_fastest(gm, cluster, options, name, budget, pinned=pinned)
    except NoFeasiblePlanError as e:
        constraints = options.constraints
        if not constraints:
            raise
        conflict = conflicting(gm, cluster, options, device_counts(cluster, None))
        if conflict is None:
            raise NoFeasiblePlanError(f"{e.what} (under the constraints "
                                      f"{', '.join(map(str, constraints))})",
                                      where=e.where, fix=e.fix) from e
        raise conflict from e


def device_counts(cluster: Cluster, devices: int | None, pinned_mesh: bool = False) -> list[int]:
    """The device counts to plan for, most first: ``devices`` when pinned (checked: at most
    the cluster's, and whole nodes or part of one node); with it unpinned, every count that
    divides the cluster's (whole nodes, or part of one node), unless a mesh degree is pinned
    (the pinned layout then fills the cluster)."""
    total, per_node = cluster.world_size, cluster.devices_per_node
    if devices is not None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise AutoparError(f"devices must be a positive integer, got {devices!r}",
                               where="devices", fix="pass devices=None to let the planner "
                               "choose, or how many of the cluster's devices to use")
        if devices > total:
            raise AutoparError(
                f"devices={devices} is more than the {total} device(s) of cluster "
                f"{cluster.name!r}", where="devices",
                fix=f"pass at most {total}, or plan for a larger cluster")
        if devices > per_node and devices % per_node:
            raise AutoparError(
                f"devices={devices} is neither whole nodes nor part of one node of cluster "
                f"{cluster.name!r} ({cluster.nodes} node(s) x {per_node} devices)",
                where="devices", fix=f"pass a multiple of {per_node}, or at most {per_node}")
        return [devices]
    if pinned_mesh:
        return [total]
    nodes = [n * per_node for n in range(cluster.nodes, 0, -1) if cluster.nodes % n == 0]
    within = [d for d in range(per_node - 1, 0, -1) if per_node % d == 0]
    return nodes + within


def _plan_fewest_fastest(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions, name: str,
                         counts: list[int], pinned: bool) -> Plan:
    """Plan on each device count (most first) and keep the fastest prediction; ties go to
    fewer devices. A count whose compute alone (the model's FLOPs at the best efficiency the
    cost model grants any op) cannot beat the best so far is not solved, nor is any smaller
    one."""
    total = cluster.world_size
    best: Plan | None = None
    first_error: AutoparError | None = None
    tried: list[dict[str, Any]] = []
    for k in counts:
        if best is not None:
            device = sub_cluster(cluster, k).device  # fewer CPU processes: more core each
            floor = best.predicted["model_flops_per_step"] / (
                k * device.peak(options.precision) * best_efficiency(device)
                * device.compute_share)
            if floor >= best.predicted["step_time_s"]:
                tried += [{"devices": c, "step_time_s": None, "status": "pruned: the "
                           "model's FLOPs at the best efficiency take longer than the best plan"}
                          for c in counts[counts.index(k):]]
                break
        sub = sub_cluster(cluster, k)
        try:
            result, used = _search_offloading_last(gm, sub, options)
            candidate = make_plan(gm, result, sub, used, name)
        except KeyboardInterrupt:
            if best is None:
                raise
            best.solver["interrupted"] = True  # Ctrl-C: the best plan so far
            break
        except AutoparError as e:
            first_error = first_error or e
            tried.append({"devices": k, "step_time_s": None,
                          "status": f"no plan: {e.what}"[:300]})
            continue
        tried.append({"devices": k, "step_time_s": candidate.predicted["step_time_s"],
                      "status": "solved", "mesh": dict(candidate.mesh)})
        # A tie goes to fewer devices: the same step, with devices to spare (a plan on more
        # that predicts no gain, e.g. tp replicating every weight, wastes them).
        if best is None or (candidate.predicted["step_time_s"]
                            <= best.predicted["step_time_s"] * (1 + 1e-9)):
            best = candidate
        if result.interrupted:
            best.solver["interrupted"] = True
            break
    if best is None:
        assert first_error is not None
        raise first_error
    used = best.world_size
    cluster_dict = cluster.to_dict()
    cluster_dict["devices"] = total
    best.cluster = cluster_dict
    best.explanation["devices"] = {
        "used": used, "cluster": total, "pinned": pinned,
        "why": devices_why(used, total, pinned, tried), "alternatives": tried}
    return best


def devices_why(used: int, total: int, pinned: bool, tried: list[dict[str, Any]]) -> str:
    """One line: how many devices the plan uses, and why (modelled step times)."""
    if pinned:
        return f"uses {used} of {total} devices: pinned (devices={used})"
    mine = next(t["step_time_s"] for t in tried if t["devices"] == used)
    others = [t for t in tried if t["devices"] != used and t["step_time_s"] is not None]
    if used < total:
        full = next((t for t in tried if t["devices"] == total), None)
        other = full["step_time_s"] if full else None
        if other is None:
            vs = f"no plan fits all {total}"
        elif mine < other * (1 - 1e-9):
            vs = (f"{format_seconds(other)} with all {total} (modelled; the communication more "
                  "devices need costs more than it saves)")
        else:
            vs = f"no faster with all {total} (modelled)"
        return (f"uses {used} of {total} devices: predicted step {format_seconds(mine)}, {vs}; "
                f"{f'rank {used}' if used + 1 == total else f'ranks {used} and up'} idle "
                f"(or launch {used} process{'es' if used > 1 else ''} with this plan)")
    best_other = min(others, key=lambda t: t["step_time_s"], default=None)
    tail = (f" vs {format_seconds(best_other['step_time_s'])} with {best_other['devices']}"
            if best_other else "")
    return f"uses all {total} devices: predicted step {format_seconds(mine)}{tail} (modelled)"


def check_batch_size(batch: int) -> None:
    """The search tries the batch's divisors as microbatch sizes: bound it (as model specs
    are bounded) so that a stray 10**12 fails at once instead of searching for hours."""
    limit = SPEC_LIMITS["batch"]
    if isinstance(batch, int) and batch > limit:
        raise AutoparError(f"global batch {batch} is above autopar's limit of {limit} sequences",
                           where="global_batch (or the example inputs' batch)",
                           fix=f"plan for at most {limit} sequences per step")


def check_returns_loss(gm: fx.GraphModule) -> None:
    """Training needs a scalar loss among the outputs (a 0-dim floating tensor: alone, in a
    tuple or dict, or as ``.loss``); refuse now rather than plan a step that cannot run."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    shown = []
    for value in tree_leaves(output.args):
        val = value.meta.get("val") if isinstance(value, fx.Node) else value
        if isinstance(val, torch.Tensor):
            if val.ndim == 0 and val.is_floating_point():
                return
            shown.append(f"{str(val.dtype).removeprefix('torch.')} tensor {tuple(val.shape)}")
        else:
            shown.append(repr(val) if val is None or isinstance(val, (int, float)) else
                         type(val).__name__)
    raise TraceError(
        f"the model returns no scalar loss to train on; its outputs are: "
        f"{', '.join(shown) or 'nothing'}",
        where="model.forward outputs",
        fix="make forward compute and return the loss as a 0-dim float tensor (alone, in a "
        "tuple, or as .loss), e.g. pass the targets too: model(tokens, targets) returning "
        "(logits, F.cross_entropy(...)); for Hugging Face models pass labels=",
    )


PLAN_KEYWORDS = tuple(name for name, p in inspect.signature(plan).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY)
"""The keywords ``autopar.plan`` takes (``parallelize`` passes them through)."""
_DEFAULTS = {name: p.default for name, p in inspect.signature(plan).parameters.items()}
_GIVEN_AS_IS = tuple(knob.name for knob in OPTION_KNOBS if knob.name in PLAN_KEYWORDS and knob.name
                     not in ("precision", "precision_overrides", "zero", "recompute", "constraints"))
"""The knobs ``plan`` hands PlanOptions as it was given them."""
plan.__doc__ = with_knob_list(plan.__doc__, [k for k in KNOBS if k in PLAN_KEYWORDS])


def _search_offloading_last(gm: fx.GraphModule, cluster: Cluster, options: PlanOptions
                            ) -> tuple[SearchResult, PlanOptions]:
    """The search without offload, then, only when nothing fits in device memory, with it:
    the host link and a host optimizer are slower than any plan that fits (a pinned
    ``offload="optimizer+params"`` is searched directly)."""
    modes = options.offload
    if modes == ("none",) or modes == ("optimizer+params",):
        return search(gm, cluster, options), options
    first = dataclasses.replace(options, offload=("none",))
    try:
        return search(gm, cluster, first), first
    except NoFeasiblePlanError as refused:
        if "optimizer+params" not in modes or 3 not in options.zero:
            raise  # FSDP2 offloads ZeRO-3's shards: not when the stages exclude it
        offloading = dataclasses.replace(options, offload=("optimizer+params",), zero=(3,))
        try:
            return search(gm, cluster, offloading), offloading
        except NoFeasiblePlanError as also:
            if not getattr(also, "tried", True):  # nothing offloads: say why without it
                raise refused from None
            raise

