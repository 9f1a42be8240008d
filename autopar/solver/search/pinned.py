"""Evaluate one pinned configuration without searching: the memory calculator.

Everything a user pins (tensor, pipeline, data parallelism, microbatch, recomputation,
precision, ZeRO, optimizer, schedule) is fixed; only the per-node tensor-parallel layout
is chosen — by the same CP-SAT model as planning, minimizing step time with the memory
limit lifted, so a configuration that does not fit is reported as such rather than
rejected. Tensor parallelism never splits the batch here (that is what ``dp`` pins), and with
``sp=False`` it does not split the sequence either (Megatron without sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

from autopar.analysis.attention_sites import find_attention_sites
from autopar.analysis.batch_axis import batch_strategies, propagate_input_dim
from autopar.analysis.expert_sites import regions_of
from autopar.core.cluster import Cluster
from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY, graph_facts
from autopar.core.knobs import (
    CP_ALGORITHMS,
    CP_LAYOUTS,
    LEANNESS,
    OPTIMIZERS,
    RECOMPUTE_MODES,
    schedule_name,
)
from autopar.cost_models.memory import PRECISIONS
from autopar.cost_models.pipeline import ZB_V_CHUNKS
from autopar.solver.axes.context import algorithm_costs, cheapest, cp_refusal
from autopar.solver.axes.expert_axis import check_ep
from autopar.solver.axes.hsdp import check_dp_replicate
from autopar.solver.model.cpsat import solve
from autopar.solver.model.layer_recompute import compose_units, with_modes
from autopar.solver.model.problem import (
    Problem,
    build_problem,
    forbid_sharding_like,
    keep_residual_stream_whole,
    pair_row_parallel,
    shard_weight_matrices,
)
from autopar.solver.options import ATTENTION_KERNELS, WEIGHT_COPIES, PlanOptions
from autopar.solver.pricing.costs import CostTables
from autopar.solver.pricing.elementwise_fusion import fuse_elementwise
from autopar.solver.pricing.evaluate import Prediction, assemble, evaluate
from autopar.solver.pricing.fusion import Fusion
from autopar.solver.pricing.unit_costs import unit_costs
from autopar.solver.search.microbatches import check_microbatch
from autopar.solver.setting import Setting

_FLAGS = {"virtual": "virtual-stages"}
"""PinnedConfig fields whose command-line flag is spelled otherwise."""


@dataclass(frozen=True)
class PinnedConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, carved out of dp
    dp_replicate: int = 1  # HSDP: ZeRO shards within dp/dp_replicate ranks (autopar.solver.axes.hsdp)
    cp_algorithm: str | None = None  # None: the cheapest modelled
    cp_layout: str = "zigzag"
    sp: bool = False
    microbatch: int = 1
    global_batch: int | None = None
    recompute: str = "none"
    # one mode per repeated layer, in running order (overrides ``recompute``)
    recompute_layers: tuple[str, ...] = ()
    precision: str = "bf16"
    # node name or module path -> dtype word, over autopar's precision policy
    precision_overrides: tuple[tuple[str, str], ...] = ()
    # where the fp32 master weights live under ZeRO 1-3: PlanOptions.master_weights
    master_weights: str = "optimizer"
    # how long a weight's low-precision copy lives: PlanOptions.weight_copies
    weight_copies: str = "step"
    zero: int = 0
    optimizer: str = "adamw"
    schedule: str = "1f1b"
    virtual: int = 1
    # "auto": the solver's fastest tensor-parallel layout. "megatron": the residual stream
    # (norms, dropouts, residual adds) stays whole on every device, or sequence-split with
    # sp — Megatron-LM's layout, which Korthikanti et al.'s formulas describe.
    layout: str = "auto"
    # Model eager attention as the fused kernel the program runs (no sequence-squared
    # tensors kept); False models it op by op, as Megatron-LM ran it in 2021.
    fuse_attention: bool = True
    # The kernel the fused sites run: PlanOptions.attention_kernel ("device" for a run by
    # another framework, whose own kernel the cluster's attention_efficiency describes)
    attention_kernel: str = "generated"
    # Model a program that fuses its elementwise chains (Transformer Engine's kernels,
    # torch.compile): autopar.solver.pricing.elementwise_fusion. autopar's runtime runs them eagerly.
    fuse_elementwise: bool = False
    # Cross-entropy a block of tokens at a time (autopar.ops.loss_ops), as the runtime runs it.
    chunked_loss: bool = True
    # Model a program that pipelines its tensor-parallel collectives with the matmuls beside
    # them (Transformer Engine's userbuffers, PyTorch's async TP): autopar.solver.pricing.tp_overlap.
    # autopar's runtime issues them whole.
    tp_overlap: bool = False
    # Model a pipeline whose sends and receives run beside the compute (Megatron-Core's
    # overlap_p2p_comm, on under its interleaved schedule); autopar's stages wait for them.
    p2p_overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "dp_replicate", "microbatch", "virtual",
                     "global_batch"):
            value = getattr(self, name)
            if name == "global_batch" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = _FLAGS.get(name, name.replace("_", "-"))
                raise AutoparError(f"PinnedConfig.{name} must be a positive integer, got "
                                   f"{value!r}", where=f"--{flag}",
                                   fix=f"pass --{flag} N with N >= 1")
        for name in ("sp", "fuse_attention", "fuse_elementwise", "chunked_loss", "tp_overlap",
                     "p2p_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise AutoparError(f"PinnedConfig.{name} must be True or False, got "
                                   f"{getattr(self, name)!r}", where=f"PinnedConfig.{name}",
                                   fix=f"pass {name}=True or {name}=False")
        for name, allowed in (("recompute", RECOMPUTE_MODES), ("precision", PRECISIONS),
                              ("optimizer", OPTIMIZERS), ("layout", ("auto", "megatron")),
                              ("weight_copies", WEIGHT_COPIES),
                              ("attention_kernel", ATTENTION_KERNELS)):
            if getattr(self, name) not in allowed:
                where = (f"PinnedConfig.{name}"
                         if name in ("layout", "weight_copies", "attention_kernel")
                         else f"--{name}")
                raise AutoparError(f"unknown {name} {getattr(self, name)!r}", where=where,
                                   fix=f"use one of {', '.join(allowed)}")
        if any(m not in RECOMPUTE_MODES for m in self.recompute_layers):
            raise AutoparError(f"unknown recomputation in {self.recompute_layers!r}",
                               where="--recompute-layers",
                               fix=f"give one of {', '.join(RECOMPUTE_MODES)} per layer")
        if self.cp_algorithm is not None and self.cp_algorithm not in CP_ALGORITHMS:
            raise AutoparError(f"unknown cp algorithm {self.cp_algorithm!r}",
                               where="--cp-algorithm", fix=f"use one of {', '.join(CP_ALGORITHMS)}")
        if self.dp_replicate > 1:
            check_dp_replicate(PlanOptions(dp=self.dp, cp=self.cp, zero=(self.zero,),
                                           dp_replicate=self.dp_replicate))
            if self.ep > 1:
                raise AutoparError("HSDP (--dp-replicate) runs without expert parallelism",
                                   where="--dp-replicate", fix="drop --dp-replicate or --ep")
        if self.cp_layout not in CP_LAYOUTS:
            raise AutoparError(f"unknown cp layout {self.cp_layout!r}", where="--cp-layout",
                               fix=f"use one of {', '.join(CP_LAYOUTS)}")
        object.__setattr__(self, "schedule", schedule_name(self.schedule, where="--schedule"))
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise AutoparError(f"ZeRO stage must be 0-3, got {self.zero!r}", where="--zero",
                               fix="pass --zero 0, 1, 2 or 3")
        if self.schedule == "zb_v":
            if self.virtual not in (1, ZB_V_CHUNKS):
                raise AutoparError(f"zb_v runs {ZB_V_CHUNKS} chunks per pipeline rank, not "
                                   f"{self.virtual}", where="--virtual-stages",
                                   fix=f"drop --virtual-stages (or give {ZB_V_CHUNKS})")
            if self.pp > 1:  # the V: two chunks on every rank, as the runtime runs it
                object.__setattr__(self, "virtual", ZB_V_CHUNKS)
        elif self.virtual > 1 and self.schedule != "interleaved":
            raise AutoparError("virtual stages need the interleaved schedule",
                               where="--virtual-stages", fix="add --schedule interleaved")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def check_tp(gm: fx.GraphModule, cluster: Cluster, tp: int) -> None:
    """Tensor parallelism stays inside a node (its fast links) and splits whole heads."""
    per_node = cluster.devices_per_node
    if per_node % tp:
        what = (f"spans {-(-tp // per_node)} nodes of {per_node} devices" if tp > per_node
                else f"does not divide the {per_node} devices of a node")
        raise AutoparError(
            f"tp={tp} {what} of {cluster.name}",
            where="--tp", fix=f"use a tp that divides {per_node} (tensor parallelism needs "
            "the fast links inside a node); span nodes with --dp or --pp")
    for heads in sorted(attention_heads(gm)):
        if heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0 and per_node % d == 0]
            raise AutoparError(
                f"tp={tp} does not divide the model's {heads} attention heads",
                where="--tp", fix="use a tp that divides both the heads and the devices per node: "
                + ", ".join(map(str, divisors)))


def attention_heads(gm: fx.GraphModule) -> set[int]:
    """Query and key/value head counts of every attention site with (b, heads, s, d) inputs."""
    heads = set()
    for site in find_attention_sites(gm):
        for node in (site.q, site.k):
            facts = node.meta.get(META_KEY) if isinstance(node, fx.Node) else None
            if facts is not None and facts.shapes and len(facts.shapes[0]) == 4:
                heads.add(facts.shapes[0][1])
    return heads


@dataclass
class Estimate:
    config: PinnedConfig
    setting: Setting
    prediction: Prediction
    problem: Problem
    choice: list[int]
    tables: CostTables


def estimate_graph(gm: fx.GraphModule, cluster: Cluster, config: PinnedConfig) -> Estimate:
    """``config`` priced on ``cluster``: its fastest tensor-parallel layout under the pins,
    solved with the memory limit lifted, and that layout's modelled step and memory."""
    facts = graph_facts(gm)
    traced = facts.batch_size or 1
    global_batch = config.global_batch or traced
    check_tp(gm, cluster, config.tp)
    _check_pins(gm, cluster, config, traced, global_batch)
    local = global_batch // config.dp
    layer_modes = config.recompute_layers
    base = min(layer_modes, key=LEANNESS.index) if layer_modes else config.recompute
    setting = Setting(
        dp=config.dp, tp=config.tp, zero=config.zero, microbatch=config.microbatch,
        microbatches=local // config.microbatch, recompute=base, pp=config.pp,
        schedule=config.schedule, virtual=config.virtual, cp=config.cp,
        cp_algorithm="auto" if config.cp > 1 else "none", cp_layout=config.cp_layout,
        ep=config.ep, dp_replicate=config.dp_replicate,
    )
    check_ep(gm, PlanOptions(ep=config.ep, dp=config.dp), config.dp * config.tp * config.pp
             * config.cp)
    options = PlanOptions(precision=config.precision,
                          precision_overrides=config.precision_overrides,
                          master_weights=config.master_weights,
                          weight_copies=config.weight_copies,
                          optimizer=config.optimizer,
                          zero=(config.zero,), recompute=(base,), cp=config.cp,
                          cp_algorithm=config.cp_algorithm, cp_layout=config.cp_layout,
                          chunked_loss=config.chunked_loss,
                          attention_kernel=config.attention_kernel)
    problem = _pinned_problem(gm, config, traced)
    tables = CostTables(problem, cluster, options, setting, traced, facts.seq_len)
    if config.cp > 1:
        allowed = (config.cp_algorithm,) if config.cp_algorithm else CP_ALGORITHMS
        costs = algorithm_costs(tables, allowed)
        algorithm = cheapest(costs)
        if algorithm is None:
            raise AutoparError(f"cp={config.cp}: {'; '.join(map(str, costs.values()))}",
                               where="--cp-algorithm", fix="pick another algorithm or cp")
        setting = replace(setting, cp_algorithm=algorithm)
        tables = CostTables(problem, cluster, options, setting, traced, facts.seq_len)
    result = solve(tables, time_limit_s=30.0, enforce_memory=False)
    if result.choice is None:
        megatron = config.layout == "megatron"
        raise AutoparError(
            f"no tensor-parallel layout at tp={config.tp} ({result.status})"
            + (": Megatron-LM's layout (every weight matrix split, the residual stream "
               "whole) places this model's ops inconsistently" if megatron else ""),
            where="--layout megatron" if megatron else f"--tp {config.tp}",
            fix="price the solver's own layout (--layout auto), or another --tp" if megatron
            else "try another --tp (one that divides the heads and the hidden sizes)")
    prediction = evaluate(tables, result.choice)
    if layer_modes:  # each layer's own mode: the layout's units under each, composed
        by_mode = {m: unit_costs(tables if m == base else CostTables(
            problem, cluster, options, replace(setting, recompute=m), traced, facts.seq_len),
            result.choice) for m in set(layer_modes)}
        setting = with_modes(setting, layer_modes)
        prediction = assemble(tables, compose_units(by_mode, layer_modes), setting)
    return Estimate(config, setting, prediction, problem, result.choice, tables)


