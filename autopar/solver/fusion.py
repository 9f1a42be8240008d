"""What attention fusion changes for the solver: the fused sites' tp strategies must suit
the kernel, and their sequence-squared tensors are never kept (see CostTables)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.passes.attention_sites import (
    find_attention_sites,
    kernel_compatible,
    placement_ranks,
    shape_of,
)
from autopar.solver.problem import Problem, restrict_to


@dataclass(frozen=True)
class Fusion:
    eager_nodes: frozenset[str] = frozenset()  # inside fused eager chains
    site_nodes: frozenset[str] = frozenset()  # inside any fused site (SDPA included)
    dead_nodes: frozenset[str] = frozenset()  # causal masks the fused kernels never read
    causal_seq: tuple[tuple[str, int], ...] = ()  # nodes of causal sites, their q length

    @classmethod
    def of(cls, gm: fx.GraphModule) -> Fusion:
        sites = [s for s in find_attention_sites(gm) if s.fusable]
        causal = tuple((n.name, shape[-2]) for s in sites if s.causal
                       and (shape := shape_of(s.q)) and len(shape) >= 2 for n in s.nodes)
        return cls(frozenset(n.name for s in sites if s.pattern == "eager" for n in s.nodes),
                   frozenset(n.name for s in sites for n in s.nodes), _dead_masks(sites),
                   causal)

    def apply(self, problem: Problem) -> Problem:
        problem.fused_attention = self.eager_nodes
        problem.dead = self.dead_nodes
        problem.causal_attention = dict(self.causal_seq)
        # free to the solver, so it keeps them as traced: replicated (the fusion erases them)
        restrict_to(problem, self.dead_nodes, lambda s: False)
        for d in problem.decisions:
            if d.name in self.site_nodes:
                ranks = placement_ranks(d.nodes[0])
                restrict_to(problem, frozenset({d.name}),
                            lambda s, ranks=ranks: kernel_compatible(s, ranks))
        return problem


def _dead_masks(sites: list) -> frozenset[str]:
    """Nodes that only compute masks of sites recognised as causal (the kernels take
    ``causal=True`` instead; fusing erases them): the fused program never runs them."""
    readers = {n for s in sites for n in s.nodes}
    masks = [a for s in sites if s.causal and s.pattern == "sdpa"
             for a in s.output.all_input_nodes[3:]]
    dead: set[fx.Node] = set()
    pending = list(masks)
    while pending:
        node = pending.pop()
        if node in dead or node.op != "call_function":
            continue
        if all(u in dead or u in readers for u in node.users):
            dead.add(node)
            pending.extend(node.all_input_nodes)
    return frozenset(n.name for n in dead)
