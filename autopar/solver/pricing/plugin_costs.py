"""What an op costs that a plugin prices itself (``cost_models/op_costs.py``): the plugin's
function gets this device's share of the op's FLOPs and bytes and says the seconds.

A kind of :mod:`autopar.solver.pricing.kinds`, tried before the pricing of traced kernels
(and before a chunked loss's, should a plugin price the loss).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_models.op_costs import OpCostQuery, op_cost_for
from autopar.solver.model.problem import Decision
from autopar.solver.pricing.kernel_work import kernel_work
from autopar.solver.pricing.kinds import Times, recompute_s, register_kind
from autopar.strategies import Strategy

if TYPE_CHECKING:
    from autopar.solver.pricing.costs import CostTables


def plugin_priced(tables: CostTables, d: Decision) -> bool:
    """Whether a plugin registered a cost for ``d``'s op."""
    return op_cost_for(d.facts.target) is not None


@register_kind("plugin op", order=30, applies=plugin_priced)
def plugin_times(tables: CostTables, d: Decision, s: Strategy) -> Times:
    """The plugin's (forward, backward) seconds; no backward for an op outside autograd."""
    facts = d.facts
    work = kernel_work(tables, d, s)
    fwd, bwd = op_cost_for(facts.target)(OpCostQuery(work.flops, work.moved, work.device,
                                                     work.dtype, work.shape,
                                                     facts.requires_grad))
    bwd = bwd if facts.requires_grad else 0.0
    return fwd, bwd, recompute_s(tables, d, fwd)
