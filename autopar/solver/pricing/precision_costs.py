"""What a plan's precision costs beyond its ops' arithmetic: the casts the program inserts
between dtypes, and fp8 linears' quantization kernels.

:mod:`autopar.solver.pricing.cast_costs` finds the casts (an analysis of the traced graph); here they
and the fp8 quantizations are priced for one :class:`~autopar.solver.pricing.costs.CostTables`
(setting, placements), which adds them to each op's forward and backward time. The
per-node precision itself is computed once per graph and shared by every tp degree's
problem (``Problem.graph_cache``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.analysis.precision import (
    BYTES,
    PrecisionAssignment,
    assign_precision,
    params_word,
    stored_word,
)
from autopar.core.placements import divisor
from autopar.core.values import tensor_inputs
from autopar.cost_models.compute import forward_time
from autopar.solver.model.problem import Decision, Problem, ValueKey
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.cast_costs import Cast, fp8_quantize_bytes, inserted_casts
from autopar.solver.pricing.elementwise_fusion import fusable, through_views
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables


def precision_key(options: PlanOptions, zero: int) -> tuple:
    """What a problem's precision assignment depends on (its cache key)."""
    return ("precision", options.precision, options.precision_overrides,
            params_word(options.precision, zero, options.master_weights))


def precision_assignment(problem: Problem, options: PlanOptions,
                         zero: int) -> PrecisionAssignment:
    """The per-node precision of ``problem``'s graph under ``options`` at ZeRO ``zero``
    (which decides the dtype parameters are read in), computed once per graph: the problems
    of every tp degree share it (``Problem.graph_cache``)."""
    key = (*precision_key(options, zero), problem.fused_attention)
    if key not in problem.graph_cache:
        problem.graph_cache[key] = assign_precision(problem.gm, options.precision,
                                                    dict(options.precision_overrides), key[3],
                                                    fused=problem.fused_attention)
    return problem.graph_cache[key]


def casts_of(problem: Problem, options: PlanOptions, zero: int) -> dict[str, tuple[Cast, ...]]:
    """The casts the program inserts for ``problem``'s precision (:mod:`cast_costs`), once
    per graph and precision."""
    key = ("casts", *precision_key(options, zero), problem.fused_attention,
           bool(problem.fused_elementwise))
    if key not in problem.graph_cache:
        problem.graph_cache[key] = inserted_casts(
            problem.gm, precision_assignment(problem, options, zero),
            fused=bool(problem.fused_elementwise))
    return problem.graph_cache[key]


def inserted_cast_time(tables: CostTables, d: Decision, s: Strategy) -> float:
    """Seconds of the casts the program runs for ``d``'s inputs (and a normalisation's
    output) where the precision stores them in another dtype, one kernel each
    (:mod:`autopar.solver.pricing.cast_costs`); their backward casts the gradients as long."""
    problem = tables.problem
    casts = casts_of(problem, tables.options, tables.setting.zero).get(d.name)
    if not casts:
        return 0.0
    seconds = 0.0
    for cast in casts:
        if cast.position < 0:
            key, placement = (d.index, 0), s.outputs[0]
        else:
            key = problem.value_key(problem.node_named(cast.value))
            placement = (s.inputs[cast.position] if cast.position < len(s.inputs)
                         else s.outputs[0])
        moved = (value_elements(tables, key) * (BYTES[cast.have] + BYTES[cast.want])
                 / divisor(placement, tables.setting.tp))
        seconds += forward_time(0.0, moved, tables.cluster.device, cast.want)
    return seconds


def fp8_quantize_times(tables: CostTables, d: Decision, s: Strategy) -> tuple[float, float]:
    """(forward, backward) seconds the fp8 linear ``d`` spends quantizing: its input in
    forward -- once per tensor (q, k and v share one copy), and in a fusing program
    nothing where the elementwise kernel that makes it writes fp8 (a norm's, SwiGLU's);
    its output gradient in backward. Eager, the backward's matmuls also copy the fp8
    operands they read transposed (``fp8_ops._scaled_matmul``)."""
    problem = tables.problem
    fused = bool(problem.fused_elementwise)
    device, tp = tables.cluster.device, tables.setting.tp
    x = tensor_inputs(d.nodes[0])[0]
    key = problem.value_key(x)
    x_bytes = tables.precision.bytes_per_element(problem.decisions[key[0]].name)
    x_elements = value_elements(tables, key) / divisor(s.inputs[0], tp)
    fwd = 0.0
    if _first_fp8_readers(tables).get(key) == d.index and not (
            fused and fusable(through_views(x))):
        fwd = forward_time(0.0, fp8_quantize_bytes(x_elements, x_bytes, fused), device,
                           "fp8", kernels=1 if fused else 3)
    grad_bytes = BYTES[stored_word(tables.options.precision)]
    out_elements = value_elements(tables, (d.index, 0)) / divisor(s.outputs[0], tp)
    moved = fp8_quantize_bytes(out_elements, grad_bytes, fused)
    if not fused:  # transposed copies of the output gradient's and the input's fp8
        moved += 2.0 * (out_elements + x_elements)
    bwd = forward_time(0.0, moved, device, "fp8", kernels=1 if fused else 5)
    return fwd, bwd


def value_elements(tables: CostTables, key: ValueKey) -> float:
    """Elements of one instance of a value (whole over tp, local over dp)."""
    producer = tables.problem.decisions[key[0]]
    return tables.value_bytes(key) / tables.precision.bytes_per_element(producer.name)


def _first_fp8_readers(tables: CostTables) -> dict[ValueKey, int]:
    """Value -> the first fp8 linear that reads it as its input, which quantizes it for
    all of them (once per problem and precision)."""
    problem = tables.problem
    key = ("first fp8 readers", precision_key(tables.options, tables.setting.zero))
    if key not in problem.cache:
        out: dict[ValueKey, int] = {}
        for d in problem.decisions:
            if d.kind == "op" and tables.fp8_linear(d):
                inputs = tensor_inputs(d.nodes[0])
                if inputs:
                    out.setdefault(problem.value_key(inputs[0]), d.index)
        problem.cache[key] = out
    return problem.cache[key]
