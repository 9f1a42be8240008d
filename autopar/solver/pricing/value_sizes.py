"""How large one instance of a value is at a setting: the traced bytes scaled to the
microbatch and the cp share of the sequence, in the bytes its precision stores.

A part of :class:`autopar.solver.pricing.costs.CostTables` (a mixin reading its problem,
setting and precision).
"""

from __future__ import annotations

from autopar.analysis.batch_axis import batch_scaled
from autopar.core.graph_facts import NodeFacts
from autopar.solver.model.problem import Decision, ValueKey
from autopar.solver.pricing.traced_ops import FLOAT_DTYPES, itemsize, numel


class SizeTables:
    """Sizes of values per microbatch and device (whole over tp, local over dp)."""

    def _scale(self, d: Decision, output: int = 0) -> float:
        cp = self.setting.cp
        tokens = 1 / cp if cp > 1 and (d.index, output) in self._sequence_scaled else 1.0
        outs = d.batch.outputs
        if output < len(outs) and batch_scaled(outs[output]):
            return self.setting.microbatch / self.traced_batch * tokens
        if self._unmarked_batch(d, output):
            return self.setting.microbatch / self.traced_batch * tokens
        return tokens

    def _unmarked_batch(self, d: Decision, output: int) -> bool:
        """A helper tensor the batch marking could not follow (a mask indexed with
        ``arange(batch)``) that still has the traced batch as a dim: it shrinks with the
        microbatch too. Only tensors outside autograd qualify (activations are marked), and
        only when the batch size cannot be confused with the sequence length."""
        n = self.traced_batch
        if n <= 1 or n == self.seq_len or d.kind != "op" or d.facts.requires_grad:
            return False
        shapes = d.facts.shapes
        return output < len(shapes) and n in shapes[output]

    def _bytes(self, facts: NodeFacts, output: int) -> float:
        shape, dtype = facts.shapes[output], facts.dtypes[output]
        if dtype in FLOAT_DTYPES:
            return numel(shape) * self.precision.bytes_per_element(facts.name)
        return numel(shape) * itemsize(dtype)

    def value_bytes(self, key: ValueKey) -> float:
        """Bytes of one instance of a value per microbatch (whole over tp, local over dp);
        0 for a value the fused program never makes (Problem.dead)."""
        d = self.problem.decisions[key[0]]
        if d.name in self.problem.dead:
            return 0.0
        return self._bytes(d.facts, key[1]) * self._scale(d, key[1])

    def count(self, d: Decision) -> int:
        return d.count

    def value_count(self, key: ValueKey) -> int:
        return self.problem.decisions[key[0]].count

    def requires_grad(self, key: ValueKey) -> bool:
        return self.problem.decisions[key[0]].facts.requires_grad
