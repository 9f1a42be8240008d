"""Op times in the cost tables: (forward, backward, recompute) seconds of one instance of a
decision under a strategy, cached per layout.

An op's kernel is priced by its kind (:mod:`autopar.solver.pricing.kinds`, whose kinds
this module imports so that they are registered); here are what every kind shares: the
op's local matmul shape, the weights it reads whole, autograd's gradient sums, an op that
runs no kernel, and cp attention's exposed communication. A part of
:class:`autopar.solver.pricing.costs.CostTables` (a mixin).
"""

from __future__ import annotations

from autopar.cost_models.compute import compute_share, op_time
from autopar.solver.model.problem import Decision
from autopar.solver.pricing import (  # noqa: F401  (their kinds and surcharges register)
    attention_costs,
    kernel_costs,
    loss_costs,
    plugin_costs,
    surcharges,
)
from autopar.solver.pricing.kinds import Times, price_kernel, recompute_s
from autopar.solver.pricing.traced_ops import FLOAT_DTYPES, itemsize, matmul_shape, param_args
from autopar.strategies import Strategy


class KernelTables:
    """Seconds of one instance of an op, and of all its instances."""

    def times(self, d: Decision, s: Strategy, comm: bool = True) -> tuple[float, float, float]:
        """(forward, backward, recompute) seconds of one instance of ``d`` under ``s``; at
        an attention site under cp, with the algorithm's exposed communication unless
        ``comm`` is False."""
        key = (d.index, s)
        if key not in self._times:
            self._times[key] = self._compute_times(d, s)
        f, b, r = self._times[key]
        extra = self.context_comm(d, s) if comm and self._context_sites else None
        if extra is None:
            return f, b, r
        return f + extra.forward_s, b + extra.backward_s, r + (extra.forward_s if r else 0.0)

    def compute(self, d: Decision, s: Strategy) -> tuple[float, float]:
        """(forward, backward including recomputation) of all instances of ``d``."""
        f, b, r = self.times(d, s)
        return f * d.count, (b + r) * d.count

    def _kernel_times(self, d: Decision, s: Strategy) -> Times:
        """An op's kernel, priced by the first kind that applies to it."""
        return price_kernel(self, d, s)

    def _gradient_sums(self, d: Decision, s: Strategy) -> float:
        """Backward seconds autograd spends summing ``d``'s output gradients: a value read
        by k differentiable ops gets k gradients, added into one buffer (k - 1 kernels, each
        reading two and writing one value-sized tensor) before ``d``'s own backward runs --
        the residual stream, a norm's output feeding q, k and v. A fusing program
        (``PlanOptions.fuse_elementwise``) folds the sums into its backward kernels."""
        facts = d.facts
        if not facts.requires_grad or self.problem.fused_elementwise:
            return 0.0
        decisions, total = self.problem.decisions, 0.0
        div = self.setting.tp if s.splits_work else 1
        for output, dtype in enumerate(facts.dtypes):  # a split's pieces each
            info = self.problem.values.get((d.index, output))
            if info is None or dtype not in FLOAT_DTYPES:
                continue
            edges = sum(u.count for u in info.uses
                        if u.consumer >= 0 and decisions[u.consumer].facts.requires_grad)
            extra = edges / d.count - 1
            if extra > 0:
                value = self.value_bytes((d.index, output)) / div
                total += extra * op_time(0.0, 3 * value, self.cluster.device, self.dtype(d))
        return total

    def _view_times(self, d: Decision) -> Times:
        """An op that runs no kernel (a view; a dropout that returns its input): the host's
        dispatch and autograd node per pass, ``device.view_s`` (0 on GPUs). A Python
        ``getitem`` on a node's outputs dispatches nothing."""
        facts = d.facts
        if not facts.target.startswith("aten."):
            return 0.0, 0.0, 0.0
        seconds = self.cluster.device.view_s / compute_share(self.cluster.device)
        bwd = seconds if facts.requires_grad else 0.0
        return seconds, bwd, recompute_s(self, d, seconds)

    def _local_matmul(self, d: Decision, scale: float) -> tuple[int, int, int] | None:
        """(m, n, k) of this device's part of a matmul: the batch scale shrinks m, sharding
        shrinks the larger of m and n (a close stand-in for which dim the strategy splits)."""
        shapes = self.problem.graph_cache.setdefault("matmul_shapes", {})  # one per graph
        node = d.nodes[0]
        if node not in shapes:
            shapes[node] = matmul_shape(node)
        shape = shapes[node]
        if shape is None:
            return None
        m, n, k = shape
        batch_part = self._scale(d)
        m = max(int(m * batch_part), 1)
        split = batch_part / scale if scale else 1.0  # the tp divisor
        if split > 1:
            if m >= n:
                m = max(int(m / split), 1)
            else:
                n = max(int(n / split), 1)
        return m, n, k

    def _weight_read_bytes(self) -> dict[int, float]:
        """Traced bytes of the parameters each op that computes (a matmul, a convolution)
        reads directly, by decision: it reads them whole, so unlike its activations they do
        not shrink with the microbatch. An embedding's lookup reads only the rows it gathers,
        which do (once per problem)."""
        key = "weight_read_bytes"
        if key not in self.problem.cache:
            out: dict[int, float] = {}
            for d in self.problem.decisions:
                if d.kind != "op" or not d.facts.fwd_flops:
                    continue
                total = sum(facts.param.numel * itemsize(str(facts.dtypes[0]))
                            for _, facts in param_args(d.nodes[0]))
                if total:
                    out[d.index] = total
            self.problem.cache[key] = out
        return self.problem.cache[key]
