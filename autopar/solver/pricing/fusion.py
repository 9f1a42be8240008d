"""What attention fusion changes for the solver: the fused sites' tp strategies must suit
the kernel, and their sequence-squared tensors are never kept (see CostTables)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.analysis.attention_sites import (
    find_attention_sites,
    kernel_compatible,
    placement_ranks,
    shape_of,
)
from autopar.solver.model.problem import Problem, restrict_to


@dataclass(frozen=True)
class Fusion:
    eager_nodes: frozenset[str] = frozenset()  # inside fused eager chains
    site_nodes: frozenset[str] = frozenset()  # inside any fused site (SDPA included)
    dead_nodes: frozenset[str] = frozenset()  # what the fused kernels never read
    causal_seq: tuple[tuple[str, int], ...] = ()  # nodes of causal sites, their q length
    # dead nodes made from the kernels' arguments (HF's repeat_kv of the keys and values),
    # each with the argument it is made from: their placement follows the arguments', so
    # they are left to the solver
    derived: tuple[tuple[str, str], ...] = ()

    @property
    def derived_nodes(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.derived)

    @classmethod
    def of(cls, gm: fx.GraphModule) -> Fusion:
        sites = [s for s in find_attention_sites(gm) if s.fusable]
        causal = tuple((n.name, shape[-2]) for s in sites if s.causal
                       and (shape := shape_of(s.q)) and len(shape) >= 2 for n in s.nodes)
        dead, derived = _dead_nodes(sites)
        return cls(frozenset(n.name for s in sites if s.pattern == "eager" for n in s.nodes),
                   frozenset(n.name for s in sites for n in s.nodes), dead, causal, derived)

    def apply(self, problem: Problem) -> Problem:
        problem.fused_attention = self.eager_nodes
        problem.kernel_attention = self.site_nodes
        problem.dead = self.dead_nodes - self.derived_nodes
        # the kernels read the arguments these were made from: what they keep for backward
        # stands for what the kernel keeps (the argument), and they take no time
        problem.not_run = dict(self.derived)
        problem.causal_attention = dict(self.causal_seq)
        # free to the solver, so it keeps masks as traced: replicated (the fusion erases
        # them); what is made from the arguments may follow their placement at no cost
        restrict_to(problem, self.dead_nodes - self.derived_nodes, lambda s: False)
        for d in problem.decisions:
            if d.name in self.site_nodes:
                ranks = placement_ranks(d.nodes[0])
                restrict_to(problem, frozenset({d.name}),
                            lambda s, ranks=ranks: kernel_compatible(s, ranks))
        return problem


_CHECK = torch.ops.aten._assert_tensor_metadata.default  # a trace-time assertion, no value


def _dead_nodes(sites: list) -> tuple[frozenset[str], tuple[tuple[str, str], ...]]:
    """Nodes only fused sites read that are not the kernels' arguments: causal masks (the
    kernels take ``causal=True`` instead) and HF's ``repeat_kv`` (the kernels read grouped
    keys and values as they are). Fusing erases them (``passes.fuse_attention``), so the
    fused program never runs them. Second, those of them made from an argument, each with
    that argument."""
    readers = {n for s in sites for n in s.nodes}
    arguments = {a for s in sites for a in (s.q, s.k, s.v, *(t.node for t in s.terms))
                 if isinstance(a, fx.Node)}
    dead: set[fx.Node] = set()
    pending = [a for s in sites for n in s.nodes for a in n.all_input_nodes
               if a not in readers]
    while pending:
        node = pending.pop()
        if node in dead or node in arguments or node.op != "call_function":
            continue
        checks = [u for u in node.users if u.target is _CHECK]
        if all(u in dead or u in readers or u.target is _CHECK for u in node.users):
            dead.update([node, *checks])  # export's assertions go with it (fuse_attention)
            pending.extend(node.all_input_nodes)
    derived: dict[fx.Node, fx.Node] = {}  # -> the argument it is made from
    order = {n: i for i, n in enumerate(sites[0].output.graph.nodes)} if sites else {}
    for node in sorted(dead, key=order.__getitem__):  # producers first
        source = next((a if a in arguments else derived[a] for a in node.all_input_nodes
                       if a in arguments or a in derived), None)
        if source is not None:
            derived[node] = source
    return (frozenset(n.name for n in dead),
            tuple((n.name, a.name) for n, a in derived.items()))
