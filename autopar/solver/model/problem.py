"""The planning problem for one mesh: decisions, their candidate strategies, and values.

Nodes that play the same part in structurally identical layers form one *decision* (the
solver gives them one strategy), so an 80-layer model has about as many decisions as a
one-layer model. A *value* is one tensor output of a decision; its *uses* are the consumer
slots that read it, with how many instances of that edge the graph has.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

import torch.fx as fx

from autopar.analysis.precision import NORM_MODULE_SUFFIXES
from autopar.core.graph_facts import META_KEY, NodeFacts, graph_facts
from autopar.core.placements import Replicate, Shard
from autopar.core.values import is_decision, tensor_inputs, training_output, value_of
from autopar.strategies import Strategy, has_rule, strategies_for
from autopar.strategies.calls import op_call
from autopar.strategies.mutation import ties

R = Replicate()
ValueKey = tuple[int, int]  # (decision index, output index)


_KINDS = {"get_attr": "param", "placeholder": "input"}
"""A decision's kind by its first node's fx op; every other op is an "op"."""


@dataclass
class Decision:
    index: int
    nodes: list[fx.Node]
    candidates: list[Strategy]  # strategies on the tp axis
    batch: Strategy  # the strategy on the dp axis (fixed by batch propagation)
    unruled: bool = False  # the op has no sharding rule: it can only run replicated

    # name, count and kind are asked about a million times in a large plan's search, and
    # never change once the decision is built (its nodes are fixed): computed once
    @cached_property
    def name(self) -> str:
        return self.nodes[0].name

    @property
    def facts(self) -> NodeFacts:
        return self.nodes[0].meta[META_KEY]

    @cached_property
    def count(self) -> int:
        return len(self.nodes)

    @cached_property
    def kind(self) -> str:
        return _KINDS.get(self.nodes[0].op, "op")


@dataclass
class Use:
    consumer: int  # decision index; -1 for the graph output
    slot: int
    count: int
    saves: bool  # the consumer keeps this input for its backward
    same_layer: bool = False  # producer and consumer sit in the same repeated layer
    # an in-place write shares this edge's storage: the consumer must read the producer's
    # placement unchanged (see autopar.strategies.mutation)
    tied: bool = False


@dataclass
class ValueInfo:
    key: ValueKey
    uses: list[Use] = field(default_factory=list)


@dataclass
class Problem:
    gm: fx.GraphModule
    tp: int
    decisions: list[Decision]
    values: dict[ValueKey, ValueInfo]
    decision_of: dict[str, int]  # node name -> decision index
    # nodes inside attention the program fuses into one kernel (eager chains): their
    # sequence-squared tensors are recomputed inside the kernel's backward, never kept
    fused_attention: frozenset[str] = frozenset()
    # nodes of every fused attention site (SDPA calls included): the program runs each
    # site through autopar's generated kernel on a GPU (autopar.kernels.attention)
    kernel_attention: frozenset[str] = frozenset()
    # nodes the fused program never runs (causal masks the kernels replace by a flag)
    dead: frozenset[str] = frozenset()
    # nodes the fused program does not run whose values stand for the kernels' arguments
    # (HF's repeat_kv of the keys and values) -> that argument: no time, and what is kept
    # of them is the argument's bytes
    not_run: dict[str, str] = field(default_factory=dict)
    # nodes of fused causal attention -> the sequence length: the kernels skip the score
    # blocks above the diagonal, about half the FLOPs the trace counted
    causal_attention: dict[str, int] = field(default_factory=dict)
    # nodes of elementwise chains a fusing program runs as one kernel -> the bytes they do
    # not move there (autopar.solver.pricing.elementwise_fusion; empty: eager, op by op)
    fused_elementwise: dict = field(default_factory=dict)
    # tensor-parallel collectives pipelined with the matmuls beside them, as another
    # framework's program runs them (autopar.solver.pricing.tp_overlap; False: issued whole)
    tp_overlap: bool = False
    # pipeline sends and receives posted ahead, beside the compute (Megatron-Core's
    # overlap_p2p_comm under interleaving; autopar.solver.pricing.evaluate; False: on the path)
    p2p_overlap: bool = False
    # what planning derives from the problem alone, computed once (see search, evaluate)
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    # what planning derives from the graph alone, shared by the problems of every tp degree
    # built from one skeleton (the per-node precision: precision_costs.precision_assignment)
    graph_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def value_key(self, node: fx.Node) -> ValueKey:
        producer, index = value_of(node)
        return self.decision_of[producer.name], index

    def node_named(self, name: str) -> fx.Node:
        """The graph node called ``name`` (a map built once per problem)."""
        if "nodes_by_name" not in self.cache:
            self.cache["nodes_by_name"] = {n.name: n for n in self.gm.graph.nodes}
        return self.cache["nodes_by_name"][name]


def decision_key(node: fx.Node) -> object:
    facts: NodeFacts = node.meta[META_KEY]
    if facts.layer is None or facts.block is None:
        return node.name
    for block in graph_facts_blocks(node):
        if block.container == facts.block:
            return (facts.block, block.signature_of[facts.layer], facts.position)
    return node.name


def graph_facts_blocks(node: fx.Node) -> list:
    gm = node.graph.owning_module
    return graph_facts(gm).blocks if gm is not None else []


@dataclass(frozen=True)
class Skeleton:
    """What a problem holds that does not depend on the tp degree: the decisions' nodes,
    and every value's uses. Built once per graph and shared by the problems of every mesh
    (each problem gets its own decisions, whose candidates differ)."""

    groups: tuple[tuple[fx.Node, ...], ...]
    decision_of: dict[str, int]
    values: dict[ValueKey, ValueInfo]
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # Problem.graph_cache


def problem_skeleton(gm: fx.GraphModule) -> Skeleton:
    """Group nodes into decisions and record every value's uses (see :func:`build_problem`)."""
    groups: dict[object, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_decision(node):
            groups.setdefault(decision_key(node), []).append(node)
    decision_of: dict[str, int] = {}
    for index, nodes in enumerate(groups.values()):
        for n in nodes:
            decision_of[n.name] = index

    def value_key(node: fx.Node) -> ValueKey:
        producer, index = value_of(node)
        return decision_of[producer.name], index

    uses: dict[ValueKey, dict[tuple[int, int], list]] = defaultdict(dict)
    tied = ties(gm.graph)
    for index, nodes in enumerate(groups.values()):
        for node in nodes:
            saved = set(node.meta[META_KEY].saved_inputs)
            layer = node.meta[META_KEY].layer
            for slot, a in enumerate(tensor_inputs(node)):
                key = value_key(a)
                producer_layer = value_of(a)[0].meta[META_KEY].layer
                same = layer is not None and producer_layer == layer
                entry = uses[key].setdefault((index, slot), [0, False, same, False])
                entry[0] += 1
                entry[1] = entry[1] or slot in saved
                entry[3] = entry[3] or (node, slot) in tied
    for a in tensor_inputs(gm.graph.output_node()):
        producer, index = value_of(a)
        key = (decision_of[producer.name], index)
        if training_output(a):  # the loss; a training step drops the other outputs
            uses[key].setdefault((-1, 0), [1, False, False, False])
        else:
            uses.setdefault(key, {})  # the value stays known, with no caller to serve

    values: dict[ValueKey, ValueInfo] = {}
    for key in sorted(uses):
        info = ValueInfo(key)
        for (consumer, slot), (count, saves, same, tie) in sorted(uses[key].items()):
            info.uses.append(Use(consumer, slot, count, saves, same, tie))
        values[key] = info
    return Skeleton(tuple(tuple(nodes) for nodes in groups.values()), decision_of, values,
                    cache={"ties": tied})


def build_problem(gm: fx.GraphModule, tp: int, batch: dict[str, Strategy],
                  skeleton: Skeleton | None = None) -> Problem:
    """Group nodes into decisions, list tp candidates compatible with the dp placements,
    and record every value's uses. ``skeleton``: the graph's :func:`problem_skeleton`,
    when the caller builds problems for several tp degrees (it is the same for all)."""
    skeleton = skeleton or problem_skeleton(gm)
    decisions = [Decision(index, list(nodes), [], batch[nodes[0].name])
                 for index, nodes in enumerate(skeleton.groups)]
    problem = Problem(gm, tp, decisions, skeleton.values, skeleton.decision_of,
                      graph_cache=skeleton.cache)
    for d in decisions:
        if d.kind == "op":
            _op_candidates(d, tp)
    for d in decisions:
        if d.kind != "op":
            _source_candidates(problem, d, tp)
    return problem


def _op_candidates(d: Decision, tp: int) -> None:
    call = op_call(d.nodes[0])
    d.unruled = not has_rule(call.target) and tp > 1
    d.candidates = [s for s in strategies_for(call, tp) if _compatible(s, d.batch)]


def _compatible(tp_strategy: Strategy, dp_strategy: Strategy) -> bool:
    """A dim sharded on dp cannot also be sharded on tp (no nested sharding)."""
    pairs = list(zip(tp_strategy.inputs, dp_strategy.inputs)) + list(
        zip(tp_strategy.outputs, dp_strategy.outputs)
    )
    for t, b in pairs:
        if isinstance(t, Shard) and isinstance(b, Shard) and t.dim == b.dim:
            return False
    return True


def _source_candidates(problem: Problem, d: Decision, tp: int) -> None:
    """Parameters may be stored in any placement a consumer can use; inputs are whole."""
    if d.kind == "input" or tp == 1:
        d.candidates = [Strategy((), (R,))]
        return
    wanted = {R}
    for use in problem.values.get((d.index, 0), ValueInfo((d.index, 0))).uses:
        if use.consumer >= 0:
            for s in problem.decisions[use.consumer].candidates:
                wanted.add(s.inputs[use.slot])
    ordered = sorted(wanted, key=lambda p: (not isinstance(p, Replicate), str(p)))
    d.candidates = [Strategy((), (p,)) for p in ordered if not _is_partial(p)]


def _is_partial(p: object) -> bool:
    return not isinstance(p, (Replicate, Shard))


def forbid_sharding_like(problem: Problem, marker: dict[str, Strategy]) -> None:
    """Drop tp candidates that shard a tensor the way ``marker`` does (e.g. along the
    sequence dimension, for Megatron without sequence parallelism). Replicated strategies
    always stay, so no decision is left without a candidate."""
    for d in problem.decisions:
        m = marker.get(d.name)
        if m is None or d.kind == "param":
            continue

        def clashes(s: Strategy, m: Strategy = m) -> bool:
            pairs = list(zip(s.inputs, m.inputs)) + list(zip(s.outputs, m.outputs))
            return any(isinstance(a, Shard) and isinstance(b, Shard) and a.dim == b.dim
                       for a, b in pairs)

        kept = [s for s in d.candidates if not clashes(s)]
        d.candidates = kept or d.candidates[:1]


_RESIDUAL_OPS = ("layer_norm", "rms_norm", "aten.add.Tensor", "dropout")


def _stream_shape(problem: Problem) -> tuple[int, ...] | None:
    """The residual stream's shape: that of the first normalisation's input -- a norm op
    (``layer_norm``, ``rms_norm``) or the first op of a norm module written out of
    elementwise ops (HF's ``LlamaRMSNorm``). Not a norm's weight, whose path says "norm"
    too."""
    for d in problem.decisions:
        facts = d.facts
        if d.kind != "op" or not facts.shapes:
            continue
        if "norm" in facts.target or facts.module_type.endswith(NORM_MODULE_SUFFIXES):
            return facts.shapes[0]
    return None


def keep_residual_stream_whole(problem: Problem, sequence: dict[str, Strategy]) -> None:
    """Megatron-LM's layout: norms, dropouts and residual adds keep their output whole on
    every tp device — or, with sequence parallelism, split along the sequence where
    ``sequence`` says it lies. Only the matmuls and what lies between a column- and a row-parallel matmul
    are split. The residual stream is recognized by its shape: that of the norms' outputs."""
    stream = _stream_shape(problem)
    if stream is None:
        return
    ops = [d for d in problem.decisions if d.kind == "op" and d.facts.shapes
           and d.facts.shapes[0] == stream and (
               any(op in d.facts.target for op in _RESIDUAL_OPS)
               or d.facts.module_type.endswith(NORM_MODULE_SUFFIXES))]
    # where the sequence lies in the stream: propagation from the tokens reaches the first
    # layer's stream, not always past attention (which reads every key)
    split = next((p for d in ops if (seq := sequence.get(d.name)) is not None and seq.outputs
                  and isinstance(p := seq.outputs[0], Shard)), None)
    allowed = {split} if split is not None else {R}
    for d in ops:
        kept = [s for s in d.candidates if s.outputs and s.outputs[0] in allowed]
        d.candidates = kept or d.candidates[:1]


def pair_row_parallel(problem: Problem) -> None:
    """Megatron-LM's pairs: a linear whose output goes straight (through views, a dropout)
    into the residual stream's add is row-parallel -- its weight split along its input
    features, its output a partial sum reduced (or reduce-scattered, with sequence
    parallelism) into the stream -- so the column-parallel linear before it hands it its
    shard with no communication between them (the attention output projection, the MLP's
    down projection)."""
    stream = _stream_shape(problem)
    if stream is None:
        return
    for d in problem.decisions:
        if (d.kind != "op" or d.facts.target != "aten.add.Tensor" or not d.facts.shapes
                or d.facts.shapes[0] != stream):
            continue
        for node in d.nodes[0].all_input_nodes:
            while node.op == "call_function" and node.meta.get(META_KEY) is not None and (
                    node.meta[META_KEY].is_view or "dropout" in node.meta[META_KEY].target):
                node = node.all_input_nodes[0]
            facts = node.meta.get(META_KEY)
            if facts is None or facts.target != "aten.linear.default" or node.name not in \
                    problem.decision_of:
                continue
            linear = problem.decisions[problem.decision_of[node.name]]
            row = [c for c in linear.candidates
                   if len(c.inputs) > 1 and c.inputs[1] == Shard(1)]
            linear.candidates = row or linear.candidates


def shard_weight_matrices(problem: Problem, keep: frozenset[str] = frozenset()) -> None:
    """Megatron-LM's weights: every matrix (a parameter of two dims or more: linear weights,
    the vocabulary-parallel embedding) is split across tp — by columns or rows, as its
    consumers allow — never kept whole on every device. Vectors (norm weights, row-parallel
    biases) stay as the solver places them. A parameter no consumer can use split keeps its
    candidates, and so do the parameters named in ``keep`` (expert weights under expert
    parallelism, which keeps each expert whole on its ep rank: Megatron-Core's expert tensor
    parallel size 1)."""
    for d in problem.decisions:
        if d.kind != "param" or not d.facts.shapes or len(d.facts.shapes[0]) < 2:
            continue
        if any(n.name in keep for n in d.nodes):
            continue
        split = [s for s in d.candidates if any(isinstance(p, Shard) for p in s.outputs)]
        d.candidates = split or d.candidates
        if split:
            _read_split(problem, (d.index, 0))


def _read_split(problem: Problem, key: ValueKey) -> None:
    """The ops that read a split weight matrix (through views) read it split: Megatron
    never gathers a weight over tp (a linear of a large microbatch would otherwise find
    gathering its weight cheaper than gathering its input). An op that cannot keeps its
    candidates."""
    for use in problem.values[key].uses if key in problem.values else ():
        if use.consumer < 0:
            continue
        consumer = problem.decisions[use.consumer]
        if consumer.facts.is_view:
            _read_split(problem, (consumer.index, 0))
            continue
        split = [s for s in consumer.candidates
                 if use.slot < len(s.inputs) and isinstance(s.inputs[use.slot], Shard)]
        consumer.candidates = split or consumer.candidates


def forbid_splitting_batch(problem: Problem, batch_size: int) -> None:
    """Drop tp candidates that split the batch, for microbatches tp does not divide (or when
    tp must not split it, as in Megatron): see :func:`splits_batch`."""
    for d in problem.decisions:
        if d.kind == "param":
            continue
        kept = [s for s in d.candidates if not splits_batch(d, s, batch_size)]
        d.candidates = kept or d.candidates[:1]


def splits_batch(d: Decision, s: Strategy, batch_size: int) -> bool:
    """Does tp strategy ``s`` of ``d`` split the batch? It shards a dim the dp axis marks as
    batch or, on values the batch marking could not follow (a mask built by indexing with
    ``arange(batch)``), any dim of the traced batch size."""
    if d.kind == "param":
        return False
    in_shapes = []
    for a in tensor_inputs(d.nodes[0]):
        producer, index = value_of(a)
        shapes = producer.meta[META_KEY].shapes if META_KEY in producer.meta else ()
        in_shapes.append(shapes[index] if index < len(shapes) else ())
    sides = ((s.outputs, d.batch.outputs, d.facts.shapes), (s.inputs, d.batch.inputs, in_shapes))
    for placements, marks, shapes in sides:
        for p, mark, shape in zip(placements, marks, shapes):
            if not isinstance(p, Shard):
                continue
            if isinstance(mark, Shard) and mark.dim == p.dim:
                return True
            if not isinstance(mark, Shard) and len(shape) > p.dim and shape[p.dim] == batch_size:
                return True
    return False


def restrict_to(problem: Problem, names: frozenset[str], allowed) -> None:
    """Keep only the tp candidates ``allowed(strategy)`` accepts for the decisions of
    ``names`` (replicated strategies always stay)."""
    for d in problem.decisions:
        if d.name not in names:
            continue
        kept = [s for s in d.candidates if allowed(s)]
        d.candidates = kept or d.candidates[:1]
