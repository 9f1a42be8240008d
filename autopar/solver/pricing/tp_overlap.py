"""Tensor-parallel collectives hidden behind the matmuls beside them (priced only).

Megatron-Core with Transformer Engine's userbuffers (``tp_comm_overlap``, which
Megatron-Bridge's H100 performance recipes enable) and PyTorch's asynchronous tensor
parallelism (torchtitan's ``enable_async_tensor_parallel``) split a sequence-parallel
all-gather into one chunk per rank and multiply each chunk while the next arrives; a
reduce-scatter runs the other way round, each output chunk sent while the next is computed.
So each collective hides behind the matmul that reads (or writes) its tensor: in forward the
column-parallel matmuls after an all-gather and the row-parallel one before a
reduce-scatter, in backward their gradient matmuls. What cannot hide is one chunk (the first
arrives before any work can start, the last leaves after all of it) and whatever the
matmul's other ``n - 1`` chunks take less time than the transfers; the matmul beside a
transfer runs slower (``OVERLAP_SLOWDOWN``, as for data parallelism's collectives).

autopar's own runtime issues its collectives whole, so its plans are priced without this;
``PinnedConfig.tp_overlap`` prices another framework's program that overlaps
(``benchmarks/fidelity_sources.py``).

>>> round(exposed_s(1.0, 10.0, 4, contention=0.0), 3)   # one chunk of four shows
0.25
>>> round(exposed_s(1.0, 0.4, 4, contention=0.0), 3)    # the matmul hides 0.3 s of it
0.7
"""

from __future__ import annotations

from autopar.core.placements import Partial, Placement
from autopar.cost_models.data_parallel import OVERLAP_SLOWDOWN, with_contention
from autopar.solver.model.problem import ValueKey
from autopar.solver.pricing.costs import CostTables


def exposed_s(comm_s: float, matmul_s: float, n: int,
              contention: float = OVERLAP_SLOWDOWN) -> float:
    """Seconds a collective of ``comm_s`` over ``n`` ranks adds beside a matmul of
    ``matmul_s`` that it is pipelined with, chunk by chunk (see the module docstring)."""
    if comm_s <= 0.0:
        return 0.0
    if n <= 1 or matmul_s <= 0.0:
        return comm_s
    exposed = max(comm_s / n, comm_s - matmul_s * (n - 1) / n)
    return with_contention(comm_s, exposed, contention)


def _is_matmul(tables: CostTables, index: int) -> bool:
    d = tables.problem.decisions[index]
    return (d.kind == "op" and d.facts.fwd_flops > 0
            and "scaled_dot_product" not in d.facts.target)


def paired_matmul_s(tables: CostTables, choice: list[int], key: ValueKey, src: Placement,
                    dst: Placement) -> tuple[float, float]:
    """(forward, backward) seconds of the matmuls one instance of the collective that takes
    value ``key`` from ``src`` to ``dst`` runs beside: its producer's when it reduces a
    matmul's partial sums (a row-parallel output), otherwise the matmuls that read it in
    ``dst`` (the column-parallel ones after a gather); (0, 0) when no matmul is there."""
    problem = tables.problem
    producer = problem.decisions[key[0]]
    if isinstance(src, Partial):
        if not _is_matmul(tables, producer.index):
            return 0.0, 0.0
        f, b, r = tables.times(producer, producer.candidates[choice[producer.index]])
        return f, b
    fwd = bwd = 0.0
    for use in problem.values[key].uses:
        if use.consumer < 0 or not _is_matmul(tables, use.consumer):
            continue
        d = problem.decisions[use.consumer]
        s = d.candidates[choice[use.consumer]]
        if s.inputs[use.slot] != dst:
            continue
        f, b, r = tables.times(d, s)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd
