"""Expert parallelism in the cost tables: which weights each rank keeps a block of, which
values stay inside an expert region, and the token all-to-alls around each region.

A part of :class:`autopar.solver.pricing.costs.CostTables` (a mixin).
"""

from __future__ import annotations

from functools import cached_property

from autopar.analysis.expert_sites import regions_of
from autopar.cost_models.comm import group_collective_time
from autopar.solver.model.problem import Decision, ValueKey


class ExpertTables:
    """Expert weights' shards, expert regions and their token dispatch (``ep > 1``)."""

    @cached_property
    def _experts(self) -> tuple[frozenset[str], dict[str, str]]:
        """(stacked expert weights' get_attr nodes, first grouped matmul of each expert
        region -> the rows it reads), when experts are spread."""
        if self.setting.ep <= 1:
            return frozenset(), {}
        regions = regions_of(self.problem.gm)
        order = {n: i for i, n in enumerate(self.problem.gm.graph.nodes)}
        weights = frozenset(w.name for r in regions for w in r.weights)
        first = {min(r.matmuls, key=order.__getitem__).name: r.rows.name for r in regions}
        return weights, first

    @cached_property
    def _expert_members(self) -> dict[str, int]:
        """Node name -> index of the expert region it runs in, when experts are spread."""
        if self.setting.ep <= 1:
            return {}
        return {n.name: i for i, r in enumerate(regions_of(self.problem.gm))
                for n in r.members}

    def inside_experts(self, key: ValueKey, consumer: int) -> bool:
        """Does the value ``key`` flow between two ops of one expert region (``ep > 1``)?
        Expert parallelism runs each region as one block between its token all-to-alls (and
        under ZeRO-3 as one module, ``passes/outline_experts.py``), on the rows of this
        rank's experts: a tensor-parallel collective inside it would split the region in
        two, so such a value keeps its placement (the layout solve pins it)."""
        members = self._expert_members
        if not members or consumer < 0:
            return False
        def regions(d: int) -> set[int]:
            return {members[n.name] for n in self.problem.decisions[d].nodes
                    if n.name in members}
        return bool(regions(key[0]) & regions(consumer))

    def expert_divisor(self, d: Decision) -> int:
        """``ep`` for a stacked expert weight (each rank keeps a block of experts), else 1."""
        if self.setting.ep <= 1 or d.kind != "param":
            return 1
        return self.setting.ep if d.nodes[0].name in self._experts[0] else 1

    def expert_comm(self, d: Decision) -> tuple[float, float]:
        """(forward, backward) seconds of one instance's token all-to-alls, at the first
        grouped matmul of an expert region: rows out to the experts' owners and back, in
        forward and again (reversed) in backward; a fully recomputed layer dispatches
        again. Priced per link level of the ep group (:func:`group_collective_time`)."""
        rows = self._experts[1].get(d.nodes[0].name) if d.kind == "op" else None
        if rows is None:
            return 0.0, 0.0
        if rows not in self.problem.decision_of:
            return 0.0, 0.0
        nbytes = self.value_bytes((self.problem.decision_of[rows], 0))
        one = group_collective_time("all_to_all", nbytes, self.setting.ep_mesh, "ep",
                                    self.cluster)
        rerun = 2 * one if self.setting.layer_mode(0) == "full" else 0.0
        return 2 * one, 2 * one + rerun
