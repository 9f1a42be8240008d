"""What recomputation keeps and what it runs again, per op and per saved tensor.

Recomputation (``Setting.recompute``):

- ``none``: autograd keeps what it saves.
- ``selective`` (Korthikanti et al.): tensors whose shape holds the sequence length twice
  (attention scores, softmax, its dropout mask) are not kept; the ops that make them run
  again in backward. Flash-style attention already works this way, so then it changes
  nothing.
- ``full``: each repeated layer keeps only its inputs; its forward (with its collectives)
  runs again in backward, one layer at a time.
- ``op`` (torchtitan's per-op selective policy): in each repeated layer the outputs of the
  weight matmuls are kept except every second one (in program order), and attention's
  outputs are kept; every other op of the layer runs again in backward, one layer at a time
  (``passes/checkpoint_layers.py`` executes the same policy).

A part of :class:`autopar.solver.pricing.costs.CostTables` (a mixin).
"""

from __future__ import annotations

from autopar.core.graph_facts import META_KEY, NodeFacts
from autopar.solver.model.problem import Decision, Use, ValueKey
from autopar.solver.pricing.traced_ops import MATMUL_TARGETS


class RecomputeTables:
    """Which ops run again in backward and which saved tensors are really kept."""

    def in_recomputed_layer(self, d: Decision) -> bool:
        return self.setting.recompute == "full" and d.facts.layer is not None

    @property
    def op_policy_saved(self) -> frozenset[str]:
        """Nodes whose outputs the ``op`` policy keeps: in each layer, the 1st, 3rd, ...
        matmul with a weight, and every attention op (a fact of the graph: once per
        problem)."""
        cache = self.problem.cache
        if "op_policy_saved" not in cache:
            saved, counts = set(), {}
            for node in self.problem.gm.graph.nodes:
                facts = node.meta.get(META_KEY)
                if facts is None or facts.layer is None or node.op != "call_function":
                    continue
                if ("scaled_dot_product" in facts.target
                        or node.name in self.problem.fused_attention):
                    saved.add(node.name)
                elif facts.target in MATMUL_TARGETS and facts.fwd_flops:
                    counts[facts.layer] = counts.get(facts.layer, 0) + 1
                    if counts[facts.layer] % 2:
                        saved.add(node.name)
            cache["op_policy_saved"] = frozenset(saved)
        return cache["op_policy_saved"]

    def checkpoint_keeps(self, use: Use, producer: Decision) -> bool:
        """Does the checkpoint of the consumer's layer keep a value no op saves (measured with
        ``autopar.calibrate.live_bytes``: issue 11)? Non-reentrant checkpointing holds the
        arguments of the layer's call, so under ``full`` and ``op`` a layer keeps its inputs
        however its first ops use them; and the ``op`` policy caches the outputs of the ops
        it saves for the recomputation, whether or not backward reads them (a query
        projection rotary embedding reads, a down projection the residual add reads).
        Weights are counted as parameters."""
        consumer = self.problem.decisions[use.consumer]
        mode = self.setting.recompute
        if (mode not in ("full", "op") or consumer.facts.layer is None or producer.kind != "op"
                or self._viewed_param(producer) is not None):
            return False
        if not use.same_layer:
            return True
        return (mode == "op" and producer.nodes[0].name in self.op_policy_saved
                and not producer.facts.saves_output)  # else counted as its own activation

    def op_recomputed(self, d: Decision) -> bool:
        """Under the ``op`` policy, is ``d`` a layer op that runs again in backward?"""
        return (self.setting.recompute == "op" and d.facts.layer is not None
                and d.kind == "op" and d.nodes[0].name not in self.op_policy_saved)

    def quadratic(self, facts: NodeFacts, output: int = 0) -> bool:
        """Does this output hold the sequence length twice (attention scores)?"""
        s = self.seq_len
        if not s or s <= 1 or output >= len(facts.shapes):
            return False
        return list(facts.shapes[output]).count(s) >= 2

    def fused_quadratic(self, d: Decision, output: int = 0) -> bool:
        """A sequence-squared tensor inside fused attention: the kernel never writes it, and
        its backward recomputes it (FlashAttention), as selective recomputation would."""
        return d.name in self.problem.fused_attention and self.quadratic(d.facts, output)

    def recomputed(self, d: Decision) -> bool:
        """Does ``d`` run again in backward instead of keeping what it saves?"""
        if self.in_recomputed_layer(d) or self.fused_quadratic(d) or self.op_recomputed(d):
            return True
        return self.setting.recompute == "selective" and self.quadratic(d.facts)

    def keeps(self, use: Use, key: ValueKey) -> bool:
        """Is a tensor a consumer saves for backward really kept under recomputation? (Or,
        read by a checkpointed layer, kept by the checkpoint: :meth:`checkpoint_keeps`.)
        Not when an fp8 linear reads it: that keeps an fp8 copy instead
        (:meth:`keeps_fp8_copy`, :meth:`step_copy_bytes`)."""
        return not self._fp8_reader(use) and self._kept(use, key)

    def keeps_fp8_copy(self, use: Use, key: ValueKey) -> bool:
        """Does an fp8 linear keep an fp8 copy of this activation for backward? One copy
        per tensor however many linears read it (``fp8_ops`` quantizes a tensor once), in
        the placement they read: a :func:`fp8_copy` of it (:meth:`saved_bytes`)."""
        return (self._fp8_reader(use) and self._kept(use, key)
                and self._weight_of(self.problem.decisions[key[0]]) is None)

    def _kept(self, use: Use, key: ValueKey) -> bool:
        if use.consumer < 0:
            return False
        producer = self.problem.decisions[key[0]]
        if not use.saves:
            return self.checkpoint_keeps(use, producer)
        inside = self.problem.fused_elementwise.get(producer.name)
        if inside is not None and inside.written:  # it never leaves its fused kernel, whose
            return False  # backward recomputes it from the kernel's inputs (TE, Inductor)
        if self.setting.recompute == "selective" and self.quadratic(producer.facts, key[1]):
            return False
        if self.fused_quadratic(producer, key[1]):
            return False
        consumer = self.problem.decisions[use.consumer]
        if self.in_recomputed_layer(consumer):
            return not use.same_layer  # only the layer's inputs are kept
        if self.op_recomputed(producer) and use.same_layer:
            return False  # made again when the layer's backward recomputes it
        return True
