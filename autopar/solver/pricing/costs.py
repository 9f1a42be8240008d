"""Cost coefficients of one planning problem at one setting, from the cost models.

Everything here is per microbatch, per device and **per graph instance**: a decision that
stands for 80 identical layers costs 80 times what these methods return (``count``), and a
pipeline stage holding 20 of those layers costs 20 times. The CP-SAT model and the exact
evaluation of a chosen plan both read these numbers, so the plan's prediction is the
solver's objective.

:class:`CostTables` is the one object the solver asks; its methods come by concern from
the mixins it is made of:

- :mod:`~autopar.solver.pricing.value_sizes`: a value's bytes at the setting;
- :mod:`~autopar.solver.pricing.kernel_tables`: op times, each op's kernel priced by its
  kind (:mod:`~autopar.solver.pricing.kinds`);
- :mod:`~autopar.solver.pricing.redistribution_tables`: tensor-parallel redistributions;
- :mod:`~autopar.solver.pricing.attention_tables`: attention sites and context parallelism;
- :mod:`~autopar.solver.pricing.precision_tables`: per-node dtypes, weight casts, fp8;
- :mod:`~autopar.solver.pricing.recompute_tables`: what recomputation keeps and reruns
  (the modes are described there);
- :mod:`~autopar.solver.pricing.activation_tables`,
  :mod:`~autopar.solver.pricing.state_tables` and :class:`~autopar.solver.pricing.loss_costs.LossTables`:
  memory;
- :mod:`~autopar.solver.pricing.expert_tables`: expert parallelism.
"""

from __future__ import annotations

from autopar.core.cluster import Cluster, LinkSpec
from autopar.cost_models.comm import axis_link
from autopar.cost_models.context_parallel import AttentionComm
from autopar.cost_models.memory import activation_bytes_per_element
from autopar.solver.model.problem import Decision, Problem
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.activation_tables import ActivationTables, fp8_copy
from autopar.solver.pricing.attention_tables import AttentionTables, runs_generated_attention
from autopar.solver.pricing.expert_tables import ExpertTables
from autopar.solver.pricing.kernel_tables import KernelTables
from autopar.solver.pricing.loss_costs import LossTables
from autopar.solver.pricing.precision_costs import precision_key
from autopar.solver.pricing.precision_tables import PrecisionTables
from autopar.solver.pricing.recompute_tables import RecomputeTables
from autopar.solver.pricing.redistribution_tables import RedistributionTables
from autopar.solver.pricing.state_tables import StateTables
from autopar.solver.pricing.traced_ops import identity_dropout
from autopar.solver.pricing.value_sizes import SizeTables
from autopar.solver.setting import Setting
from autopar.strategies import Strategy

__all__ = ["CostTables", "fp8_copy", "identity_dropout", "runs_generated_attention"]


class CostTables(SizeTables, KernelTables, RedistributionTables, AttentionTables,
                 PrecisionTables, RecomputeTables, ActivationTables, StateTables, LossTables,
                 ExpertTables):
    """The costs of one problem at one setting, cached for every setting that shares them."""

    def __init__(
        self,
        problem: Problem,
        cluster: Cluster,
        options: PlanOptions,
        setting: Setting,
        traced_batch: int,
        seq_len: int | None = None,
    ):
        self.problem = problem
        self.cluster = cluster
        self.options = options
        self.setting = setting
        self.traced_batch = traced_batch
        self.seq_len = seq_len
        self.tp_link: LinkSpec = axis_link(cluster, setting.mesh, "tp")
        self.dp_link: LinkSpec = axis_link(cluster, setting.mesh, "dp")
        self.element_bytes = activation_bytes_per_element(options.precision)
        # The solver, the bounds and every evaluation of a layout ask for the same
        # coefficients again: each is computed once for all the settings it depends on
        # (an op's times and a value's redistributions do not depend on dp, pp or the
        # pipeline schedule, which the search varies most).
        self.layout_key = (setting.tp, setting.microbatch, setting.recompute, setting.cp,
                           setting.cp_layout, precision_key(options, setting.zero), cluster,
                           self.tp_link, options.attention_kernel)
        """What an op's times, a value's redistributions and saved bytes depend on."""
        self._times: dict[tuple, tuple[float, float, float]] = problem.cache.setdefault(
            ("times", *self.layout_key), {})
        # A redistribution depends on the recomputation only by whether its layer reruns
        # (its key says so): shared by the settings that differ only in the mode.
        self._moves: dict[tuple, float] = problem.cache.setdefault(
            ("moves", setting.tp, setting.microbatch, setting.cp, setting.cp_layout,
             precision_key(options, setting.zero), cluster, self.tp_link), {})
        self._comm: dict[tuple, AttentionComm] = {}
        # choice -> its unit costs, and ("cut", choice, schedule, virtual) -> its stage cut
        # (autopar.solver.search.mesh_search prices a layout uniformly, then per layer, from the same)
        self.units: dict[tuple, object] = {}

    def _compute_times(self, d: Decision, s: Strategy) -> tuple[float, float, float]:
        """One instance's (forward, backward, recompute) seconds, uncached: nothing for an
        op the program never runs, the dispatch alone for one that runs no kernel (a view,
        an identity dropout), else its kernel's; and autograd's gradient sums."""
        if d.kind != "op" or d.name in self.problem.dead or d.name in self.problem.not_run:
            return 0.0, 0.0, 0.0
        if d.facts.is_view or identity_dropout(d.nodes[0]):  # no kernel: its dispatch only
            f, b, r = self._view_times(d)
        else:
            f, b, r = self._kernel_times(d, s)
        return f, b + self._gradient_sums(d, s), r
