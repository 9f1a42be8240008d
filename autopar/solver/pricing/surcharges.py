"""What an op priced from its trace pays beside its kernel's arithmetic and bytes: writing
its outputs and gradients, casting its fp32 weights, its arithmetic where that bounds it,
its bias, the precision's casts and an fp8 linear's quantization.

Surcharges of :mod:`autopar.solver.pricing.kinds`, each a predicate and how it joins the
(forward, backward) seconds, added in ascending ``order``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_models.compute import allocation_time, arithmetic_times, bias_times, forward_time
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.kernel_work import KernelWork
from autopar.solver.pricing.kinds import register_surcharge
from autopar.solver.pricing.precision_costs import fp8_quantize_times, inserted_cast_time
from autopar.solver.pricing.traced_ops import has_bias, numel
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables


def _always(tables: CostTables, d: Decision, work: KernelWork) -> bool:
    return True


def _casts_weights(tables: CostTables, d: Decision, work: KernelWork) -> bool:
    """Casts its fp32 weights where it reads them (a step's one cast of each is priced
    with the step's tail: ``autopar.solver.pricing.evaluate._step_tail``)."""
    return bool(work.cast) and not tables.casts_weights_once(d)


def _arithmetic_bound(tables: CostTables, d: Decision, work: KernelWork) -> bool:
    """An op without matmul FLOPs, whose arithmetic may take longer than its bytes."""
    return not d.facts.fwd_flops and bool(d.facts.shapes)


def _adds_bias(tables: CostTables, d: Decision, work: KernelWork) -> bool:
    return (not _arithmetic_bound(tables, d, work) and work.shape is not None
            and has_bias(d.nodes[0]))


def _trains(tables: CostTables, d: Decision, work: KernelWork) -> bool:
    return d.facts.requires_grad


def _fp8(tables: CostTables, d: Decision, work: KernelWork) -> bool:
    return tables.fp8_linear(d)


@register_surcharge("output writes", order=10, applies=_always)
def output_writes(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                  fwd: float, bwd: float) -> tuple[float, float]:
    """Allocating what its forward writes (outputs and kept buffers)."""
    fwd += allocation_time(work.written * work.scale * work.stored, work.device)
    return fwd, bwd


@register_surcharge("weight cast", order=20, applies=_casts_weights)
def weight_cast(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                fwd: float, bwd: float) -> tuple[float, float]:
    """The fp32 weight's working copy in the op's low precision (its gradient is cast back
    with the gradient writes)."""
    fwd += forward_time(0.0, work.cast, work.device, work.dtype)
    return fwd, bwd


@register_surcharge("arithmetic bound", order=30, applies=_arithmetic_bound)
def arithmetic_bound(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                     fwd: float, bwd: float) -> tuple[float, float]:
    """Its arithmetic, where that bounds it (a same-shape add's gradient passes through: no
    backward kernel to bound)."""
    facts = d.facts
    elements = numel(facts.shapes[0]) * work.scale
    arith_fwd, arith_bwd = arithmetic_times(facts.target, elements, work.device)
    fwd = max(fwd, arith_fwd)
    runs = facts.bwd_bytes is None or facts.bwd_kernels > 0
    bwd = max(bwd, arith_bwd) if facts.requires_grad and runs else bwd
    return fwd, bwd


@register_surcharge("bias", order=40, applies=_adds_bias)
def bias(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
         fwd: float, bwd: float) -> tuple[float, float]:
    """A linear's or addmm's bias: added in forward, summed over the tokens in backward."""
    bias_fwd, bias_bwd = bias_times(numel(d.facts.shapes[0]) * work.scale, work.device)
    fwd += bias_fwd
    bwd += bias_bwd if d.facts.requires_grad else 0.0
    return fwd, bwd


@register_surcharge("gradient writes", order=50, applies=_trains)
def gradient_writes(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                    fwd: float, bwd: float) -> tuple[float, float]:
    """The gradients it writes, one per input it reads (a weight's whole, its tp shard),
    and an fp32 weight's gradient cast back from the low precision."""
    facts = d.facts
    bwd += allocation_time(((facts.bytes_read - work.weights - work.inside_read) * work.scale
                            + work.weights / work.div) * work.stored, work.device)
    if work.cast:
        bwd += forward_time(0.0, work.cast, work.device, work.dtype)
    return fwd, bwd


@register_surcharge("precision casts", order=60, applies=_always)
def precision_casts(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                    fwd: float, bwd: float) -> tuple[float, float]:
    """The precision's casts of its activations (:func:`inserted_cast_time`)."""
    casts = inserted_cast_time(tables, d, s)
    fwd += casts
    bwd += casts if d.facts.requires_grad else 0.0
    return fwd, bwd


@register_surcharge("fp8 quantization", order=70, applies=_fp8)
def fp8_quantization(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                     fwd: float, bwd: float) -> tuple[float, float]:
    """An fp8 linear's quantization of its input and output gradient
    (:func:`fp8_quantize_times`)."""
    quantize_fwd, quantize_bwd = fp8_quantize_times(tables, d, s)
    fwd += quantize_fwd
    bwd += quantize_bwd if d.facts.requires_grad else 0.0
    return fwd, bwd
