"""Predict step time and memory of one fully chosen plan (all numbers modelled).

This is the ground truth the CP-SAT model linearizes: the same cost tables, with
redistributions and saved tensors counted once per (value, placement) exactly as the
runtime performs and keeps them, summed per pipeline stage. Layers are cut into ``pp``
contiguous stages of equal layer counts; what runs before the layers (embeddings) belongs
to the first stage, what runs after (the head, the loss) to the last.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.cost_models.comm import collective_time, group_collective_time
from autopar.cost_models.compute import optimizer_step_time
from autopar.cost_models.memory import MemoryBreakdown, ddp_buffer_bytes
from autopar.cost_models.pipeline import bubble_fraction, in_flight
from autopar.graph_facts import META_KEY
from autopar.placements import Placement, Replicate, Shard
from autopar.solver.costs import CostTables, divisor, sharded_compute
from autopar.solver.problem import Problem, ValueKey
from autopar.strategies import Strategy
from autopar.values import tensor_inputs, value_of

R = Replicate()


@dataclass(frozen=True)
class StagePrediction:
    """One pipeline stage, per microbatch unless noted (modelled)."""

    layers: tuple[int, ...]
    forward_s: float
    backward_s: float  # including recomputation
    tp_comm_s: float
    activations_per_microbatch: float
    in_flight: float  # microbatches whose activations the stage holds at its peak
    memory: MemoryBreakdown


@dataclass(frozen=True)
class Prediction:
    """Modelled figures of one plan; times per optimizer step unless noted."""

    step_time_s: float
    compute_s: float  # forward + backward (+ recomputation) of all microbatches, slowest stage
    tp_comm_s: float  # tensor-parallel collectives, all microbatches (not overlapped)
    dp_comm_s: float  # data-parallel / ZeRO collectives
    dp_exposed_s: float  # the part of dp_comm_s not hidden behind backward
    memory: MemoryBreakdown  # of the stage with the highest peak
    bubble_s: float = 0.0
    p2p_s: float = 0.0
    stages: tuple[StagePrediction, ...] = field(default=())
    optimizer_s: float = 0.0  # the optimizer's step over this device's parameters
    # bytes each repeated layer keeps for backward per microbatch, under the recomputation
    # in force (Korthikanti et al.'s per-layer activation memory)
    layer_activations: dict[int, float] = field(default_factory=dict)

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total


def needed_placements(problem: Problem, choice: list[int], key: ValueKey,
                      tables: CostTables | None = None) -> dict[Placement, dict]:
    """Placements the consumers of ``key`` need, each with flags: kept for backward by a
    consumer (under the recomputation in force), read by sharded computation (a partial
    gradient comes back), and read only by sharded computation."""
    out: dict[Placement, dict] = {}
    for use in problem.values[key].uses:
        if use.consumer < 0:
            flags = out.setdefault(R, {"saved": False, "partial_grad": False, "only_sharded": True})
            flags["only_sharded"] = False
            continue
        s = problem.decisions[use.consumer].candidates[choice[use.consumer]]
        q = s.inputs[use.slot]
        flags = out.setdefault(q, {"saved": False, "partial_grad": False, "only_sharded": True})
        flags["saved"] |= tables.keeps(use, key) if tables is not None else use.saves
        sharded = q == R and sharded_compute(s)
        flags["partial_grad"] |= sharded
        flags["only_sharded"] &= sharded
    return out


def chosen(problem: Problem, choice: list[int], index: int) -> Strategy:
    return problem.decisions[index].candidates[choice[index]]


def stage_of_layers(layers: list[int], pp: int) -> dict[int, int]:
    """Layer index -> stage: contiguous, equal counts (the first stages take the remainder)."""
    out = {}
    per, extra = divmod(len(layers), pp)
    i = 0
    for stage in range(pp):
        for _ in range(per + (1 if stage < extra else 0)):
            out[layers[i]] = stage
            i += 1
    return out


class _StageMap:
    def __init__(self, gm: fx.GraphModule, pp: int):
        layers = sorted({n.meta[META_KEY].layer for n in gm.graph.nodes
                         if META_KEY in n.meta and n.meta[META_KEY].layer is not None})
        self.pp = pp
        self.by_layer = stage_of_layers(layers, pp) if layers else {}
        self.stage: dict[str, int] = {}
        seen_layer = False
        for node in gm.graph.nodes:
            facts = node.meta.get(META_KEY)
            layer = facts.layer if facts is not None else None
            if layer is not None:
                self.stage[node.name] = self.by_layer[layer]
                seen_layer = seen_layer or node.op != "get_attr"
            else:
                self.stage[node.name] = (pp - 1) if seen_layer else 0
        self.layers_of = defaultdict(list)
        for layer, stage in self.by_layer.items():
            self.layers_of[stage].append(layer)


def evaluate(tables: CostTables, choice: list[int]) -> Prediction:
    problem, setting = tables.problem, tables.setting
    pp, n_tp = setting.pp, setting.tp
    stages = _StageMap(problem.gm, pp)
    fwd = [0.0] * pp
    bwd = [0.0] * pp
    act = [0.0] * pp
    params = [0.0] * pp
    grads = [0.0] * pp
    opt = [0.0] * pp
    grad_bytes = [0.0] * pp
    weights = [0.0] * pp
    largest = [0.0] * pp  # the largest tensor a node makes (local, per microbatch)
    trainable_numel = [0.0] * pp
    layer_act: dict[int, float] = defaultdict(float)  # activations of one layer, no recompute
    layer_kept: dict[int, float] = defaultdict(float)  # ... under the recomputation in force
    for d in problem.decisions:
        s = d.candidates[choice[d.index]]
        f, b, r = tables.times(d, s)
        own = tables.own_activation(d, s)
        own_plain = tables.own_activation(d, s, recompute=False)
        st = tables.states(d, s)
        g, w = tables.grad_bytes(d, s), tables.weight_bytes(d, s)
        out = tables.local_output_bytes(d, s) if d.kind == "op" and d.facts.requires_grad else 0.0
        numel = tables.trainable_numel(d, s)
        for node in d.nodes:
            k = stages.stage[node.name]
            largest[k] = max(largest[k], out)
            trainable_numel[k] += numel
            fwd[k] += f
            bwd[k] += b + r
            act[k] += own
            params[k] += st.params
            grads[k] += st.grads
            opt[k] += st.optimizer
            grad_bytes[k] += g
            weights[k] += w
            layer = node.meta[META_KEY].layer
            if layer is not None:
                layer_act[layer] += own_plain
                layer_kept[layer] += own

    tp_comm = [0.0] * pp
    for key in problem.values:
        producer = problem.decisions[key[0]]
        src = chosen(problem, choice, key[0]).outputs[key[1]]
        per_instance_comm = 0.0
        per_instance_saved = 0.0
        plain_saved = 0.0  # what the consumers would keep without recomputation
        for q, flags in needed_placements(problem, choice, key).items():
            if flags["saved"]:
                sp = q == R and isinstance(src, Shard) and flags["only_sharded"]
                plain_saved += tables.saved_bytes(key, src if sp else q)
        for q, flags in needed_placements(problem, choice, key, tables).items():
            if q != src:
                per_instance_comm += tables.redistribution(key, src, q)
            if flags["partial_grad"]:
                per_instance_comm += tables.partial_grad(key, src)
            if flags["saved"]:
                if q == R and isinstance(src, Shard) and flags["only_sharded"]:
                    # Sequence parallelism: the gathered copy is kept as its shard and
                    # gathered again in backward.
                    per_instance_saved += tables.saved_bytes(key, src)
                    per_instance_comm += collective_time(
                        "all_gather", tables.value_bytes(key), n_tp, tables.tp_link,
                        backend=tables.cluster.backend)
                else:
                    per_instance_saved += tables.saved_bytes(key, q)
        for node in producer.nodes:
            k = stages.stage[node.name]
            tp_comm[k] += per_instance_comm
            act[k] += per_instance_saved
            layer = node.meta[META_KEY].layer
            if layer is not None:
                layer_act[layer] += plain_saved
                layer_kept[layer] += per_instance_saved

    p2p = _p2p_times(tables, choice, stages) if pp > 1 else [0.0] * pp
    gathered_outputs = _gathered_outputs(tables, choice)
    m = setting.microbatches
    stage_preds = []
    for k in range(pp):
        flight = in_flight(setting.schedule, pp, m, k, setting.virtual) if pp > 1 else 1.0
        transient = 0.0
        if setting.recompute == "full" and stages.layers_of[k]:
            transient = max(layer_act[i] for i in stages.layers_of[k])
        memory = peak_phase(tables, params[k], grads[k], opt[k], act[k] * flight, transient,
                            largest[k], trainable_numel[k], gathered_outputs if k == pp - 1 else 0.0)
        stage_preds.append(StagePrediction(tuple(stages.layers_of[k]), fwd[k], bwd[k],
                                           tp_comm[k], act[k], flight, memory))

    per_micro = [fwd[k] + bwd[k] + tp_comm[k] + p2p[k] for k in range(pp)]
    slowest = max(range(pp), key=lambda k: per_micro[k])
    bubble = bubble_fraction(setting.schedule, pp, m, setting.virtual) * m * per_micro[slowest] if pp > 1 else 0.0
    dp_comm, dp_exposed, buffers = data_parallel_costs(
        tables, grad_bytes[slowest], weights[slowest], fwd[slowest], bwd[slowest],
        _gathered_peak(tables, choice, stages, slowest))
    owned = trainable_numel[slowest] / (setting.dp if setting.zero >= 1 else 1)
    optimizer_s = optimizer_step_time(owned, tables.options.optimizer, tables.cluster.device)
    step = m * per_micro[slowest] + bubble + dp_exposed + optimizer_s
    peak_stage = max(range(pp), key=lambda k: stage_preds[k].memory.total + buffers)
    mem = stage_preds[peak_stage].memory
    memory = MemoryBreakdown(mem.params, mem.grads, mem.optimizer, mem.activations, buffers,
                             temporaries=mem.temporaries)
    return Prediction(
        step_time_s=step,
        compute_s=m * (fwd[slowest] + bwd[slowest]),
        tp_comm_s=m * tp_comm[slowest],
        dp_comm_s=dp_comm,
        dp_exposed_s=dp_exposed,
        memory=memory,
        bubble_s=bubble,
        p2p_s=m * p2p[slowest],
        stages=tuple(stage_preds),
        layer_activations=dict(layer_kept),
        optimizer_s=optimizer_s,
    )


def peak_phase(tables: CostTables, params: float, grads: float, optimizer: float,
               activations: float, recompute_transient: float, largest: float,
               trainable_numel: float, gathered_outputs: float) -> MemoryBreakdown:
    """The largest of the peaks of a training step, with what is alive at it.

    - When forward ends: weights, optimizer states, every kept activation, and the graph's
      outputs gathered whole for the caller (e.g. logits sharded over tp).
    - When backward starts: the same, with the gradient of the loss's input plus one working
      copy (twice the largest activation) instead of the gathered outputs; later, a fully
      recomputed layer's activations come back one layer at a time (not at the same time).
    - During the optimizer step: weights, gradients, states, and the optimizer's scratch
      (one fp32 tensor per trainable weight: foreach AdamW's intermediate).

    Gradients count before the optimizer step only if they outlive it (DDP's buckets,
    accumulation over microbatches, ZeRO's sharded gradients).
    """
    setting = tables.setting
    grads_alive = setting.microbatches > 1 or (setting.dp > 1) or setting.zero > 0
    live_grads = grads if grads_alive else 0.0
    phases = [
        MemoryBreakdown(params, live_grads, optimizer, activations, 0.0,
                        temporaries=gathered_outputs),
        MemoryBreakdown(params, live_grads, optimizer, activations, 0.0,
                        temporaries=max(2 * largest, recompute_transient)),
        MemoryBreakdown(params, grads, optimizer, 0.0, 0.0,
                        temporaries=trainable_numel * 4 / (setting.dp if setting.zero >= 1 else 1)),
    ]
    return max(phases, key=lambda m: m.total)


def _gathered_outputs(tables: CostTables, choice: list[int]) -> float:
    """Bytes the graph's outputs take when made whole on tp for the caller: the gathered
    copy, the local part it was gathered from (alive until the step drops the outputs), and
    the per-rank parts while they are concatenated (any dim but the first)."""
    problem = tables.problem
    total = 0.0
    for key, info in problem.values.items():
        if not any(use.consumer < 0 for use in info.uses):
            continue
        src = chosen(problem, choice, key[0]).outputs[key[1]]
        n = tables.setting.tp
        if isinstance(src, Shard) and n > 1:
            whole = tables.value_bytes(key)
            total += whole * (1 + 1 / n + (0 if src.dim == 0 and src.groups == 1 else 1))
    return total


def _p2p_times(tables: CostTables, choice: list[int], stages: _StageMap) -> list[float]:
    """Per stage and microbatch: sending activations forward and their gradients back across
    each stage boundary (point-to-point between neighbouring stages)."""
    problem = tables.problem
    out = [0.0] * stages.pp
    link = tables.cluster.inter_node if tables.cluster.nodes > 1 else tables.cluster.intra_node
    for node in problem.gm.graph.nodes:
        if node.name not in problem.decision_of:
            continue
        k = stages.stage[node.name]
        for a in tensor_inputs(node):
            producer, index = value_of(a)
            j = stages.stage.get(producer.name, k)
            if j == k or producer.op == "get_attr":
                continue
            key = (problem.decision_of[producer.name], index)
            p = chosen(problem, choice, key[0]).outputs[index]
            nbytes = tables.value_bytes(key) / divisor(p, tables.setting.tp)
            t = nbytes / link.bandwidth_bytes_per_s + link.latency_s
            out[j] += t
            if tables.requires_grad(key):
                out[k] += t
    return out


def _gathered_peak(tables: CostTables, choice: list[int], stages: _StageMap, k: int) -> float:
    """Weights FSDP2 holds whole at once on stage ``k``: the root's and two layers'."""
    problem = tables.problem
    root = 0.0
    per_layer: dict[int, float] = defaultdict(float)
    for d in problem.decisions:
        w = tables.weight_bytes(d, d.candidates[choice[d.index]])
        if not w:
            continue
        for node in d.nodes:
            if stages.stage[node.name] != k:
                continue
            layer = node.meta[META_KEY].layer
            if layer is None:
                root += w
            else:
                per_layer[layer] += w
    return root + 2 * max(per_layer.values(), default=0.0)


def data_parallel_costs(
    tables: CostTables, grad_bytes: float, weight_bytes: float, fwd: float, bwd: float,
    gathered_peak: float,
) -> tuple[float, float, float]:
    """(dp communication, its exposed part, buffer bytes) for the setting's ZeRO stage.

    Stage 0 (DDP): one all-reduce of the gradients per step, overlapped with the last
    microbatch's backward. Stages 1 and 2: a reduce-scatter of the gradients and an
    all-gather of the updated weights per step, overlapped the same way. Stage 3 (FSDP2): every microbatch all-gathers the weights for
    forward and again for backward and reduce-scatters the gradients, overlapped with that
    microbatch's compute.
    """
    setting = tables.setting
    if setting.dp <= 1:
        return 0.0, 0.0, 0.0
    m = setting.microbatches

    def dp_time(kind: str, nbytes: float) -> float:
        return group_collective_time(kind, nbytes, setting.mesh, "dp", tables.cluster)

    buckets = ddp_buffer_bytes(grad_bytes, gradient_as_bucket_view=True)
    # gloo on CPU moves data with the same cores that compute (one thread per process):
    # its collectives do not overlap the backward pass there.
    window = 0.0 if tables.cluster.backend == "gloo" else bwd
    if setting.zero == 0:
        comm = dp_time("all_reduce", grad_bytes)
        return comm, max(0.0, comm - window), buckets
    if setting.zero in (1, 2):
        # Reduce-scatter the gradients, update the local shard, all-gather the weights:
        # the volume of one all-reduce, once per step.
        comm = dp_time("reduce_scatter", grad_bytes) + dp_time("all_gather", weight_bytes)
        return comm, max(0.0, comm - window), buckets
    per_micro = 2 * dp_time("all_gather", weight_bytes) + dp_time("reduce_scatter", grad_bytes)
    exposed = m * max(0.0, per_micro - (0.0 if tables.cluster.backend == "gloo" else fwd + bwd))
    return m * per_micro, exposed, gathered_peak
