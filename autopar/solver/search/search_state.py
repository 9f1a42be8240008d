"""What one search carries from setting to setting.

The outer search (:mod:`autopar.solver.search.mesh_search`) makes one :class:`SearchState`;
the microbatch search and the layout solves (:mod:`autopar.solver.search.microbatches`,
:mod:`autopar.solver.search.layout_solves`) read its inputs and add to what it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.analysis.batch_coupling import Coupling
from autopar.core.cluster import Cluster
from autopar.core.graph_facts import GraphFacts
from autopar.solver.model.cpsat import SolveResult
from autopar.solver.options import PlanOptions
from autopar.solver.search.candidate import Candidate
from autopar.solver.search.solve_ahead import SolveAhead


@dataclass
class SolveBudget:
    """CP-SAT solves the search may still run (``PlanOptions.max_solves``). A count, not
    seconds: the same inputs give the same plan on any machine. Once spent, a setting is
    priced only with a layout solved before (``reached`` then tells the plan to say so)."""

    limit: int | None
    used: int = 0
    refused: int = 0  # settings left unsolved for want of budget

    def allows(self) -> bool:
        if self.limit is not None and self.used >= self.limit:
            self.refused += 1
            return False
        self.used += 1
        return True

    @property
    def reached(self) -> bool:
        return self.refused > 0


@dataclass
class SearchState:
    """The search's fixed inputs, and what it gathers: every candidate tried (in order),
    the layouts solved so far (by ``layout_solves.reuse_key``), the solve budget, and the
    worker solving ahead."""

    cluster: Cluster
    options: PlanOptions
    facts: GraphFacts
    traced: int  # the traced graph's batch
    n_layers: int
    couplings: list[Coupling]  # ops whose statistics a split of the batch changes
    candidates: list[Candidate]
    layouts: dict[tuple, SolveResult]
    budget: SolveBudget | None
    ahead: SolveAhead
