"""Sharding rules for the ops MoE routing is written with: ``one_hot``, ``view_as``,
``repeat_interleave`` (with a fixed repeat count), ``gather``, two-operand ``einsum`` and
grouped matmuls.

Each acts on every token independently, so every dim a token lives on may be sharded. The
data-dependent ops of routing (``nonzero``, ``argsort`` over tokens, ``histc``, grouped
matmuls with computed offsets) have no global-index rule; on the batch axis they run on
each rank's own tokens (:mod:`autopar.analysis.batch_axis`).
"""

from __future__ import annotations

import torch

from autopar.core.placements import Partial, Replicate, Shard, can_shard
from autopar.core.strategy import OpCall, Strategy, norm_dim, replicate_all
from autopar.strategies.matmul import product_strategies
from autopar.strategies.pointwise import partial_strategies
from autopar.strategies.registry import register_rule
from autopar.strategies.views import reshape_strategies

aten = torch.ops.aten
R = Replicate()


@register_rule(aten.one_hot.default)
def one_hot(call: OpCall, axis_size: int) -> list[Strategy]:
    """``one_hot(x, classes)`` appends a class dim; every dim of ``x`` keeps its shard."""
    x = call.tensor_args[0]
    return [replicate_all(call)] + [
        Strategy((Shard(d),), (Shard(d),))
        for d, size in enumerate(x.shape) if can_shard(size, axis_size)
    ]


@register_rule(aten.view_as.default)
def view_as(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.view_as(other)`` is ``x.reshape(other.shape)``: ``other`` only lends its shape,
    so it must be laid out as the result is (its local shape is the local result's)."""
    return [
        Strategy((s.inputs[0], s.outputs[0] if isinstance(s.outputs[0], Shard) else R),
                 s.outputs)
        for s in reshape_strategies(call, axis_size)
    ]


@register_rule(aten.repeat_interleave.self_int)
def repeat_interleave(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.repeat_interleave(r, dim)`` repeats each element ``r`` times in place along
    ``dim``: a shard of the result is the repeated shard, on ``dim`` as on any other.
    Linear. Without ``dim`` the input is flattened first: replicated."""
    x = call.tensor_args[0]
    dim = call.arg(2, "dim")
    if dim is None:
        return [replicate_all(call)]
    dim = norm_dim(dim, x.ndim)
    sized = call.arg(3, "output_size") is not None  # a global size the local op would check
    strategies = [replicate_all(call)]
    for d, size in enumerate(x.shape):
        if can_shard(size, axis_size) and not (sized and d == dim):
            strategies.append(Strategy((Shard(d),), (Shard(d),)))
    return strategies + partial_strategies(call, [[0]])


@register_rule(aten.einsum.default)
def einsum(call: OpCall, axis_size: int) -> list[Strategy]:
    """Two-operand ``einsum`` (GShard's dispatch and combine, experts' batched matmuls):
    a label that reaches the output is sharded on every operand that has it; a label both
    operands contract gives a partial sum. Other forms (one operand, ``...``, a label
    repeated within an operand) stay replicated."""
    equation = call.arg(0, "equation")
    operands = call.tensor_args
    parsed = _parse_einsum(equation, len(operands))
    if parsed is None:
        return [replicate_all(call)]
    (a_labels, b_labels), out_labels = parsed
    letters = {0: {c: d for d, c in enumerate(a_labels)}, 1: {c: d for d, c in enumerate(b_labels)}}
    out = {c: d for d, c in enumerate(out_labels)}
    contracted = [c for c in letters[0] if c in letters[1] and c not in out]
    # product_strategies calls the contracted label "k"; more than one contracts as a block
    # whose leading label may be sharded.
    if contracted:
        for slot in (0, 1):
            letters[slot]["k"] = letters[slot][contracted[0]]
    return product_strategies(call, axis_size, (0, 1), letters, out)


def _parse_einsum(equation: object, n_operands: int):
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or n_operands != 2:
        return None
    if any(len(set(t)) != len(t) for t in (*terms, out)) or "k" in equation:
        return None  # the label "k" is product_strategies' own name
    return tuple(terms), out


@register_rule(aten.gather.default)
def gather(call: OpCall, axis_size: int) -> list[Strategy]:
    """``x.gather(dim, index)``: every dim but ``dim`` may be sharded on both, where the
    index has that dim whole (the router picking its k probabilities per token)."""
    x, index = call.tensor_args[0], call.tensor_args[1]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    strategies = [replicate_all(call)]
    for d, size in enumerate(index.shape):
        if d != dim and size == x.shape[d] and can_shard(size, axis_size):
            strategies.append(Strategy((Shard(d), Shard(d)), (Shard(d),)))
    return strategies


@register_rule(torch.ops.aten._grouped_mm.default, "autopar::grouped_mm",
               "transformers::grouped_mm_fallback")
def grouped_mm(call: OpCall, axis_size: int) -> list[Strategy]:
    """``grouped_mm(x (rows, in), w (experts, in, out), offs)``: rows sorted by expert, each
    group through its expert's matrix. Tensor parallelism inside the experts, as
    Megatron's: ``out`` sharded on ``w`` gives sharded columns (``x`` whole); ``in`` sharded
    on both gives a partial sum. Rows hold global offsets, so they are not split here
    (data and expert parallelism split them: ``autopar.analysis.batch_axis``,
    ``passes/expert_parallel``). Linear in ``x`` and in ``w``."""
    if len(call.tensor_args) < 3 or call.tensor_args[1].ndim != 3:
        return [replicate_all(call)]
    x, w = call.tensor_args[:2]
    n_rest = len(call.tensor_args) - 2
    strategies = [replicate_all(call)]
    if can_shard(w.shape[2], axis_size):
        strategies.append(Strategy((R, Shard(2)) + (R,) * n_rest, (Shard(1),)))
    if can_shard(w.shape[1], axis_size):
        strategies.append(Strategy((Shard(1), Shard(1)) + (R,) * n_rest, (Partial("sum"),)))
    return strategies + partial_strategies(call, [[0], [1]])
