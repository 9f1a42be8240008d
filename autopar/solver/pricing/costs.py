"""Cost coefficients of one planning problem at one setting, from the cost models.

Everything here is per microbatch, per device and **per graph instance**: a decision that
stands for 80 identical layers costs 80 times what these methods return (``count``), and a
pipeline stage holding 20 of those layers costs 20 times. The CP-SAT model and the exact
evaluation of a chosen plan both read these numbers, so the plan's prediction is the
solver's objective.

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
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.fx as fx

from autopar.analysis.batch_axis import batch_scaled
from autopar.analysis.chunkable_loss import VIEWS, chunkable_loss, fp32_cast
from autopar.analysis.expert_sites import regions_of
from autopar.analysis.precision import (
    BYTES,
    PrecisionAssignment,
    stored_word,
)
from autopar.core.cluster import Cluster, LinkSpec
from autopar.core.graph_facts import META_KEY, NodeFacts
from autopar.core.knobs import CP_ALGORITHMS
from autopar.core.placements import Placement, Shard, divisor
from autopar.cost_models.comm import axis_link, collective_transfer_time, group_collective_time
from autopar.cost_models.compute import (
    allocation_time,
    arithmetic_times,
    attention_time,
    backward_time,
    bias_times,
    causal_fraction,
    compute_share,
    forward_time,
    op_time,
)
from autopar.cost_models.context_parallel import AttentionComm, causal_imbalance
from autopar.cost_models.memory import StateBytes, activation_bytes_per_element, model_state_bytes
from autopar.cost_models.op_costs import OpCostQuery, op_cost_for
from autopar.cost_models.redistribute import partial_grad_time, redistribution_time
from autopar.ops.loss_ops import chunked_saved_floats, chunked_working_bytes
from autopar.solver.axes.context import ContextSite, context_sites, sequence_scaled, site_comm
from autopar.solver.model.problem import Decision, Problem, Use, ValueKey
from autopar.solver.options import PlanOptions
from autopar.solver.pricing.loss_costs import chunked_loss_times
from autopar.solver.pricing.precision_costs import (
    fp8_quantize_times,
    inserted_cast_time,
    precision_assignment,
    precision_key,
)
from autopar.solver.setting import Setting
from autopar.strategies import Strategy

_FLOAT_DTYPES = {"float32", "float64", "float16", "bfloat16"}
AUTOCAST_FP32_TARGETS = frozenset({
    "aten.cross_entropy_loss.default", "aten.log_softmax.int", "aten._log_softmax.default",
    "aten.nll_loss.default", "aten.nll_loss_forward.default", "aten.nll_loss_nd.default",
})
"""Losses ``torch.autocast`` runs in fp32 (CUDA and CPU autocast fp32 lists)."""
MATMUL_TARGETS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default")
"""Ops the ``op`` policy counts as matmuls (a linear layer's, which the runtime sees as
``mm``/``addmm``)."""


FP8_COPY = "fp8 copy"


def fp8_copy(placement: Placement) -> tuple[str, Placement]:
    """The key of the fp8 copy an fp8 linear keeps of a value read in ``placement`` (a
    saved "placement" of its own: :meth:`CostTables.saved_bytes`)."""
    return (FP8_COPY, placement)


def matmul_shape(node: fx.Node) -> tuple[int, int, int] | None:
    """(m, n, k) of a matmul-like node, from its traced shapes (for shape-aware efficiency)."""
    facts: NodeFacts = node.meta[META_KEY]
    name = facts.target
    ins = [a.meta[META_KEY].shapes[0] for a in node.all_input_nodes
           if META_KEY in a.meta and a.meta[META_KEY].shapes]
    if not facts.shapes or not ins:
        return None
    out = facts.shapes[0]
    if "linear" in name and len(ins) >= 2:
        k = ins[0][-1]
        return _numel(out) // max(out[-1], 1), out[-1], k
    if "addmm" in name and len(ins) >= 3:
        return ins[1][0], ins[2][1], ins[1][1]
    if any(t in name for t in ("aten.mm", "aten.bmm", "aten.matmul", "baddbmm")):
        k = ins[0][-1]
        return _numel(out) // max(out[-1], 1), out[-1], k
    if "scaled_dot_product" in name:
        q = ins[0]
        return _numel(q) // max(q[-1], 1), ins[1][-2], q[-1]
    return None


_DROPOUTS = ("aten.dropout.default", "aten.feature_dropout.default",
             "aten.alpha_dropout.default", "aten.feature_alpha_dropout.default")


def identity_dropout(node: fx.Node) -> bool:
    """A dropout that ATen returns its input from unchanged (``p == 0``, or not training:
    ``_dropout_impl``), so it runs no kernel forward or backward. nanoGPT's default and
    most Llama configurations train with ``p == 0``.

    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> identity_dropout(g.call_function(torch.ops.aten.dropout.default, (x, 0.0, True)))
    True
    >>> identity_dropout(g.call_function(torch.ops.aten.dropout.default, (x, 0.1, True)))
    False
    """
    if node.op != "call_function" or str(node.target) not in _DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return (isinstance(p, (int, float)) and p == 0) or train is False


def _has_bias(node: fx.Node) -> bool:
    """Whether a linear or addmm node adds a bias (an input tensor beyond its two operands)."""
    target = node.meta[META_KEY].target
    if "linear" in target:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return isinstance(bias, fx.Node)
    return "addmm" in target


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def runs_generated_attention(cluster: Cluster, options: PlanOptions) -> bool:
    """Whether fused attention sites run (and are priced as) autopar's generated kernel: on
    GPUs, unless ``options.attention_kernel`` prices another framework's run; a CPU (gloo)
    falls back to torch SDPA (``autopar.kernels.attention``)."""
    return cluster.backend != "gloo" and options.attention_kernel == "generated"


class CostTables:
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

    # --- sizes -----------------------------------------------------------------------
    def _scale(self, d: Decision, output: int = 0) -> float:
        cp = self.setting.cp
        tokens = 1 / cp if cp > 1 and (d.index, output) in self._sequence_scaled else 1.0
        outs = d.batch.outputs
        if output < len(outs) and batch_scaled(outs[output]):
            return self.setting.microbatch / self.traced_batch * tokens
        if self._unmarked_batch(d, output):
            return self.setting.microbatch / self.traced_batch * tokens
        return tokens

    @cached_property
    def _sequence_scaled(self) -> frozenset[tuple[int, int]]:
        """Values split with the sequence over cp (empty without context parallelism)."""
        if self.setting.cp <= 1 or not self.seq_len:
            return frozenset()
        return sequence_scaled(self.problem, self.seq_len)

    @cached_property
    def _context_sites(self) -> dict[int, ContextSite]:
        """Attention sites by the decision yielding each (under context parallelism)."""
        if self.setting.cp <= 1:
            return {}
        return {site.decision: site for site in context_sites(self.problem)}

    @cached_property
    def _context_nodes(self) -> dict[str, ContextSite]:
        return {name: site for site in self._context_sites.values() for name in site.nodes}

    def context_comm(self, d: Decision, s: Strategy) -> AttentionComm | None:
        """What the setting's cp attention algorithm adds at ``d`` (one instance), when
        ``d`` yields an attention site; None elsewhere or while the algorithm is open."""
        site = self._context_sites.get(d.index)
        if site is None or self.setting.cp_algorithm not in CP_ALGORITHMS:
            return None
        key = (d.index, s)
        if key not in self._comm:
            f, b, _ = self.times(d, s, comm=False)
            self._comm[key] = site_comm(self, site, self.setting.cp_algorithm, f, b)
        return self._comm[key]

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
        if dtype in _FLOAT_DTYPES:
            return _numel(shape) * self.precision.bytes_per_element(facts.name)
        return _numel(shape) * _itemsize(dtype)

    # --- precision -------------------------------------------------------------------
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

    @cached_property
    def _low_read_params(self) -> frozenset[int]:
        """Decisions of parameters a low-precision node reads in fp32: each read casts a
        working copy (kept for backward by the matmul), as torch.autocast does (once per
        problem and precision assignment)."""
        p = self.precision
        if p.params != "fp32":
            return frozenset()
        key = ("low_read_params", precision_key(self.options, self.setting.zero))
        if key not in self.problem.cache:
            self.problem.cache[key] = self._reads_in_fp32(p)
        return self.problem.cache[key]

    def _reads_in_fp32(self, p: PrecisionAssignment) -> frozenset[int]:
        out = set()
        for name, word in p.enforced.items():
            if word == "fp32" or name not in self.problem.decision_of:
                continue
            node = self.problem.decisions[self.problem.decision_of[name]].nodes[0]
            out.update(self.problem.decision_of[arg.name] for arg, _ in _param_args(node)
                       if arg.name in self.problem.decision_of)
        return frozenset(out)

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
                total = sum(facts.param.numel * _itemsize(str(facts.dtypes[0]))
                            for _, facts in _param_args(d.nodes[0]))
                if total:
                    out[d.index] = total
            self.problem.cache[key] = out
        return self.problem.cache[key]

    def _weight_cast_bytes(self, d: Decision) -> float:
        """Bytes one forward of ``d`` moves casting fp32 weights to its low precision
        (read 4, write the copy), whole over tp."""
        word = self.precision.enforced.get(d.nodes[0].name)
        if word in (None, "fp32") or self.precision.params != "fp32":
            return 0.0
        return sum(facts.param.numel * (4 + BYTES[word])
                   for _, facts in _param_args(d.nodes[0]))

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

    # --- recomputation ---------------------------------------------------------------
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
        (:meth:`keeps_fp8_copy`, :meth:`fp8_weight_bytes`)."""
        return not self._fp8_reader(use) and self._kept(use, key)

    def keeps_fp8_copy(self, use: Use, key: ValueKey) -> bool:
        """Does an fp8 linear keep an fp8 copy of this activation for backward? One copy
        per tensor however many linears read it (``fp8_ops`` quantizes a tensor once), in
        the placement they read: a :func:`fp8_copy` of it (:meth:`saved_bytes`)."""
        return (self._fp8_reader(use) and self._kept(use, key)
                and self._weight_of(self.problem.decisions[key[0]]) is None)

    def _fp8_reader(self, use: Use) -> bool:
        return use.consumer >= 0 and use.saves and self.fp8_linear(
            self.problem.decisions[use.consumer])

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

    # --- per decision (one instance) ---------------------------------------------------
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

    def _compute_times(self, d: Decision, s: Strategy) -> tuple[float, float, float]:
        if d.kind != "op" or d.name in self.problem.dead or d.name in self.problem.not_run:
            return 0.0, 0.0, 0.0
        if d.facts.is_view or identity_dropout(d.nodes[0]):  # no kernel: its dispatch only
            f, b, r = self._view_times(d)
        else:
            f, b, r = self._kernel_times(d, s)
        return f, b + self._gradient_sums(d, s), r

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
            if info is None or dtype not in _FLOAT_DTYPES:
                continue
            edges = sum(u.count for u in info.uses
                        if u.consumer >= 0 and decisions[u.consumer].facts.requires_grad)
            extra = edges / d.count - 1
            if extra > 0:
                value = self.value_bytes((d.index, output)) / div
                total += extra * op_time(0.0, 3 * value, self.cluster.device, self.dtype(d))
        return total

    def _kernel_times(self, d: Decision, s: Strategy) -> tuple[float, float, float]:
        facts = d.facts
        custom = op_cost_for(facts.target)
        chunked = self._chunked_loss(d)
        if chunked is not None and custom is None:  # as the runtime runs it, block by block
            return chunked_loss_times(self, d, s, chunked)
        div = self.setting.tp if s.splits_work else 1
        scale = self._scale(d) / div
        dtype = self.dtype(d)
        # Buffers an op keeps for backward (a softmax's output inside cross-entropy, norm
        # statistics) are written by it too, though they are not among its outputs.
        floats, fixed = self.kept_extras(d)
        kept = floats * 4 + fixed
        written = facts.bytes_written + kept
        weights = self._weight_read_bytes().get(d.index, 0.0)
        inside = self.problem.fused_elementwise.get(d.name)  # bytes a fused chain keeps
        inside_read, kernels = (inside.read, 0 if inside.continues else 1) if inside else (0.0, 1)
        if inside:
            written = max(written - inside.written, 0.0)
        read = max(facts.bytes_read - self._dropped_mask_bytes(d) - weights - inside_read, 0)
        stored = self._stored_fraction(d)
        # a weight is read whole however small the microbatch (its tp shard, when split)
        moved = ((read + written) * scale + weights / div) * stored
        device = self.cluster.device
        shape = self._local_matmul(d, scale)
        work = 1.0  # the share of the traced FLOPs this rank's kernel computes
        causal_seq = self.problem.causal_attention.get(d.name)
        if causal_seq:  # the kernel skips the tiles the causal mask hides
            work *= causal_fraction(causal_seq)
        site = self._context_nodes.get(d.name)
        if site is not None:  # the slowest rank's share of causal attention
            work *= causal_imbalance(self.setting.cp, self.setting.cp_layout, site.causal)
        flops = facts.fwd_flops * scale * work
        if d.name in self.problem.fused_attention:
            return self._fused_times(d, flops, moved, shape)
        if custom is not None:  # a plugin's cost (cost_models/op_costs.py)
            fwd, bwd = custom(OpCostQuery(flops, moved, device, dtype, shape,
                                          facts.requires_grad))
            bwd = bwd if facts.requires_grad else 0.0
            return fwd, bwd, fwd if (self.recomputed(d) and facts.requires_grad) else 0.0
        attention = "scaled_dot_product" in facts.target
        speed = self.attention_speed(d) if attention else (1.0, 1.0)
        fwd = attention_time(flops, moved, device, dtype, shape=shape,
                             kernel_speed=speed[0]) if attention else (
            forward_time(flops, moved, device, dtype, shape=shape, kernels=kernels))
        fwd += allocation_time(written * scale * stored, device)
        cast = self._weight_cast_bytes(d) / div
        if cast:  # the fp32 weight's working copy, and its gradient cast back in backward
            fwd += forward_time(0.0, cast, device, dtype)
        bwd = 0.0
        if facts.requires_grad and attention:
            # Fused attention's backward: the FLOPs the trace counted, in one kernel.
            bwd = attention_time(facts.bwd_flops * scale * work, 2 * moved, device, dtype,
                                 shape=shape, kernel_speed=speed[1])
        elif facts.requires_grad:
            # The trace measured which gradients autograd computes (a frozen weight has no
            # weight gradient): 2x the forward's FLOPs means both matmuls, 1x only one.
            both = facts.bwd_flops >= 1.5 * max(facts.fwd_flops, 1)
            if facts.fwd_flops:
                bwd = backward_time(flops, moved, device, dtype, shape=shape, weight_grad=both)
            elif inside is None:  # op by op, as the trace measured its backward
                bwd = self._memory_bound_backward(d, moved, dtype)
            else:  # inside a fused chain
                bwd = backward_time(0.0, moved, device, dtype, kernels=kernels)
        if not facts.fwd_flops and facts.shapes:  # its arithmetic, where that bounds it
            elements = _numel(facts.shapes[0]) * scale
            arith_fwd, arith_bwd = arithmetic_times(facts.target, elements, device)
            fwd = max(fwd, arith_fwd)
            # (a same-shape add's gradient passes through: no backward kernel to bound)
            runs = facts.bwd_bytes is None or facts.bwd_kernels > 0
            bwd = max(bwd, arith_bwd) if facts.requires_grad and runs else bwd
        elif shape is not None and _has_bias(d.nodes[0]):
            bias_fwd, bias_bwd = bias_times(_numel(facts.shapes[0]) * scale, device)
            fwd += bias_fwd
            bwd += bias_bwd if facts.requires_grad else 0.0
        if facts.requires_grad:  # the gradients it writes, one per input it reads
            bwd += allocation_time(((facts.bytes_read - weights - inside_read) * scale
                                    + weights / div) * stored, device)
            if cast:
                bwd += forward_time(0.0, cast, device, dtype)
        casts = inserted_cast_time(self, d, s)  # the precision's casts of its activations
        fwd += casts
        bwd += casts if facts.requires_grad else 0.0
        if self.fp8_linear(d):
            quantize_fwd, quantize_bwd = fp8_quantize_times(self, d, s)
            fwd += quantize_fwd
            bwd += quantize_bwd if facts.requires_grad else 0.0
        return fwd, bwd, fwd if (self.recomputed(d) and facts.requires_grad) else 0.0

    def _memory_bound_backward(self, d: Decision, moved: float, dtype: str) -> float:
        """Seconds of a memory-bound op's backward run op by op: the kernels autograd
        launches for it and their bytes, as the trace measured them
        (``NodeFacts.bwd_bytes``, :mod:`autopar.trace.backward_kernels`), scaled as its
        forward's ``moved`` bytes are -- none for an ``add``, whose gradient passes through;
        three for ``pow``. Unmeasured, ``BACKWARD_BYTES_FACTOR`` x its forward's."""
        facts, device = d.facts, self.cluster.device
        traced = facts.bytes_read + facts.bytes_written
        if facts.bwd_bytes is None or traced <= 0:
            return backward_time(0.0, moved, device, dtype)
        if not facts.bwd_kernels:
            return 0.0
        return op_time(0.0, moved * facts.bwd_bytes / traced, device, dtype,
                       kernels=facts.bwd_kernels)

    def _view_times(self, d: Decision) -> tuple[float, float, float]:
        """An op that runs no kernel (a view; a dropout that returns its input): the host's
        dispatch and autograd node per pass, ``device.view_s`` (0 on GPUs). A Python
        ``getitem`` on a node's outputs dispatches nothing."""
        facts = d.facts
        if not facts.target.startswith("aten."):
            return 0.0, 0.0, 0.0
        seconds = self.cluster.device.view_s / compute_share(self.cluster.device)
        bwd = seconds if facts.requires_grad else 0.0
        return seconds, bwd, seconds if (self.recomputed(d) and facts.requires_grad) else 0.0

    def _fused_times(self, d: Decision, flops: float, moved: float,
                     shape: tuple[int, int, int] | None) -> tuple[float, float, float]:
        """An op inside fused eager attention: its elementwise steps (scale, mask, softmax,
        dropout) run in the kernel's registers, free; its two matmuls run at fused
        attention's efficiency and move only the operands that are not sequence-squared
        (the smaller side of each). The scores are recomputed in backward, as FlashAttention
        does (``recomputed``)."""
        facts = d.facts
        if not facts.fwd_flops:
            return 0.0, 0.0, 0.0
        device, dtype = self.cluster.device, self.dtype(d)
        moved = min(facts.bytes_read, facts.bytes_written) / (facts.bytes_read + facts.bytes_written
                                                              or 1) * moved
        speed = self.attention_speed(d)
        fwd = attention_time(flops, moved, device, dtype, shape=shape, kernel_speed=speed[0])
        bwd = 0.0
        if facts.requires_grad:
            bwd = attention_time(flops * facts.bwd_flops / facts.fwd_flops, 2 * moved, device,
                                 dtype, shape=shape, kernel_speed=speed[1])
        return fwd, bwd, fwd if (self.recomputed(d) and facts.requires_grad) else 0.0

    def attention_speed(self, d: Decision) -> tuple[float, float]:
        """(forward, backward) speed of the kernel that runs attention node ``d`` against
        the one the device's ``attention_efficiency`` describes: autopar's generated kernel
        where the program runs it -- a fused site, on a GPU (on a CPU it falls back to
        SDPA) -- unless ``PlanOptions.attention_kernel`` says another framework's runs."""
        device = self.cluster.device
        if (d.name not in self.problem.kernel_attention
                or not runs_generated_attention(self.cluster, self.options)):
            return 1.0, 1.0
        return device.generated_attention_forward, device.generated_attention_backward

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

    def compute(self, d: Decision, s: Strategy) -> tuple[float, float]:
        """(forward, backward including recomputation) of all instances of ``d``."""
        f, b, r = self.times(d, s)
        return f * d.count, (b + r) * d.count

    def float_bytes(self, facts: NodeFacts) -> int:
        """Bytes of one float element an op makes: the compute precision's, except for the
        losses autocast runs in fp32 (``torch.amp``'s fp32 op list: ``log_softmax``,
        ``nll_loss``, ``cross_entropy``), which read and keep fp32 whatever the precision."""
        return 4 if facts.target in AUTOCAST_FP32_TARGETS else self.precision.bytes_per_element(
            facts.name)

    def loss_working_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of the fp32 buffer a loss keeps (its log-softmax), local to this device:
        at backward's start its gradient is as large, the largest temporary of many steps.
        A chunked cross-entropy keeps the logits (an activation); its backward makes their
        gradient and one block (fp32): half of that, as the peak counts the largest
        temporary twice."""
        if d.kind != "op" or d.facts.target not in AUTOCAST_FP32_TARGETS:
            return 0.0
        div = self.setting.tp if s.splits_work else 1
        chunked = self._chunked_loss(d)
        if chunked is not None:
            tokens, classes, logit_bytes = chunked
            local = max(1, int(tokens * self._scale(d) / div))
            return (local * classes * logit_bytes + chunked_working_bytes(local, classes)) / 2
        return d.facts.extra_saved_float_numel * 4 * self._scale(d) / div

    def _chunked_loss(self, d: Decision) -> tuple[int, int, int] | None:
        """(tokens, classes as traced, bytes of a logit) of a cross-entropy the runtime
        computes chunked (``passes/chunked_loss.py``), else None. The loss reads the logits
        in the compute precision (a fp32 cast before it is folded in)."""
        return self._chunked_losses.get(d.index)

    @cached_property
    def _chunked_losses(self) -> dict[int, tuple[int, int, int]]:
        """The chunked cross-entropies by decision index (found once: asked on the hot path)."""
        if not self.options.chunked_loss:
            return {}
        return {d.index: (*shape, self.element_bytes) for d in self.problem.decisions
                if (shape := _chunked_loss_shape(d)) is not None}

    def context_buffer_bytes(self, d: Decision, s: Strategy) -> float:
        """The largest buffer the cp attention algorithm holds at ``d`` (gathered K/V, ring
        blocks in flight, re-laid heads), beside the local tensors."""
        extra = self.context_comm(d, s) if self._context_sites else None
        return extra.temporary_bytes if extra is not None else 0.0

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
            return 0.0, _numel(facts.shapes[0][:-1]) * 4.0
        return float(facts.extra_saved_float_numel), float(facts.extra_saved_other_bytes)

    def _causal_sdpa(self, d: Decision) -> bool:
        return (d.name in self.problem.causal_attention and d.kind == "op"
                and "scaled_dot_product" in d.facts.target and bool(d.facts.shapes))

    def _dropped_mask_bytes(self, d: Decision) -> int:
        """Bytes of the mask a causal SDPA site was traced with, which its kernel never
        reads (the fused program erases the mask; see Fusion's dead nodes)."""
        if not self._causal_sdpa(d):
            return 0
        node = d.nodes[0]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if val is None or not hasattr(val, "numel"):
            return 0
        return int(val.numel()) * val.element_size()

    def activation_memory(self, d: Decision, s: Strategy) -> float:
        return self.own_activation(d, s) * d.count

    def fp8_linear(self, d: Decision) -> bool:
        """Does ``d`` run as an fp8 linear (``autopar.ops.fp8_ops``)?"""
        return d.kind == "op" and self.dtype(d) == "fp8"

    def fp8_weight_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of the fp8 weight copy one instance of an fp8 linear keeps for backward
        (one byte an element, the shard ``s`` reads), not the weight it read: once for the
        whole step, shared by its microbatches (``fp8_ops.one_weight_copy_per_step``), so
        the memory model counts it beside the weights, not per microbatch in flight. Its
        input's copy is a value's (:meth:`keeps_fp8_copy`). Measured on CPU with
        ``autopar.calibrate.live_bytes`` (tests/test_activation_memory.py)."""
        if self.options.fp8_weight_copies == "use":  # made where it runs, not kept
            return 0.0
        total = 0.0
        for slot, param in self._fp8_weights.get(d.index, {}).items():
            total += (param.facts.param.numel / self.expert_divisor(param)
                      / divisor(s.inputs[slot], self.setting.tp))
        return total

    @property
    def fp8_readers(self) -> frozenset[int]:
        """Decisions (indices) of the fp8 linears, which keep fp8 weight copies."""
        return frozenset(self._fp8_weights)

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

    @property
    def states_key(self) -> tuple:
        """What :meth:`states` reads of the setting and options besides the decision (for
        caches of state sums: the microbatch and the pipeline do not change them)."""
        o, st = self.options, self.setting
        return (st.zero, st.shard_group, st.ep, st.offload, o.precision, o.optimizer,
                o.master_weights, o.fp8_weight_copies)

    def states(self, d: Decision, s: Strategy) -> StateBytes:
        """Parameter, gradient and optimizer bytes of one instance of a parameter."""
        param = d.facts.param
        if d.kind != "param" or param is None:
            return StateBytes(0.0, 0.0, 0.0)
        div = divisor(s.outputs[0], self.setting.tp)
        shape = list(param.shape)
        if isinstance(s.outputs[0], Shard) and shape:
            shape[s.outputs[0].dim] //= div
        ep = self.expert_divisor(d)
        if ep > 1:
            shape[0] //= ep
        if param.is_buffer:  # stored as it is (QLoRA's uint8 codes), never sharded by ZeRO
            itemsize = torch.empty((), dtype=getattr(torch, param.dtype)).element_size()
            return StateBytes(param.numel / div / ep * itemsize, 0.0, 0.0)
        return model_state_bytes(
            param.numel / div / ep,
            trainable=param.trainable,
            precision=self.options.precision if not param.is_buffer else "fp32",
            optimizer=self.options.optimizer,
            zero_stage=self.setting.zero,
            dp=self.setting.shard_group // ep,
            shape=tuple(shape) if shape else None,
            fp32_params=self.options.master_weights == "params",
            offload=self.setting.offload,
        )

    def grad_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of one instance's gradients on one device before data-parallel sync: fp32,
        as the parameters are (FSDP2 reduces in fp32 too: ``reduce_dtype``)."""
        param = d.facts.param
        if d.kind != "param" or param is None or not param.trainable:
            return 0.0
        return param.numel / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d) * 4

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

    @cached_property
    def _chunked_loss_inputs(self) -> frozenset[str]:
        names: set[str] = set()
        for index in self._chunked_losses:
            node = self.problem.decisions[index].nodes[0].args[0]
            while isinstance(node, fx.Node) and node.op == "call_function":
                names.add(node.name)
                if node.target in VIEWS:
                    node = node.args[0]
                else:
                    node = fp32_cast(node)  # folded into the loss; else the producer
        return frozenset(names)

    def trainable_numel(self, d: Decision, s: Strategy) -> float:
        """Trainable parameters of one instance on one device (local over tp and ep)."""
        param = d.facts.param
        if d.kind != "param" or param is None or not param.trainable:
            return 0.0
        return param.numel / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d)

    def weight_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of one instance's working weights, whole over dp (what ZeRO-3 gathers, in
        FSDP2's ``param_dtype``)."""
        param = d.facts.param
        if d.kind != "param" or param is None or param.is_buffer:
            return 0.0  # FSDP2 neither shards nor gathers buffers
        return (param.numel / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d)
                * BYTES[self.precision.params])

    # --- experts (expert parallelism) ----------------------------------------------------
    @cached_property
    def _experts(self) -> tuple[frozenset[str], dict[str, str]]:
        """(stacked expert weights' get_attr nodes, first grouped matmul of each expert
        region -> the rows it reads), when experts are spread."""
        if self.setting.ep <= 1:
            return frozenset(), {}
        regions = regions_of(self.problem.gm)
        order = {n: i for i, n in enumerate(self.problem.gm.graph.nodes)}
        weights = frozenset(w.name for r in regions for w in r.weights)
        first = {min(r.matmuls, key=order.__getitem__).name: r.rows.name for r in regions}
        return weights, first

    @cached_property
    def _expert_members(self) -> dict[str, int]:
        """Node name -> index of the expert region it runs in, when experts are spread."""
        if self.setting.ep <= 1:
            return {}
        return {n.name: i for i, r in enumerate(regions_of(self.problem.gm))
                for n in r.members}

    def inside_experts(self, key: ValueKey, consumer: int) -> bool:
        """Does the value ``key`` flow between two ops of one expert region (``ep > 1``)?
        Expert parallelism runs each region as one block between its token all-to-alls (and
        under ZeRO-3 as one module, ``passes/outline_experts.py``), on the rows of this
        rank's experts: a tensor-parallel collective inside it would split the region in
        two, so such a value keeps its placement (the layout solve pins it)."""
        members = self._expert_members
        if not members or consumer < 0:
            return False
        def regions(d: int) -> set[int]:
            return {members[n.name] for n in self.problem.decisions[d].nodes
                    if n.name in members}
        return bool(regions(key[0]) & regions(consumer))

    def expert_divisor(self, d: Decision) -> int:
        """``ep`` for a stacked expert weight (each rank keeps a block of experts), else 1."""
        if self.setting.ep <= 1 or d.kind != "param":
            return 1
        return self.setting.ep if d.nodes[0].name in self._experts[0] else 1

    def expert_comm(self, d: Decision) -> tuple[float, float]:
        """(forward, backward) seconds of one instance's token all-to-alls, at the first
        grouped matmul of an expert region: rows out to the experts' owners and back, in
        forward and again (reversed) in backward; a fully recomputed layer dispatches
        again. Priced per link level of the ep group (:func:`group_collective_time`)."""
        rows = self._experts[1].get(d.nodes[0].name) if d.kind == "op" else None
        if rows is None:
            return 0.0, 0.0
        if rows not in self.problem.decision_of:
            return 0.0, 0.0
        nbytes = self.value_bytes((self.problem.decision_of[rows], 0))
        one = group_collective_time("all_to_all", nbytes, self.setting.ep_mesh, "ep",
                                    self.cluster)
        rerun = 2 * one if self.setting.layer_mode(0) == "full" else 0.0
        return 2 * one, 2 * one + rerun

    # --- per value (one instance) ------------------------------------------------------
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

    def saved_bytes(self, key: ValueKey, placement: Placement | tuple) -> float:
        """Bytes of one instance of a value kept for backward, in ``placement`` (or the
        one-byte :func:`fp8_copy` an fp8 linear keeps of it in that placement)."""
        d = self.problem.decisions[key[0]]
        if isinstance(placement, tuple) and placement[0] == FP8_COPY:
            numel = self.value_bytes(key) / self.precision.bytes_per_element(d.facts.name)
            return numel / divisor(placement[1], self.setting.tp)
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
        while node.op == "call_function" and node.target in _PARAM_VIEWS and node.args:
            node = node.args[0]
            if not isinstance(node, fx.Node):
                return None
        if node.op != "get_attr" or node.name not in self.problem.decision_of:
            return None
        return self.problem.decisions[self.problem.decision_of[node.name]]

    def _working_copy_bytes(self, d: Decision) -> float:
        """The low-precision copy of an fp32 weight a matmul keeps for backward (per
        microbatch in flight); none where the layer recomputes it (full, op) or ZeRO-3
        gathers in the low precision."""
        if d.index not in self._low_read_params or d.facts.param is None:
            return 0.0
        if self.setting.recompute in ("full", "op") and d.facts.layer is not None:
            return 0.0
        return d.facts.param.numel * BYTES[stored_word(self.options.precision)]

    @cached_property
    def capacity(self) -> float:
        return self.options.capacity(self.cluster.device.memory_bytes)


_PARAM_VIEWS = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
                torch.ops.aten.t.default, torch.ops.aten.view.default,
                torch.ops.aten.reshape.default, torch.ops.aten.alias.default,
                torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default}


def _param_args(node: fx.Node) -> list[tuple[fx.Node, NodeFacts]]:
    """The parameters ``node`` reads directly (``get_attr`` inputs with parameter facts)."""
    out = []
    for arg in node.all_input_nodes:
        facts = arg.meta.get(META_KEY)
        if arg.op == "get_attr" and facts is not None and facts.param is not None:
            out.append((arg, facts))
    return out


def _itemsize(dtype: str) -> int:
    return {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}.get(dtype, 4)


def _chunked_loss_shape(d: Decision) -> tuple[int, int] | None:
    """(tokens, classes) as traced of a cross-entropy the runtime computes chunked
    (``passes/chunked_loss.py``), else None."""
    if d.kind != "op" or not chunkable_loss(d.nodes[0]):
        return None
    tokens, classes = d.nodes[0].args[0].meta["val"].shape
    return int(tokens), int(classes)