def _check_pins(gm: fx.GraphModule, cluster: Cluster, config: PinnedConfig, traced: int,
                global_batch: int) -> None:
    """Refuse pins that cannot run together on ``cluster`` (the degrees, the batch, the
    microbatch, the pipeline, the per-layer recomputation), naming the flag to change."""
    facts = graph_facts(gm)
    if config.devices != cluster.world_size:
        raise AutoparError(
            f"tp x pp x dp x cp = {config.tp} x {config.pp} x {config.dp} x {config.cp} = "
            f"{config.devices} devices, but cluster {cluster.name} has {cluster.world_size}",
            where="--tp/--pp/--dp/--cp",
            fix="make the product of the degrees equal the number of devices (or omit --dp)",
        )
    why = cp_refusal(gm, config.cp, config.cp_layout, facts.seq_len, config.fuse_attention)
    if why:
        raise AutoparError(f"cp={config.cp}: {why}", where="--cp",
                           fix="pick a cp whose chunks divide the sequence, or --cp 1")
    if global_batch % config.dp:
        raise AutoparError(
            f"global batch {global_batch} does not split over dp={config.dp}",
            where="--global-batch", fix="use a multiple of dp")
    check_microbatch(traced, config.microbatch)
    local = global_batch // config.dp
    if local % config.microbatch:
        raise AutoparError(
            f"microbatch {config.microbatch} does not divide the {local} sequences per "
            f"data-parallel rank", where="--microbatch", fix="pick a divisor")
    n_layers = sum(len(b.layers) for b in facts.blocks)  # every stack's (an encoder-decoder's two)
    if config.pp > 1 and n_layers < config.pp * config.virtual:
        raise AutoparError(
            f"{n_layers} layers cannot fill {config.pp} stages x {config.virtual} chunks",
            where="--pp", fix="use fewer stages")
    layer_modes = config.recompute_layers
    if layer_modes and len(layer_modes) != n_layers:
        raise AutoparError(
            f"--recompute-layers gives {len(layer_modes)} mode(s) for {n_layers} layers",
            where="--recompute-layers", fix="give one mode per layer, in running order")


