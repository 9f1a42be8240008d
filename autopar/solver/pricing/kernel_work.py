"""What one device's kernel of an op does, read off its trace at one setting and strategy:
the bytes it moves, the FLOPs of its share, its local matmul shape.

Every kind of op priced from its trace (:mod:`autopar.solver.pricing.kinds`), and its
surcharges, read the same :class:`KernelWork`, so they agree on what the op moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.core.cluster import DeviceSpec
from autopar.cost_models.compute import causal_fraction
from autopar.cost_models.context_parallel import causal_imbalance
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.elementwise_fusion import FusedBytes
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables


@dataclass(frozen=True)
class KernelWork:
    """One instance of an op's kernel on one device, per microbatch."""

    div: int  # tp when the strategy splits the op's work, else 1
    scale: float  # this device's part of the traced tensors (microbatch, cp, tp)
    dtype: str  # the dtype it computes in
    device: DeviceSpec
    written: float  # traced bytes it writes, with the buffers it keeps (less a fused chain's)
    weights: float  # traced bytes of the weights it reads whole
    inside: FusedBytes | None  # the bytes a fused elementwise chain keeps from memory
    inside_read: float  # ... of those, the bytes it reads
    kernels: int  # kernel launches: 0 for an op that continues a fused chain's kernel
    stored: float  # bytes of one element it stores, over fp32's
    moved: float  # bytes its kernel moves on this device
    shape: tuple[int, int, int] | None  # this device's (m, n, k), for a matmul
    share: float  # the share of the traced FLOPs this rank's kernel computes
    flops: float  # FLOPs this device's kernel computes
    cast: float  # bytes casting its fp32 weights to its low precision moves


def kernel_work(tables: CostTables, d: Decision, s: Strategy) -> KernelWork:
    """What ``d``'s kernel does on one device under ``s``."""
    facts = d.facts
    div = tables.setting.tp if s.splits_work else 1
    scale = tables._scale(d) / div
    dtype = tables.dtype(d)
    # Buffers an op keeps for backward (a softmax's output inside cross-entropy, norm
    # statistics) are written by it too, though they are not among its outputs.
    floats, fixed = tables.kept_extras(d)
    kept = floats * 4 + fixed
    written = facts.bytes_written + kept
    weights = tables._weight_read_bytes().get(d.index, 0.0)
    inside = tables.problem.fused_elementwise.get(d.name)  # bytes a fused chain keeps
    inside_read, kernels = (inside.read, 0 if inside.continues else 1) if inside else (0.0, 1)
    if inside:
        written = max(written - inside.written, 0.0)
    read = max(facts.bytes_read - tables._dropped_mask_bytes(d) - weights - inside_read, 0)
    stored = tables._stored_fraction(d)
    # a weight is read whole however small the microbatch (its tp shard, when split)
    moved = ((read + written) * scale + weights / div) * stored
    shape = tables._local_matmul(d, scale)
    share = computed_share(tables, d)
    flops = facts.fwd_flops * scale * share
    return KernelWork(div, scale, dtype, tables.cluster.device, written, weights, inside,
                      inside_read, kernels, stored, moved, shape, share, flops,
                      tables._weight_cast_bytes(d) / div)


def computed_share(tables: CostTables, d: Decision) -> float:
    """The share of ``d``'s traced FLOPs this rank's kernel computes: a causal attention
    kernel skips the tiles the mask hides, and under cp the slowest rank's share of causal
    attention is what the step waits for."""
    work = 1.0
    causal_seq = tables.problem.causal_attention.get(d.name)
    if causal_seq:  # the kernel skips the tiles the causal mask hides
        work *= causal_fraction(causal_seq)
    site = tables._context_nodes.get(d.name)
    if site is not None:  # the slowest rank's share of causal attention
        work *= causal_imbalance(tables.setting.cp, tables.setting.cp_layout, site.causal)
    return work
