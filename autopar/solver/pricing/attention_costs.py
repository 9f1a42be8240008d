"""What attention's kernels cost: an op inside fused eager attention, and
``scaled_dot_product_attention``, at the device's attention efficiency (and the generated
kernel's speed where the program runs it: ``CostTables.attention_speed``).

Two kinds of :mod:`autopar.solver.pricing.kinds`; what context parallelism adds at an
attention site is priced in :mod:`autopar.solver.axes.context`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_models.compute import attention_time
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.kernel_work import kernel_work
from autopar.solver.pricing.kinds import Times, recompute_s, register_kind, with_surcharges
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables


def _in_fused_attention(tables: CostTables, d: Decision) -> bool:
    return d.name in tables.problem.fused_attention


def _sdpa(tables: CostTables, d: Decision) -> bool:
    return "scaled_dot_product" in d.facts.target


@register_kind("fused attention", order=20, applies=_in_fused_attention)
def fused_attention_times(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """An op inside fused eager attention: its elementwise steps (scale, mask, softmax,
    dropout) run in the kernel's registers, free; its two matmuls run at fused
    attention's efficiency and move only the operands that are not sequence-squared
    (the smaller side of each). The scores are recomputed in backward, as FlashAttention
    does (``recomputed``)."""
    facts = d.facts
    if not facts.fwd_flops:
        return 0.0, 0.0, 0.0
    work = kernel_work(tables, d, s)
    flops, shape = work.flops, work.shape
    device, dtype = tables.cluster.device, tables.dtype(d)
    moved = min(facts.bytes_read, facts.bytes_written) / (facts.bytes_read + facts.bytes_written
                                                          or 1) * work.moved
    speed = tables.attention_speed(d)
    fwd = attention_time(flops, moved, device, dtype, shape=shape, kernel_speed=speed[0])
    bwd = 0.0
    if facts.requires_grad:
        bwd = attention_time(flops * facts.bwd_flops / facts.fwd_flops, 2 * moved, device,
                             dtype, shape=shape, kernel_speed=speed[1])
    return fwd, bwd, recompute_s(tables, d, fwd)


@register_kind("scaled dot product attention", order=40, applies=_sdpa)
def sdpa_times(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """``scaled_dot_product_attention``: one fused kernel each way, its backward the FLOPs
    the trace counted, with the surcharges of an op priced from its trace."""
    facts = d.facts
    work = kernel_work(tables, d, s)
    speed = tables.attention_speed(d)
    fwd = attention_time(work.flops, work.moved, work.device, work.dtype, shape=work.shape,
                         kernel_speed=speed[0])
    bwd = 0.0
    if facts.requires_grad:
        bwd = attention_time(facts.bwd_flops * work.scale * work.share, 2 * work.moved,
                             work.device, work.dtype, shape=work.shape, kernel_speed=speed[1])
    return with_surcharges(tables, d, s, work, fwd, bwd)
