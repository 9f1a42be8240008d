"""Placements on the data-parallel axis: the batch dimension, propagated from the inputs.

Data parallelism splits the batch: inputs are sharded on dim 0 and every op keeps its batch
dimension sharded where its sharding rule allows it without communication. For each node
this picks, among the rule's strategies on the ``dp`` axis, the one needing the least
communication from its producers (a slice of a replicated tensor is free), then the fewest
redistributions, then the most sharded outputs. Parameters stay replicated on ``dp`` (ZeRO
shards their storage, not their use). The result is deterministic: no choice is left for the
solver on this axis.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from autopar.graph_facts import META_KEY
from autopar.placements import Partial, Placement, Replicate, Shard
from autopar.strategies import Strategy, strategies_for
from autopar.strategies.calls import op_call
from autopar.strategies.factories import makes_constant
from autopar.values import is_decision, tensor_inputs, value_of

R = Replicate()


def batch_strategies(gm: fx.GraphModule, batch_size: int | None) -> dict[str, Strategy]:
    """Node name -> strategy on the dp axis, for every decision node.

    It marks where the batch dimension is, propagated as if the traced batch were split
    into single sequences — the same for every data-parallel degree (microbatches cut the
    batch too, so it is marked even without data parallelism). A graph traced on one
    sequence has no batch dimension to find: everything is replicated."""
    split = batch_size if batch_size and batch_size > 1 else 1
    return propagate_input_dim(gm, split, batch_size, dim=0)


def propagate_input_dim(
    gm: fx.GraphModule, n: int, size: int | None, dim: int, *, follow_only: bool = False,
    overrides: Mapping[str, Strategy] | None = None,
) -> dict[str, Strategy]:
    """Shard dimension ``dim`` of every input whose ``dim`` has ``size`` over ``n`` devices
    and carry that sharding through the graph as far as rules allow without communication.

    ``dim=0`` is the batch (data parallelism); ``dim=1`` of token inputs is the sequence,
    which tells where the sequence dimension of every tensor is. ``follow_only``: an op
    whose inputs are all replicated stays replicated (otherwise a free slice may shard it,
    e.g. positions expanded over the batch): what context parallelism executes, where
    only tensors that follow the sequence are split. ``overrides``: node name -> the
    strategy it runs whatever its rule offers (an attention site under context parallelism
    reads its keys and values split, its op passing them between ranks).
    """
    chosen: dict[str, Strategy] = {}
    for node in gm.graph.nodes:
        if not is_decision(node):
            continue
        facts = node.meta[META_KEY]
        if node.op == "placeholder":
            shape = facts.shapes[0]
            sharded = (
                n > 1 and size is not None and len(shape) > dim and shape[dim] == size
                and size % n == 0
            )
            chosen[node.name] = Strategy((), (Shard(dim) if sharded else R,))
            continue
        if node.op == "get_attr" or n == 1:
            n_in = len(tensor_inputs(node)) if node.op == "call_function" else 0
            chosen[node.name] = Strategy((R,) * n_in, (R,) * len(facts.shapes))
            continue
        if overrides and node.name in overrides:
            chosen[node.name] = overrides[node.name]
            continue
        inputs = tensor_inputs(node)
        produced = [_placement(chosen, a) for a in inputs]
        sizes = [_nbytes(a) for a in inputs]
        candidates = strategies_for(op_call(node), n)
        if makes_constant(node.target) or (follow_only and all(p == R for p in produced)):
            # a constant has no batch dim to follow
            candidates = [s for s in candidates if all(o == R for o in s.outputs)] or candidates
        chosen[node.name] = min(
            enumerate(candidates), key=lambda item: _score(item, produced, sizes, follow_only)
        )[1]
    return chosen


def _score(item: tuple[int, Strategy], produced: list[Placement], sizes: list[int],
           follow_only: bool = False) -> tuple:
    """Least communication, then fewest redistributions, then most sharded outputs (with
    ``follow_only``, fewest: a tensor whose split cannot be kept is gathered, not re-split
    along another dim, which would not be the sequence)."""
    index, s = item
    comm = moves = 0
    for have, need, size in zip(produced, s.inputs, sizes):
        if have == need:
            continue
        moves += 1
        if not (isinstance(have, Replicate) and isinstance(need, Shard)):
            comm += size
    sharded = sum(1 for p in s.outputs if not isinstance(p, Replicate))
    return (comm, moves, sharded if follow_only else -sharded, index)


def _nbytes(node: fx.Node) -> int:
    facts = node.meta[META_KEY]
    n = 1
    for d in facts.shapes[0] if facts.shapes else ():
        n *= d
    return max(n, 1)


def _placement(chosen: dict[str, Strategy], node: fx.Node) -> Placement:
    producer, index = value_of(node)
    strategy = chosen.get(producer.name)
    if strategy is None or index >= len(strategy.outputs):
        return R
    return strategy.outputs[index]


def batch_scaled(placement: Placement) -> bool:
    """Does a value with this dp placement shrink with the (micro)batch?"""
    return isinstance(placement, (Shard, Partial))
