"""Tensor-parallel communication in the cost tables: what an edge costs when its producer
and consumer placements differ, and a partial gradient's reduction.

Each message is priced once (``Problem.cache``): the values of a model are of few sizes,
and every setting of a search asks again. A part of
:class:`autopar.solver.pricing.costs.CostTables` (a mixin); the formulas are
:mod:`autopar.cost_models.redistribute`'s.
"""

from __future__ import annotations

from autopar.analysis.precision import BYTES, stored_word
from autopar.core.placements import Placement
from autopar.cost_models.comm import collective_transfer_time
from autopar.cost_models.redistribute import partial_grad_time, redistribution_time
from autopar.solver.model.problem import ValueKey


class RedistributionTables:
    """Seconds of one instance of a value's redistributions on the tp axis."""

    def redistribution(self, key: ValueKey, src: Placement, dst: Placement) -> float:
        """Forward + backward seconds of one instance's redistribution; a value made inside a
        fully recomputed layer is redistributed again when the layer reruns."""
        memo = (key, src, dst, self.in_recomputed_layer(self.problem.decisions[key[0]]))
        if memo not in self._moves:
            self._moves[memo] = self._redistribution(key, src, dst)
        return self._moves[memo]

    def redistribution_forward(self, key: ValueKey, src: Placement, dst: Placement) -> float:
        """The forward collectives' part of :meth:`redistribution` (a recomputed layer's
        rerun included): what runs beside the forward matmuls."""
        nbytes = self.value_bytes(key) * self._wire_fraction(key)
        reruns = 2 if self.in_recomputed_layer(self.problem.decisions[key[0]]) else 1
        return reruns * self._move_time(src, dst, nbytes, False)

    def _redistribution(self, key: ValueKey, src: Placement, dst: Placement) -> float:
        nbytes = self.value_bytes(key) * self._wire_fraction(key)
        t = self._move_time(src, dst, nbytes, self.requires_grad(key))
        if self.in_recomputed_layer(self.problem.decisions[key[0]]):
            t += self._move_time(src, dst, nbytes, False)
        return t

    def _move_time(self, src: Placement, dst: Placement, nbytes: float, backward: bool) -> float:
        """``redistribution_time`` on the tp axis, once per message: the values of a model
        are of few sizes, and every microbatch size of a search asks again."""
        times = self.problem.cache.setdefault(
            ("move times", self.setting.tp, self.tp_link, self.cluster.backend), {})
        memo = (src, dst, nbytes, backward)
        if memo not in times:
            times[memo] = redistribution_time(src, dst, nbytes, self.setting.tp, self.tp_link,
                                              backward=backward, backend=self.cluster.backend)
        return times[memo]

    def _wire_fraction(self, key: ValueKey) -> float:
        """The share of a value's bytes its collectives move: when every reader computes in
        one lower precision, the value is cast before it is communicated
        (``passes/cast_precision.py``)."""
        d = self.problem.decisions[key[0]]
        if d.kind != "op" or self.options.precision == "fp32":
            return 1.0
        words = set()
        for use in self.problem.values[key].uses:
            if use.consumer < 0:
                return 1.0
            consumer = self.problem.decisions[use.consumer].nodes[0].name
            word = self.precision.enforced.get(consumer)
            if word is None:
                return 1.0
            words.add(stored_word(word))
        if len(words) != 1:
            return 1.0
        have = self.precision.bytes_per_element(d.nodes[0].name)
        return min(BYTES[words.pop()] / have, 1.0)

    def partial_grad(self, key: ValueKey, src: Placement) -> float:
        if not self.requires_grad(key):
            return 0.0
        nbytes, n = self.value_bytes(key), self.setting.tp
        deferred = self.setting.zero == 0 and self.setting.pp == 1
        if self.problem.decisions[key[0]].kind == "param" and deferred:
            # A weight's partial gradient joins one bucketed all-reduce per step (the
            # runtime defers them under DDP): its bytes, without a latency of its own.
            return collective_transfer_time("all_reduce", nbytes, n, self.tp_link)
        return partial_grad_time(src, nbytes, n, self.tp_link, self.cluster.backend)
