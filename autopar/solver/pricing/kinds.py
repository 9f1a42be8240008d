"""The registry of op pricing: one pricing function per kind of op, and the surcharges an
op priced from its trace pays beside its kernel.

Each kind is a predicate and a pricing function, registered with a decorator (as sharding
rules are, :mod:`autopar.strategies.registry`; TVM's ``register_legalize``). An op that
runs a kernel (a view or an identity dropout runs none: ``CostTables._compute_times``) is
priced by the first kind, in ascending ``order``, whose predicate holds:

=====  ==========================================================  ====================
order  kind                                                        module
=====  ==========================================================  ====================
10     a cross-entropy the runtime chunks (no plugin prices it)    ``loss_costs``
20     an op inside fused eager attention                          ``attention_costs``
30     an op a plugin prices (``cost_models/op_costs.py``)         ``plugin_costs``
40     ``scaled_dot_product_attention``                            ``attention_costs``
50     an op the trace counted FLOPs for (a matmul, a convolution) ``kernel_costs``
60     an elementwise op inside a fused chain                      ``kernel_costs``
70     any other op: memory-bound, run op by op                    ``kernel_costs``
=====  ==========================================================  ====================

The kinds from 40 on price the op's kernel from its traced FLOPs and bytes
(:mod:`autopar.solver.pricing.kernel_work`), then add each surcharge whose predicate holds,
in ascending ``order`` (:mod:`autopar.solver.pricing.surcharges`): writing its outputs (10),
casting its fp32 weights (20), its arithmetic where that bounds it (30) or its bias (40),
writing its gradients (50), the precision's casts of its activations (60), an fp8 linear's
quantization (70). The orders are the order the costs were always added in, so a time is
the same sum to the last bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.solver.model.problem import Decision
from autopar.solver.pricing.kernel_work import KernelWork
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables

Times = tuple[float, float, float]
"""(forward, backward, recompute) seconds of one instance."""
Price = Callable[["CostTables", Decision, Strategy], Times]
Add = Callable[["CostTables", Decision, Strategy, KernelWork, float, float],
               tuple[float, float]]


@dataclass(frozen=True)
class OpKind:
    """A kind of op: which ops it is (``applies``), and what one instance costs."""

    name: str
    order: int
    applies: Callable[[CostTables, Decision], bool]
    price: Price


@dataclass(frozen=True)
class Surcharge:
    """A cost beside an op's kernel: which ops pay it, and how it joins (forward, backward)."""

    name: str
    order: int
    applies: Callable[[CostTables, Decision, KernelWork], bool]
    add: Add


_KINDS: list[OpKind] = []
_SURCHARGES: list[Surcharge] = []


def _insert(entries: list, entry: OpKind | Surcharge) -> None:
    """Add ``entry`` in its place by order; a name or an order taken twice is an error (the
    order must say which comes first)."""
    for other in entries:
        if other.name == entry.name or other.order == entry.order:
            raise ValueError(f"{type(entry).__name__} {entry.name!r} (order {entry.order}) "
                             f"clashes with {other.name!r} (order {other.order})")
    entries.append(entry)
    entries.sort(key=lambda e: e.order)


def register_kind(name: str, order: int,
                  applies: Callable[[CostTables, Decision], bool]) -> Callable[[Price], Price]:
    """Register ``fn`` as the pricing of the ops ``applies(tables, d)`` holds for, tried
    before every kind of a higher ``order``."""
    def decorate(fn: Price) -> Price:
        _insert(_KINDS, OpKind(name, order, applies, fn))
        return fn
    return decorate


def register_surcharge(name: str, order: int,
                       applies: Callable[[CostTables, Decision, KernelWork], bool],
                       ) -> Callable[[Add], Add]:
    """Register ``fn`` as a surcharge the ops ``applies(tables, d, work)`` holds for pay,
    added after every surcharge of a lower ``order``."""
    def decorate(fn: Add) -> Add:
        _insert(_SURCHARGES, Surcharge(name, order, applies, fn))
        return fn
    return decorate


def kinds() -> tuple[OpKind, ...]:
    """The registered kinds, in the order they are tried.

    >>> from autopar.solver.pricing import costs  # its parts register the kinds
    >>> [kind.name for kind in kinds()]  # doctest: +NORMALIZE_WHITESPACE
    ['chunked loss', 'fused attention', 'plugin op', 'scaled dot product attention',
     'computing op', 'fused elementwise op', 'memory-bound op']
    """
    return tuple(_KINDS)


def surcharges() -> tuple[Surcharge, ...]:
    """The registered surcharges, in the order they are added.

    >>> from autopar.solver.pricing import costs  # its parts register the surcharges
    >>> [surcharge.name for surcharge in surcharges()]  # doctest: +NORMALIZE_WHITESPACE
    ['output writes', 'weight cast', 'arithmetic bound', 'bias', 'gradient writes',
     'precision casts', 'fp8 quantization']
    """
    return tuple(_SURCHARGES)


def price_kernel(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """(forward, backward, recompute) seconds of one instance of ``d``'s kernel under ``s``,
    by the first kind that applies to it."""
    for kind in _KINDS:
        if kind.applies(tables, d):
            return kind.price(tables, d, s)
    raise LookupError(f"no pricing applies to {d.name} (kinds: {[k.name for k in _KINDS]})")


def with_surcharges(tables: CostTables, d: Decision, s: Strategy, work: KernelWork,
                    fwd: float, bwd: float) -> Times:
    """The kernel's (forward, backward) seconds with every surcharge that applies, and the
    recompute that follows."""
    for surcharge in _SURCHARGES:
        if surcharge.applies(tables, d, work):
            fwd, bwd = surcharge.add(tables, d, s, work, fwd, bwd)
    return fwd, bwd, recompute_s(tables, d, fwd)


def recompute_s(tables: CostTables, d: Decision, fwd: float) -> float:
    """Seconds ``d`` runs again in backward: its forward, when it is recomputed."""
    return fwd if (tables.recomputed(d) and d.facts.requires_grad) else 0.0
