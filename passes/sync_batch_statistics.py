"""Execute the plan's placement changes on the batch axis, so split batches train exactly.

Each data-parallel rank runs the graph on its own sequences, each microbatch on its share of
them, each context-parallel rank on some tokens of each. A reduction over the batch (a mean
of router probabilities, a token count per expert, a count of labelled tokens) then gives
that part's share of the value: ``Partial`` on ``dp`` in the plan. Where a consumer needs
another kind of partial, or a whole value as a partial, the change is local: the batch is
split into ``dp x microbatches`` equal parts, so a share of a sum times their number is a
share of their mean, and a whole value read as a share of a sum is divided by it (a loss
summed over tokens plus a balancing term read whole). Where the plan has a consumer need
the value itself whole (a product of two batch means in a load-balancing loss, a loss
divided by its count of tokens), this pass makes it whole:

- a statistic of the inputs alone (:func:`autopar.analysis.step_statistics.from_inputs`) is computed
  for the whole step before it runs: its nodes are copied into the program's prologue, and
  the consumer reads :func:`~autopar.analysis.step_statistics.step_statistic`, the sum over every
  microbatch and every rank it is split over (``dp``, and ``cp`` where the tokens are);
- any other is all-reduced over the data-parallel group inside the forward, with the
  backward that keeps every rank's gradient that of the global batch
  (:mod:`autopar.ops.comm_ops`); a batch norm takes its statistics over the group
  (:func:`autopar.ops.local_ops.sync_batch_norm`). The planner allowed these only with one
  microbatch per rank.

A partial value that only reaches the loss linearly is left alone: gradient averaging
already makes it exact (``passes/mean_loss`` makes the loss itself one the runtime may
average). Runs after the collectives of the other axes are in, reading through them to
each value's producer.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.analysis.step_statistics import (
    META,
    Statistic,
    StepStatistics,
    from_inputs,
    parts_scaled,
    reduce_of,
    step_statistic,
)
from autopar.core.errors import PassError
from autopar.core.placements import Partial, Replicate, parse_placement
from autopar.core.values import tensor_inputs, value_of
from autopar.ops import comm_ops
from autopar.ops.local_ops import SYNC_BATCH_NORM
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.insert_collectives import replace_tensor_inputs
from autopar.passes.substitute_local_ops import substitute_sync_batch_norm

DP = "dp"
_COMM = (comm_ops.redistribute, comm_ops.redistribute_output, comm_ops.grad_all_reduce,
         comm_ops.gather_scatter_grad)


def needs_sync(plan) -> bool:
    """Is the batch of ``plan``'s program split (over ranks, tokens or microbatches)?"""
    return plan.mesh.get(DP, 1) * plan.mesh.get("cp", 1) * int(
        plan.batch.get("microbatches", 1)) > 1


