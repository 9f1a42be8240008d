"""Insert collectives where a consumer needs a placement its producer does not give.

For every value and every distinct placement its consumers need, one redistributed copy is
made right after the producer and shared by those consumers (so three projections reading
one gathered input gather it once). On ``tp``, a replicated copy read by sharded computation
(a column-parallel matmul) goes through ``grad_all_reduce`` — or, when it was gathered from
a shard and only sharded computation reads it, the gather itself reduce-scatters the
gradient (sequence parallelism). The graph's outputs are made whole on ``tp``.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.analysis.plan_view import PlanView
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Replicate, Shard
from autopar.core.values import tensor_inputs, training_output, value_of
from autopar.ops import comm_ops
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.strategies.mutation import check_tied

R = Replicate()
TP = "tp"


def _sharded_compute(view: PlanView, node: fx.Node, axis: str) -> bool:
    s = view.strategy(node, axis)
    return s is not None and s.splits_work


def _needs(view: PlanView, node: fx.Node, slot: int, axis: str):
    s = view.strategy(node, axis)
    return None if s is None or node.op != "call_function" else s.inputs[slot]


def replace_tensor_inputs(node: fx.Node, new_by_slot: dict[int, fx.Node]) -> None:
    """Replace tensor inputs of ``node`` by slot (flattened order, as strategies count)."""
    leaves, spec = tree_flatten((node.args, node.kwargs))
    originals = set(tensor_inputs(node))
    slot = -1
    for i, a in enumerate(leaves):
        if isinstance(a, fx.Node) and a in originals:
            slot += 1
            if slot in new_by_slot:
                leaves[i] = new_by_slot[slot]
    node.args, node.kwargs = tree_unflatten(leaves, spec)


def _weight_key(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """The identity of the tensor a ``get_attr`` node reads (tied weights share one)."""
    if node.op != "get_attr":
        return None
    try:
        return id(gm.get_parameter(node.target))
    except AttributeError:
        return None


def _weight_reads(gm: fx.GraphModule, requests: dict) -> dict[int, int]:
    """How many consumer slots read each weight, over every ``get_attr`` that names it."""
    reads: dict[int, int] = defaultdict(int)
    for (a, _), consumers in requests.items():
        key = _weight_key(gm, value_of(a)[0])
        if key is not None:
            reads[key] += len(consumers)
    return reads


def redistribution_steps(axes: list[str], have: tuple, need: tuple) -> list[tuple]:
    """The per-axis moves ``(axis, src, dst)`` that take a value from ``have`` to ``need``
    (one placement per axis, outer to inner), in an order that keeps it right.

    A local tensor is cut outer axis first: under ``cp S(2)`` and ``tp S(2)`` a device holds
    the ``tp`` piece of its ``cp`` piece. A move on an outer axis along a dim an inner axis
    also splits (a whole rotary table sliced to the sequence over ``cp`` while ``tp`` splits
    it too) would cut the wrong tokens, so the inner axes are made whole first, innermost
    first, and are split again after the outer move. (The planner prices each axis's move
    alone; the detour gathers only tensors that do not follow the sequence split, such as
    rotary tables and masks, which are small.)

    >>> from autopar.core.placements import parse_placement as p
    >>> [(ax, str(s), str(d)) for ax, s, d in redistribution_steps(
    ...     ["cp", "tp"], (p("R"), p("S(2)")), (p("S(2)"), p("S(2)")))]
    [('tp', 'S(2)', 'R'), ('cp', 'R', 'S(2)'), ('tp', 'R', 'S(2)')]
    """
    now = list(have)
    opened: list[int] = []
    for i in range(len(axes)):
        if now[i] == need[i]:
            continue
        dims = {p.dim for p in (now[i], need[i]) if isinstance(p, Shard)}
        for j in range(i + 1, len(axes)):
            if isinstance(now[j], Shard) and now[j].dim in dims:
                opened.append(j)
                now[j] = R
    steps = [(axes[j], have[j], R) for j in sorted(opened, reverse=True)]
    return steps + [(ax, src, dst) for ax, src, dst in zip(axes, now, need) if src != dst]


@register_pass
class InsertCollectives(GraphPass):
    name = "insert-collectives"
    requires = ("localize-shapes",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        view = PlanView(gm, ctx.plan)
        axes = [a for a in view.axes if view.size(a) > 1]
        if not axes:
            return PassResult(gm, modified=False)
        graph = gm.graph
        for ax in axes:  # a hand-edited plan may redistribute what an in-place op writes
            check_tied(graph, lambda a, ax=ax: view.placement(a, ax),
                       lambda c, slot, ax=ax: _needs(view, c, slot, ax), ax)
        # (input node, needed placement per axis) -> consumers as (node, slot, sharded on tp)
        requests: dict[tuple, list[tuple[fx.Node, int, bool]]] = defaultdict(list)
        for node in list(graph.nodes):
            if node.op == "output":
                for slot, a in enumerate(tensor_inputs(node)):
                    need = tuple(R if ax == TP else view.placement(a, ax) for ax in axes)
                    requests[(a, need)].append((node, slot, False))
                continue
            if view.strategy(node, axes[0]) is None or node.op != "call_function":
                continue
            sharded = _sharded_compute(view, node, TP) if TP in axes else False
            for slot, a in enumerate(tensor_inputs(node)):
                need = tuple(view.strategy(node, ax).inputs[slot] for ax in axes)
                requests[(a, need)].append((node, slot, sharded))

        reads = _weight_reads(gm, requests)
        changes: list[str] = []
        replacements: dict[fx.Node, dict[int, fx.Node]] = defaultdict(dict)
        position = {n: i for i, n in enumerate(graph.nodes)}
        for (a, need), consumers in requests.items():
            have = tuple(view.placement(a, ax) for ax in axes)
            producer = value_of(a)[0]
            requires_grad = producer.meta[META_KEY].requires_grad if META_KEY in producer.meta else False
            current = a
            # Right before the first reader: a weight is gathered when it is used, and the
            # copy sits with the layer that reads it (where outlining puts it).
            first = min((c[0] for c in consumers), key=lambda n: position[n])
            sharded_users = [c for c in consumers if c[2]]
            needs_grad_sync = TP in axes and requires_grad and bool(sharded_users) and (
                need[axes.index(TP)] == R
            )
            # an output only the forward's caller reads: a training step skips making it
            # whole (comm_ops.outputs_unused)
            move = (comm_ops.redistribute_output
                    if all(c[0].op == "output" for c in consumers) and not training_output(a)
                    else comm_ops.redistribute)
            for ax, src, dst in redistribution_steps(axes, have, need):
                fused = (
                    ax == TP and needs_grad_sync and isinstance(src, Shard)
                    and len(sharded_users) == len(consumers)
                )
                with graph.inserting_before(first):
                    if fused:
                        current = graph.call_function(
                            comm_ops.gather_scatter_grad, (current, ax, str(src))
                        )
                        needs_grad_sync = False
                    else:
                        current = graph.call_function(move, (current, ax, str(src), str(dst)))
                current.meta["val"] = a.meta.get("val")
                changes.append(f"{a.name}: {src} -> {dst} on {ax} ({current.name})")
            synced = current
            if needs_grad_sync:
                # The sum may wait for the end of the step only where every read of the
                # weight is a partial one: deferred, it sums the whole accumulated .grad,
                # and a whole term from another reader would be counted once per device.
                key = _weight_key(gm, producer) if current is a else None
                weight = key is not None and len(sharded_users) == reads[key]
                # right before the first sharded reader: a buffer written in place through
                # views (``new_empty`` then ``copy_`` into slices) is complete only there,
                # and autograd forbids reading a custom Function's view of an earlier state
                first_sharded = min((c[0] for c in sharded_users), key=lambda n: position[n])
                with graph.inserting_before(first_sharded):
                    synced = graph.call_function(comm_ops.grad_all_reduce, (current, TP, weight))
                synced.meta["val"] = a.meta.get("val")
                changes.append(f"{a.name}: gradient all-reduce on tp for sharded readers "
                               f"({synced.name})")
            if synced is a:
                continue
            for consumer, slot, sharded in consumers:
                replacements[consumer][slot] = synced if sharded else current
        for consumer, new_by_slot in replacements.items():
            replace_tensor_inputs(consumer, new_by_slot)
        return PassResult(gm, modified=bool(changes), changes=changes)
