"""Analysis shared by the sharding passes: the plan's placements, node by node.

Read-only: it answers "what placement does this value have on this axis", "what does this
node need", and "what is this node's local shape on this rank", and never edits the graph.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.core.errors import PlanError
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Placement, Replicate, Shard, local_shape
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.core.values import is_decision, value_of

R = Replicate()


class PlanView:
    def __init__(self, gm: fx.GraphModule, plan: Plan):
        self.gm = gm
        self.plan = plan
        # Placement axes. The pipeline axis has none (it cuts the graph); nor has the
        # data-parallel one here: per-rank programs are traced on one microbatch, so the
        # batch is already local, and DDP/FSDP2 do the data-parallel communication.
        # ``ep`` is carved out of dp (its token moves are the expert-parallel pass's).
        self.axes = [a for a in plan.mesh if a not in ("pp", "dp", "ep")] or ["tp"]
        self._strategies: dict[tuple[str, str], Strategy] = {}
        # The graph holds one microbatch: a dim that holds the batch holds fewer sequences
        scale = max(plan.batch.get("traced", 1) // max(plan.batch.get("microbatch", 1), 1), 1)
        for node in gm.graph.nodes:
            if not is_decision(node):
                continue
            if node.name not in plan.strategies:
                raise PlanError(
                    f"the plan has no strategy for node {node.name!r} "
                    f"({node.meta.get(META_KEY).target if META_KEY in node.meta else node.target})",
                    where=f"strategies.{node.name}",
                    fix="the plan was made for a different graph; re-plan for this model "
                    "and these example inputs",
                )
            batch = plan.strategy(node.name, "dp")
            for axis in self.axes:
                s = plan.strategy(node.name, axis)
                if s is not None:
                    self._strategies[(node.name, axis)] = _per_microbatch(s, batch, scale)

    def size(self, axis: str) -> int:
        return self.plan.mesh[axis]

    def strategy(self, node: fx.Node, axis: str) -> Strategy | None:
        return self._strategies.get((node.name, axis))

    def placement(self, node: fx.Node, axis: str) -> Placement:
        """Placement of the value a node stands for (getitems looked through)."""
        producer, index = value_of(node)
        s = self._strategies.get((producer.name, axis))
        if s is None or index >= len(s.outputs):
            return R
        return s.outputs[index]

    def local_output_shape(self, node: fx.Node, index: int = 0) -> tuple[int, ...]:
        facts = node.meta[META_KEY]
        shape = facts.shapes[index]
        placements = []
        for axis in self.axes:
            s = self._strategies.get((node.name, axis))
            placements.append(s.outputs[index] if s is not None else R)
        return local_shape(shape, tuple(placements), tuple(self.split(a) for a in self.axes))

    def split(self, axis: str) -> int:
        """How many pieces a dim sharded on ``axis`` is cut into on one rank."""
        return self.size(axis)

    def shard_factor(self, node: fx.Node, slot: int, dim: int) -> int:
        """By how much tensor input ``slot`` of ``node`` is split along ``dim``."""
        factor = 1
        for axis in self.axes:
            s = self._strategies.get((node.name, axis))
            if s is None or slot >= len(s.inputs):
                continue
            p = s.inputs[slot]
            if p.is_shard(dim):
                factor *= self.split(axis)
        return factor


def _per_microbatch(s: Strategy, batch: Strategy | None, scale: int) -> Strategy:
    """``s`` on a graph of one microbatch, ``scale`` times fewer sequences than traced: a
    ``Shard(dim, groups)`` whose dim holds the batch (the dp placement shards the same dim)
    cuts each sequence of the flattened dim, so its groups shrink with the batch."""
    if scale == 1 or batch is None:
        return s

    def local(p: Placement, b: Placement | None) -> Placement:
        if (isinstance(p, Shard) and p.groups > 1 and isinstance(b, Shard) and b.dim == p.dim
                and p.groups % scale == 0):
            return Shard(p.dim, p.groups // scale)
        return p

    inputs = tuple(local(p, b) for p, b in zip(s.inputs, (*batch.inputs, *[None] * len(s.inputs))))
    outputs = tuple(local(p, b) for p, b in zip(s.outputs,
                                                (*batch.outputs, *[None] * len(s.outputs))))
    if inputs == s.inputs and outputs == s.outputs:
        return s
    return Strategy(inputs, outputs, s.local_impl)