@register_pass
class SyncBatchStatistics(GraphPass):
    name = "sync-batch-statistics"
    requires = ("insert-collectives",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        plan = ctx.plan
        if plan.mesh.get(DP, 1) * int(plan.batch.get("microbatches", 1)) == 1:
            # one part of the batch: its partial values are whole (a cp split of the
            # tokens is made whole by the collectives of the cp axis)
            return PassResult(gm, modified=False)
        graph = gm.graph
        synced: dict[tuple[fx.Node, int], fx.Node] = {}
        scaled: dict[tuple[fx.Node, str], fx.Node] = {}
        step: list[tuple[fx.Node, Statistic]] = []  # the prologue's outputs
        inputs_only: dict[fx.Node, bool] = {}
        changes: list[str] = []
        # batch_coupling "local": each rank keeps its own statistics, as under DDP
        exact = plan.training.get("batch_coupling", "exact") == "exact"
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target in _COMM:
                continue
            strategy = plan.strategy(node.name, DP)
            if strategy is None:
                continue
            if strategy.local_impl == SYNC_BATCH_NORM and plan.mesh.get(DP, 1) > 1 and exact:
                substitute_sync_batch_norm(node, DP)
                changes.append(f"{node.name}: batch norm synchronised over dp")
            new_by_slot: dict[int, fx.Node] = {}
            for slot, a in enumerate(tensor_inputs(node)):
                need = strategy.inputs[slot]
                root, chain = through_collectives(a)
                producer, index = value_of(root)
                made = plan.strategy(producer.name, DP)
                have = made.outputs[index] if made and index < len(made.outputs) else None
                power = _local_change(have, need)
                if power is not None:
                    if power:  # linear: it commutes with the collectives of other axes
                        skey = (a, str(need))
                        if skey not in scaled:
                            scaled[skey] = _scale(graph, a, node, plan.mesh.get(DP, 1), power)
                            changes.append(f"{root.name}: {have} -> {need} on the batch's "
                                           "parts (a local scaling)")
                        new_by_slot[slot] = scaled[skey]
                    continue
                if not isinstance(have, Partial) or isinstance(need, Partial):
                    continue
                if not isinstance(need, Replicate):
                    raise PassError(
                        f"{node.name} needs {root.name} as {need} on dp, made as {have}: a batch "
                        "statistic is only made whole here",
                        where=f"strategies.{node.name}.dp",
                        fix="re-plan this model: the planner makes batch statistics whole")
                key = (producer, index)
                if key not in synced:
                    if from_inputs(producer, inputs_only):
                        synced[key] = self._step_statistic(gm, root, producer, index, have,
                                                           plan, step)
                        changes.append(f"{root.name}: batch statistic of the inputs, taken "
                                       f"over the whole step ({synced[key].name})")
                    elif plan.mesh.get(DP, 1) > 1 and exact:
                        with graph.inserting_after(root):
                            sync = graph.call_function(comm_ops.redistribute,
                                                       (root, DP, str(have), "R"))
                        sync.meta["val"] = root.meta.get("val")
                        synced[key] = sync
                        changes.append(f"{root.name}: batch statistic {have} -> R on dp "
                                       f"({sync.name})")
                    else:
                        continue
                sync = synced[key]
                if sync.target is step_statistic:
                    _check_chain(a, root, node)
                    new_by_slot[slot] = sync  # whole on every axis: no collective after it
                elif chain is None:
                    new_by_slot[slot] = sync
                else:
                    chain.replace_input_with(root, sync)
            if new_by_slot:
                replace_tensor_inputs(node, new_by_slot)
        if step:
            _drop_unused_collectives(graph)
            gm.meta[META] = _prologue(gm, step)
        return PassResult(gm, modified=bool(changes), changes=changes)

    @staticmethod
    def _step_statistic(gm: fx.GraphModule, root: fx.Node, producer: fx.Node, index: int,
                        have: Partial, plan, step: list) -> fx.Node:
        """A ``step_statistic`` node reading ``root``, and its entry in the prologue."""
        reduce = [("batch", reduce_of(have))]
        if plan.mesh.get(DP, 1) > 1:
            reduce.append((DP, reduce_of(have)))
        for axis in ("cp", "tp"):
            s = plan.strategy(producer.name, axis) if plan.mesh.get(axis, 1) > 1 else None
            p = s.outputs[index] if s is not None and index < len(s.outputs) else None
            if isinstance(p, Partial):
                reduce.append((axis, reduce_of(p)))
        key = f"{producer.name}:{index}"
        axes = tuple(f"{axis}:{r}" for axis, r in reduce if axis != "batch")
        with gm.graph.inserting_after(root):
            node = gm.graph.call_function(step_statistic, (root, key, axes))
        node.meta["val"] = root.meta.get("val")
        step.append((root, Statistic(key, tuple(reduce))))
        return node


def _local_change(have, need) -> int | None:
    """The power of the batch's parts taking a value from ``have`` to ``need`` on the batch
    axis where that is a local scaling (None where it is not: a statistic made whole, or no
    change). A share of a sum counts 1, a share of a mean (or a whole value, read as one)
    the number of parts."""
    units = {Partial("sum"): 0, Partial("avg"): 1, Replicate(): 1}
    if have == need or not isinstance(need, Partial) or have not in units or need not in units:
        return None
    return units[need] - units[have]


def _scale(graph: fx.Graph, value: fx.Node, before: fx.Node, dp: int, power: int) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(parts_scaled, (value, dp, power))
    node.meta["val"] = value.meta.get("val")
    return node


def through_collectives(a: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """The value ``a`` was redistributed from on other axes, and the first collective that
    reads it (None when ``a`` is the value itself)."""
    first = None
    while a.op == "call_function" and a.target in _COMM:
        first, a = a, a.args[0]
    return a, first


def _check_chain(a: fx.Node, root: fx.Node, consumer: fx.Node) -> None:
    """The collectives from ``root`` to ``a`` only make partial values whole (what the step
    statistic does for every axis at once)."""
    while a is not root:
        moves = a.target is comm_ops.redistribute and isinstance(
            parse_placement(a.args[2]), Partial) and isinstance(parse_placement(a.args[3]),
                                                                Replicate)
        if not moves:
            raise PassError(
                f"{consumer.name} reads the batch statistic {root.name} through {a.name} "
                f"({a.target.__name__}{tuple(a.args[1:])}), which the step's value cannot "
                "stand for",
                where=f"strategies.{consumer.name}",
                fix="re-plan this model; report it with the plan (autopar plan --json)")
        a = a.args[0]


def _drop_unused_collectives(graph: fx.Graph) -> None:
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _COMM and not node.users:
            graph.erase_node(node)


def _prologue(gm: fx.GraphModule, step: list[tuple[fx.Node, Statistic]]) -> StepStatistics:
    """The program's inputs -> each statistic's share: the nodes computing them, copied."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed: set[fx.Node] = set()
    todo = [root for root, _ in step]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        elif node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[root] for root, _ in step))
    return StepStatistics(fx.GraphModule(gm, graph, "StepStatistics"),
                          tuple(stat for _, stat in step))
