"""Attention and context parallelism in the cost tables: the values split with the
sequence over cp, the attention sites and what the cp algorithm adds at each, the kernel
that runs attention, and the mask a causal SDPA site never reads.

A part of :class:`autopar.solver.pricing.costs.CostTables` (a mixin). Attention's kernel
times are priced in :mod:`autopar.solver.pricing.attention_costs`.
"""

from __future__ import annotations

from functools import cached_property

import torch.fx as fx

from autopar.core.cluster import Cluster
from autopar.core.knobs import CP_ALGORITHMS
from autopar.cost_models.context_parallel import AttentionComm
from autopar.solver.axes.context import ContextSite, context_sites, sequence_scaled, site_comm
from autopar.solver.model.problem import Decision
from autopar.solver.options import PlanOptions
from autopar.strategies import Strategy


def runs_generated_attention(cluster: Cluster, options: PlanOptions) -> bool:
    """Whether fused attention sites run (and are priced as) autopar's generated kernel: on
    GPUs, unless ``options.attention_kernel`` prices another framework's run; a CPU (gloo)
    falls back to torch SDPA (``autopar.kernels.attention``)."""
    return cluster.backend != "gloo" and options.attention_kernel == "generated"


class AttentionTables:
    """Attention sites, their kernel, and context parallelism's share of them."""

    @cached_property
    def _sequence_scaled(self) -> frozenset[tuple[int, int]]:
        """Values split with the sequence over cp (empty without context parallelism)."""
        if self.setting.cp <= 1 or not self.seq_len:
            return frozenset()
        return sequence_scaled(self.problem, self.seq_len)

    @cached_property
    def _context_sites(self) -> dict[int, ContextSite]:
        """Attention sites by the decision yielding each (under context parallelism)."""
        if self.setting.cp <= 1:
            return {}
        return {site.decision: site for site in context_sites(self.problem)}

    @cached_property
    def _context_nodes(self) -> dict[str, ContextSite]:
        return {name: site for site in self._context_sites.values() for name in site.nodes}

    def context_comm(self, d: Decision, s: Strategy) -> AttentionComm | None:
        """What the setting's cp attention algorithm adds at ``d`` (one instance), when
        ``d`` yields an attention site; None elsewhere or while the algorithm is open."""
        site = self._context_sites.get(d.index)
        if site is None or self.setting.cp_algorithm not in CP_ALGORITHMS:
            return None
        key = (d.index, s)
        if key not in self._comm:
            f, b, _ = self.times(d, s, comm=False)
            self._comm[key] = site_comm(self, site, self.setting.cp_algorithm, f, b)
        return self._comm[key]

    def context_buffer_bytes(self, d: Decision, s: Strategy) -> float:
        """The largest buffer the cp attention algorithm holds at ``d`` (gathered K/V, ring
        blocks in flight, re-laid heads), beside the local tensors."""
        extra = self.context_comm(d, s) if self._context_sites else None
        return extra.temporary_bytes if extra is not None else 0.0

    def attention_speed(self, d: Decision) -> tuple[float, float]:
        """(forward, backward) speed of the kernel that runs attention node ``d`` against
        the one the device's ``attention_efficiency`` describes: autopar's generated kernel
        where the program runs it -- a fused site, on a GPU (on a CPU it falls back to
        SDPA) -- unless ``PlanOptions.attention_kernel`` says another framework's runs."""
        device = self.cluster.device
        if (d.name not in self.problem.kernel_attention
                or not runs_generated_attention(self.cluster, self.options)):
            return 1.0, 1.0
        return device.generated_attention_forward, device.generated_attention_backward

    def _causal_sdpa(self, d: Decision) -> bool:
        return (d.name in self.problem.causal_attention and d.kind == "op"
                and "scaled_dot_product" in d.facts.target and bool(d.facts.shapes))

    def _dropped_mask_bytes(self, d: Decision) -> int:
        """Bytes of the mask a causal SDPA site was traced with, which its kernel never
        reads (the fused program erases the mask; see Fusion's dead nodes)."""
        if not self._causal_sdpa(d):
            return 0
        node = d.nodes[0]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if val is None or not hasattr(val, "numel"):
            return 0
        return int(val.numel()) * val.element_size()
