"""What a plan's per-node precision changes in the cost tables: the dtype each op computes
and stores in, the fp32 weights low-precision ops cast, and the fp8 linears with the weight
copies they keep.

A part of :class:`autopar.solver.pricing.costs.CostTables` (a mixin). The casts and
quantization kernels themselves are priced in :mod:`autopar.solver.pricing.precision_costs`.
"""

from __future__ import annotations

from functools import cached_property

from autopar.analysis.precision import BYTES, PrecisionAssignment, stored_word
from autopar.core.graph_facts import NodeFacts
from autopar.core.placements import divisor
from autopar.solver.model.problem import Decision, Use
from autopar.solver.pricing.precision_costs import precision_assignment, precision_key
from autopar.solver.pricing.traced_ops import AUTOCAST_FP32_TARGETS, param_args
from autopar.strategies import Strategy


class PrecisionTables:
    """Per-node dtypes, fp32 weight casts and fp8 linears."""

    @cached_property
    def precision(self) -> PrecisionAssignment:
        """Which dtype each node computes and stores in (:mod:`autopar.analysis.precision`); shared
        by every setting with the same parameter dtype."""
        return precision_assignment(self.problem, self.options, self.setting.zero)

    def dtype(self, d: Decision) -> str:
        """The dtype ``d``'s kernel computes in (its peak FLOP/s)."""
        return self.precision.word(d.nodes[0].name)

    def _stored_fraction(self, d: Decision) -> float:
        """Bytes of one element ``d`` stores, over fp32's (what traced byte counts assume)."""
        return self.precision.bytes_per_element(d.nodes[0].name) / 4

    def float_bytes(self, facts: NodeFacts) -> int:
        """Bytes of one float element an op makes: the compute precision's, except for the
        losses autocast runs in fp32 (``torch.amp``'s fp32 op list: ``log_softmax``,
        ``nll_loss``, ``cross_entropy``), which read and keep fp32 whatever the precision."""
        return 4 if facts.target in AUTOCAST_FP32_TARGETS else self.precision.bytes_per_element(
            facts.name)

    # --- fp32 weights read in a low precision --------------------------------------------
    @cached_property
    def _low_read_params(self) -> frozenset[int]:
        """Decisions of parameters a low-precision node reads in fp32: each read casts a
        working copy (kept for backward by the matmul), as torch.autocast does (once per
        problem and precision assignment)."""
        return self._fp32_reads(skip=("fp32",))

    @cached_property
    def _16bit_read_params(self) -> frozenset[int]:
        """The parameters of :attr:`_low_read_params` a 16-bit node reads (an fp8 linear
        quantizes its fp32 weight itself)."""
        return self._fp32_reads(skip=("fp32", "fp8"))

    def _fp32_reads(self, skip: tuple[str, ...]) -> frozenset[int]:
        """Decisions of fp32 parameters read by a node computing in a word not in ``skip``
        (once per problem and precision assignment: every setting of a search asks)."""
        p = self.precision
        if p.params != "fp32":
            return frozenset()
        key = ("fp32 reads", skip, precision_key(self.options, self.setting.zero))
        if key not in self.problem.cache:
            self.problem.cache[key] = self._reads_in_fp32(p, skip)
        return self.problem.cache[key]

    def _reads_in_fp32(self, p: PrecisionAssignment, skip: tuple[str, ...]) -> frozenset[int]:
        out = set()
        for name, word in p.enforced.items():
            if word in skip or name not in self.problem.decision_of:
                continue
            node = self.problem.decisions[self.problem.decision_of[name]].nodes[0]
            out.update(self.problem.decision_of[arg.name] for arg, _ in param_args(node)
                       if arg.name in self.problem.decision_of)
        return frozenset(out)

    def _weight_cast_bytes(self, d: Decision) -> float:
        """Bytes one forward of ``d`` moves casting fp32 weights to its low precision
        (read 4, write the copy), whole over tp."""
        word = self.precision.enforced.get(d.nodes[0].name)
        if word in (None, "fp32") or self.precision.params != "fp32":
            return 0.0
        return sum(facts.param.numel * (4 + BYTES[word])
                   for _, facts in param_args(d.nodes[0]))

    # --- fp8 linears -----------------------------------------------------------------------
    def fp8_linear(self, d: Decision) -> bool:
        """Does ``d`` run as an fp8 linear (``autopar.ops.fp8_ops``)?"""
        return d.kind == "op" and self.dtype(d) == "fp8"

    def step_copy_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of the low-precision weight copies ``d`` holds once for the whole step,
        shared by its microbatches (``weight_copies="step"``: autopar's runtime,
        :mod:`autopar.ops.step_copies`), so the memory model counts them beside the weights,
        not per microbatch in flight: a parameter's 16-bit working copy (the shard ``s``
        stores), an fp8 linear's fp8 copy of the weight it reads (one byte an element, the
        shard it reads; its input's copy is a value's, :meth:`keeps_fp8_copy`). Measured on
        CPU with ``autopar.calibrate.live_bytes`` (tests/test_activation_memory.py)."""
        if self.options.weight_copies == "use":  # made where it is read, kept per microbatch
            return 0.0
        total = self.step_16bit_copy_bytes(d, s)
        for slot, param in self._fp8_weights.get(d.index, {}).items():
            total += (param.facts.param.numel / self.expert_divisor(param)
                      / divisor(s.inputs[slot], self.setting.tp))
        return total

    def step_16bit_copy_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of the 16-bit copy of the fp32 parameter ``d`` (the shard ``s`` stores) the
        step makes once (``weight_copies="step"``), or 0."""
        if not self.copied_once_a_step(d) or not s.outputs:
            return 0.0
        return (d.facts.param.numel * BYTES[stored_word(self.options.precision)]
                / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d))

    def copied_once_a_step(self, d: Decision) -> bool:
        """Is ``d`` an fp32 parameter the step casts to 16 bits once (``weight_copies``)?"""
        return (self.options.weight_copies == "step" and d.kind == "param"
                and d.index in self._16bit_read_params)

    def step_cast_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes the step's one cast of ``d`` moves: its fp32 shard read, the copy written."""
        return self.step_16bit_copy_bytes(d, s) * (
            1 + 4 / BYTES[stored_word(self.options.precision)])

    def weight_grad_transient(self, d: Decision, s: Strategy) -> float:
        """Bytes of the gradient backward makes for the trainable parameter ``d`` before it
        is accumulated into the one kept: in the parameter's dtype, and before it the 16-bit
        one where a 16-bit node read the fp32 weight (measured on CPU beside the kept
        gradients: tests/test_precision_runtime.py)."""
        numel = self.trainable_numel(d, s)
        if not numel:
            return 0.0
        low = (BYTES[stored_word(self.options.precision)]
               if d.index in self._low_read_params else 0)
        return numel * (BYTES[self.precision.params] + low)

    def casts_weights_once(self, d: Decision) -> bool:
        """Does the step cast the fp32 weights 16-bit ``d`` reads once, not per use?"""
        word = self.precision.enforced.get(d.nodes[0].name)
        return self.options.weight_copies == "step" and word not in (None, "fp32", "fp8")

    @property
    def fp8_readers(self) -> frozenset[int]:
        """Decisions (indices) of the fp8 linears, which keep fp8 weight copies."""
        return frozenset(self._fp8_weights)

    def _fp8_reader(self, use: Use) -> bool:
        return use.consumer >= 0 and use.saves and self.fp8_linear(
            self.problem.decisions[use.consumer])

    def _weight_of(self, d: Decision) -> Decision | None:
        """The parameter ``d`` is, or is a view of; else None."""
        param = d if d.kind == "param" else self._viewed_param(d)
        return param if param is not None and param.facts.param is not None else None

    @property
    def _fp8_weights(self) -> dict[int, dict[int, Decision]]:
        """Per fp8 linear (decision index), the weight each input slot reads (once per
        problem and precision assignment: every setting of a search asks)."""
        key = ("fp8 weights", precision_key(self.options, self.setting.zero))
        if key not in self.problem.cache:
            out: dict[int, dict[int, Decision]] = {}
            for value, info in self.problem.values.items():
                param = self._weight_of(self.problem.decisions[value[0]])
                for use in info.uses if param is not None else ():
                    if self._fp8_reader(use):
                        out.setdefault(use.consumer, {})[use.slot] = param
            self.problem.cache[key] = out
        return self.problem.cache[key]