def _pinned_problem(gm: fx.GraphModule, config: PinnedConfig, traced: int) -> Problem:
    """The tensor-parallel problem under ``config``'s fusions and overlaps, narrowed to what
    the pins allow: no batch split, no sequence split without ``sp``, and Megatron-LM's
    layout when pinned."""
    facts = graph_facts(gm)
    problem = build_problem(gm, config.tp, batch_strategies(gm, traced))
    if config.fuse_attention:
        Fusion.of(gm).apply(problem)
    fuse_elementwise(problem, gm, config.fuse_elementwise)
    problem.tp_overlap = config.tp_overlap
    problem.p2p_overlap = config.p2p_overlap
    if config.tp > 1:
        # Tensor parallelism splits the work within each sequence; splitting the batch is
        # data parallelism's job. Without --sp it does not split the sequence either
        # (Megatron's baseline: norms, dropouts and residuals whole on every device).
        # (follow_only: only what follows the batch or the sequence is marked; a microbatch
        # tp does not divide marks nothing, rather than whatever a free slice would split)
        forbid_sharding_like(problem, propagate_input_dim(gm, config.tp, traced, dim=0,
                                                          follow_only=True))
        sequence = propagate_input_dim(gm, config.tp, facts.seq_len, dim=1,
                                       follow_only=True) if facts.seq_len else {}
        if not config.sp and sequence:
            forbid_sharding_like(problem, sequence)
        if config.layout == "megatron":
            keep_residual_stream_whole(problem, sequence if config.sp else {})
            pair_row_parallel(problem)
            experts = (frozenset(w.name for r in regions_of(gm) for w in r.weights)
                       if config.ep > 1 else frozenset())
            shard_weight_matrices(problem, keep=experts)
    return problem
