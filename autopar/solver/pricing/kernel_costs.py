"""What an op's own kernel costs, priced from its traced FLOPs and bytes: an op that
computes (a matmul, a convolution), an elementwise op inside a fused chain, and any other op
(memory-bound, run op by op as autograd runs it).

Three kinds of :mod:`autopar.solver.pricing.kinds`, the last of them the one every op not
claimed before falls to. Each then pays the surcharges (:mod:`autopar.solver.pricing.surcharges`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_models.compute import backward_time, forward_time, op_time
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.kernel_work import KernelWork, kernel_work
from autopar.solver.pricing.kinds import Times, register_kind, with_surcharges
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables


def _counted_flops(tables: CostTables, d: Decision) -> bool:
    return bool(d.facts.fwd_flops)


def _in_fused_chain(tables: CostTables, d: Decision) -> bool:
    return tables.problem.fused_elementwise.get(d.name) is not None


def _any_op(tables: CostTables, d: Decision) -> bool:
    return True


def _forward(work: KernelWork) -> float:
    return forward_time(work.flops, work.moved, work.device, work.dtype, shape=work.shape,
                        kernels=work.kernels)


@register_kind("computing op", order=50, applies=_counted_flops)
def computing_op_times(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """An op the trace counted FLOPs for. The trace measured which gradients autograd
    computes (a frozen weight has no weight gradient): 2x the forward's FLOPs means both
    matmuls, 1x only one."""
    facts = d.facts
    work = kernel_work(tables, d, s)
    fwd, bwd = _forward(work), 0.0
    if facts.requires_grad:
        both = facts.bwd_flops >= 1.5 * max(facts.fwd_flops, 1)
        bwd = backward_time(work.flops, work.moved, work.device, work.dtype, shape=work.shape,
                            weight_grad=both)
    return with_surcharges(tables, d, s, work, fwd, bwd)


@register_kind("fused elementwise op", order=60, applies=_in_fused_chain)
def fused_chain_times(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """An elementwise op inside a fused chain (``PlanOptions.fuse_elementwise``): the bytes
    that leave the chain, one launch for the chain's first op, none for the rest."""
    work = kernel_work(tables, d, s)
    fwd, bwd = _forward(work), 0.0
    if d.facts.requires_grad:
        bwd = backward_time(0.0, work.moved, work.device, work.dtype, kernels=work.kernels)
    return with_surcharges(tables, d, s, work, fwd, bwd)


@register_kind("memory-bound op", order=70, applies=_any_op)
def memory_bound_times(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """Any other op: its bytes at the device's bandwidth, its backward op by op as the trace
    measured it (:func:`memory_bound_backward`)."""
    work = kernel_work(tables, d, s)
    fwd, bwd = _forward(work), 0.0
    if d.facts.requires_grad:
        bwd = memory_bound_backward(tables, d, work.moved, work.dtype)
    return with_surcharges(tables, d, s, work, fwd, bwd)


def memory_bound_backward(tables: CostTables, d: Decision, moved: float, dtype: str) -> float:
    """Seconds of a memory-bound op's backward run op by op: the kernels autograd
    launches for it and their bytes, as the trace measured them
    (``NodeFacts.bwd_bytes``, :mod:`autopar.trace.backward_kernels`), scaled as its
    forward's ``moved`` bytes are -- none for an ``add``, whose gradient passes through;
    three for ``pow``. Unmeasured, ``BACKWARD_BYTES_FACTOR`` x its forward's."""
    facts, device = d.facts, tables.cluster.device
    traced = facts.bytes_read + facts.bytes_written
    if facts.bwd_bytes is None or traced <= 0:
        return backward_time(0.0, moved, device, dtype)
    if not facts.bwd_kernels:
        return 0.0
    return op_time(0.0, moved * facts.bwd_bytes / traced, device, dtype,
                   kernels=facts.bwd_kernels)
