"""Activations in the cost tables: the bytes each op keeps of its own for backward, the
bytes of a value kept in a placement, and what the peak counts twice.

Which saved tensors are kept at all under recomputation is
:mod:`autopar.solver.pricing.recompute_tables`'s; this module sizes them. A part of
:class:`autopar.solver.pricing.costs.CostTables` (a mixin).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.analysis.precision import BYTES, stored_word
from autopar.core.placements import Placement, divisor
from autopar.ops.loss_ops import chunked_saved_floats
from autopar.solver.model.problem import Decision, ValueKey
from autopar.solver.pricing.traced_ops import PARAM_VIEWS, numel
from autopar.strategies import Strategy

FP8_COPY = "fp8 copy"


def fp8_copy(placement: Placement) -> tuple[str, Placement]:
    """The key of the fp8 copy an fp8 linear keeps of a value read in ``placement`` (a
    saved "placement" of its own: :meth:`CostTables.saved_bytes`)."""
    return (FP8_COPY, placement)


class ActivationTables:
    """Bytes kept for backward: an op's own, and a value's in one placement."""

    def local_output_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of one instance's (first) output on one device, per microbatch."""
        if not d.facts.shapes or not s.outputs:
            return 0.0
        return self.value_bytes((d.index, 0)) / divisor(s.outputs[0], self.setting.tp)

    def transient_output_bytes(self, d: Decision, s: Strategy) -> float:
        """The output bytes the peak counts twice (an output beside its gradient): none for
        the logits a chunked cross-entropy reads (and the views and cast between), whose
        backward transients the loss prices (:meth:`loss_working_bytes`)."""
        if d.nodes[0].name in self._chunked_loss_inputs or self._viewed_param(d) is not None:
            return 0.0  # (a view of a weight is no new tensor)
        return self.local_output_bytes(d, s)

    def saved_bytes(self, key: ValueKey, placement: Placement | tuple) -> float:
        """Bytes of one instance of a value kept for backward, in ``placement`` (or the
        one-byte :func:`fp8_copy` an fp8 linear keeps of it in that placement)."""
        d = self.problem.decisions[key[0]]
        if isinstance(placement, tuple) and placement[0] == FP8_COPY:
            elements = self.value_bytes(key) / self.precision.bytes_per_element(d.facts.name)
            return elements / divisor(placement[1], self.setting.tp)
        param = d if d.kind == "param" else self._viewed_param(d)
        if param is not None:  # weights are counted as parameters; their working copies:
            return (self._working_copy_bytes(param) / divisor(placement, self.setting.tp)
                    / self.expert_divisor(param))
        whole = self.value_bytes(key)
        argument = self.problem.not_run.get(d.name)
        if argument is not None and whole:  # the kernel keeps the argument (grouped keys)
            whole = min(whole, self.value_bytes(self.problem.value_key(
                self.problem.node_named(argument))))
        return whole / divisor(placement, self.setting.tp)

    def _viewed_param(self, d: Decision) -> Decision | None:
        """The parameter ``d`` is a view of (a transposed weight a grouped matmul keeps for
        backward shares the weight's storage), or None."""
        if d.kind != "op":
            return None
        node = d.nodes[0]
        while node.op == "call_function" and node.target in PARAM_VIEWS and node.args:
            node = node.args[0]
            if not isinstance(node, fx.Node):
                return None
        if node.op != "get_attr" or node.name not in self.problem.decision_of:
            return None
        return self.problem.decisions[self.problem.decision_of[node.name]]

    def _working_copy_bytes(self, d: Decision) -> float:
        """The low-precision copy of an fp32 weight a matmul keeps for backward, per
        microbatch in flight, where each use makes its own (``weight_copies="use"``; the
        runtime's one copy a step is :meth:`step_copy_bytes`); none where the layer
        recomputes it (full, op) or ZeRO-3 gathers in the low precision."""
        if (d.index not in self._low_read_params or d.facts.param is None
                or self.copied_once_a_step(d)):
            return 0.0
        if self.setting.recompute in ("full", "op") and d.facts.layer is not None:
            return 0.0
        return d.facts.param.numel * BYTES[stored_word(self.options.precision)]

    def own_activation(self, d: Decision, s: Strategy, *, recompute: bool = True) -> float:
        """Bytes one instance keeps of its own (its output, its buffers) for backward."""
        facts = d.facts
        if d.kind != "op" or not facts.requires_grad or (recompute and self.recomputed(d)):
            return 0.0
        div = self.setting.tp if s.splits_work else 1
        # Float buffers (statistics, LSEs) follow the compute precision, or fp32 for the ops
        # autocast runs in fp32 (the loss's log-softmax); masks keep their bytes.
        chunked = self._chunked_loss(d)
        floats, fixed = self.kept_extras(d)
        if chunked is None:
            float_bytes = floats * self.float_bytes(facts)
        else:  # one fp32 log-sum-exp a token, and the logits themselves
            tokens, classes, logit_bytes = chunked
            float_bytes = chunked_saved_floats(tokens) * 4 + tokens * classes * logit_bytes
        total = (float_bytes + fixed) * self._scale(d) / div
        if facts.saves_output and s.outputs:
            total += self.value_bytes((d.index, 0)) / divisor(s.outputs[0], self.setting.tp)
        return total

    def kept_extras(self, d: Decision) -> tuple[float, float]:
        """(float elements in the compute dtype, bytes of the rest) that ``d`` keeps for
        backward beside its inputs and output, as traced. At an SDPA site recognised as
        causal the runtime's kernel takes ``causal=True`` and never sees the mask: it keeps
        one fp32 log-sum-exp per query row (FlashAttention), not what the tracing machine's
        kernel kept (PyTorch's CPU kernel turns a boolean mask into a float one and keeps
        it: batch x seq x seq floats)."""
        facts = d.facts
        if self._causal_sdpa(d):
            return 0.0, numel(facts.shapes[0][:-1]) * 4.0
        return float(facts.extra_saved_float_numel), float(facts.extra_saved_other_bytes)

    def activation_memory(self, d: Decision, s: Strategy) -> float:
        return self.own_activation(d, s) * d.count
