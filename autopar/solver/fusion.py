"""What attention fusion changes for the solver: the fused sites' tp strategies must suit
the kernel, and their sequence-squared tensors are never kept (see CostTables)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.passes.attention_sites import (
    find_attention_sites,
    kernel_compatible,
    placement_ranks,
)
from autopar.solver.problem import Problem, restrict_to


@dataclass(frozen=True)
class Fusion:
    eager_nodes: frozenset[str] = frozenset()  # inside fused eager chains
    site_nodes: frozenset[str] = frozenset()  # inside any fused site (SDPA included)

    @classmethod
    def of(cls, gm: fx.GraphModule) -> Fusion:
        sites = [s for s in find_attention_sites(gm) if s.fusable]
        return cls(frozenset(n.name for s in sites if s.pattern == "eager" for n in s.nodes),
                   frozenset(n.name for s in sites for n in s.nodes))

    def apply(self, problem: Problem) -> Problem:
        problem.fused_attention = self.eager_nodes
        for d in problem.decisions:
            if d.name in self.site_nodes:
                ranks = placement_ranks(d.nodes[0])
                restrict_to(problem, frozenset({d.name}),
                            lambda s, ranks=ranks: kernel_compatible(s, ranks))
        return problem
