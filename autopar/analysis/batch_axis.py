"""Placements on the data-parallel axis: the batch dimension, propagated from the inputs.

Data parallelism splits the batch: inputs are sharded on dim 0 and every op keeps its batch
dimension sharded where its sharding rule allows it without communication. For each node
this picks, among the rule's strategies on the ``dp`` axis, the one needing the least
communication from its producers (a slice of a replicated tensor is free), then the fewest
redistributions, then the most sharded outputs. Parameters stay replicated on ``dp`` (ZeRO
shards their storage, not their use). The result is deterministic: no choice is left for the
solver on this axis.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true
from torch.utils._pytree import tree_map

from autopar.analysis.expert_sites import grouped_matmul_ops
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Partial, Placement, Replicate, Shard
from autopar.core.strategy import OpCall, TensorMeta
from autopar.core.values import is_decision, tensor_inputs, value_of
from autopar.strategies import Strategy, strategies_for
from autopar.strategies.calls import op_call
from autopar.strategies.factories import makes_constant
from autopar.strategies.mutation import writes, written_slots

R = Replicate()


def batch_strategies(gm: fx.GraphModule, batch_size: int | None) -> dict[str, Strategy]:
    """Node name -> strategy on the dp axis, for every decision node.

    It marks where the batch dimension is, propagated as if the traced batch were split
    into single sequences — the same for every data-parallel degree (microbatches cut the
    batch too, so it is marked even without data parallelism). A graph traced on one
    sequence has no batch dimension to find: everything is replicated."""
    split = batch_size if batch_size and batch_size > 1 else 1
    return propagate_input_dim(gm, split, batch_size, dim=0, token_sets=True)


def propagate_input_dim(
    gm: fx.GraphModule, n: int, size: int | None, dim: int, *, follow_only: bool = False,
    overrides: Mapping[str, Strategy] | None = None, token_sets: bool = False,
) -> dict[str, Strategy]:
    """Shard dimension ``dim`` of every input whose ``dim`` has ``size`` over ``n`` devices
    and carry that sharding through the graph as far as rules allow without communication.

    ``dim=0`` is the batch (data parallelism); ``dim=1`` of token inputs is the sequence,
    which tells where the sequence dimension of every tensor is. ``follow_only``: an op
    whose inputs are all replicated stays replicated (otherwise a free slice may shard it,
    e.g. positions expanded over the batch): what context parallelism executes, where
    only tensors that follow the sequence are split. ``overrides``: node name -> the
    strategy it runs whatever its rule offers (an attention site under context parallelism
    reads its keys and values split, its op passing them between ranks). ``token_sets``:
    data-dependent routing ops run on each rank's own tokens (:func:`token_set_strategy`).
    """
    chosen: dict[str, Strategy] = {}
    alike = _alike_layers(gm)
    # Written in place through views (``labels.clone()`` then shifted right by slices, as
    # encoder-decoders build their decoder inputs): under ``follow_only`` (the sequence
    # split) such a buffer stays whole, so the writes along the sequence reach it; its
    # readers slice.
    written = {base for write, base in writes(gm.graph)
               if write.args and write.args[0] is not base} if follow_only else set()
    known: dict[tuple, Strategy] = {}  # a node of a repeated layer, by its place and inputs
    for node in gm.graph.nodes:
        if not is_decision(node):
            continue
        facts = node.meta[META_KEY]
        if node.op == "placeholder":
            shape = facts.shapes[0]
            sharded = (
                n > 1 and size is not None and len(shape) > dim and shape[dim] == size
                and size % n == 0
            )
            chosen[node.name] = Strategy((), (Shard(dim) if sharded else R,))
            continue
        if node.op == "get_attr" or n == 1:
            n_in = len(tensor_inputs(node)) if node.op == "call_function" else 0
            chosen[node.name] = Strategy((R,) * n_in, (R,) * len(facts.shapes))
            continue
        if overrides and node.name in overrides:
            chosen[node.name] = overrides[node.name]
            continue
        inputs = tensor_inputs(node)
        produced = [_placement(chosen, a) for a in inputs]
        local = token_set_strategy(node, produced) if token_sets else None
        if local is not None:
            chosen[node.name] = local
            continue
        sizes = [_nbytes(a) for a in inputs]
        place = alike(facts)
        key = None if place is None else (*place, tuple(produced), tuple(sizes))
        if key is not None and key in known:
            chosen[node.name] = known[key]
            continue
        call = op_call(node)
        if token_sets:
            call = _counted_rows(node, call, n)
        candidates = strategies_for(call, n)
        if token_sets and makes_constant(node.target) and _batch_sized(node, size):
            # a buffer the model fills per sample (DeepSeek's MLA builds its queries with
            # new_empty(bsz, ...)): the program, traced on its rank's sequences, makes it
            # that size
            candidates = [s for s in candidates if s.outputs[:1] == (Shard(0),)] or candidates
        elif makes_constant(node.target) or node in written or (
                follow_only and all(p == R for p in produced)):
            # a constant has no batch dim to follow
            candidates = [s for s in candidates if all(o == R for o in s.outputs)] or candidates
        elif not any(isinstance(p, Shard) for p in produced):
            # made from no samples' rows (positions, a relative-position table, the sign of
            # a summed expert load): split only where the program, traced on its own
            # samples, makes it so -- an op shaping its output to the batch's size
            # (positions expanded over the batch); a partial sum is all-reduced, never
            # reduce-scattered along a dim that is not the batch's
            partial = any(isinstance(p, Partial) for p in produced)
            candidates = [s for s in candidates
                          if all(o == R or partial and isinstance(o, Partial) for o in s.outputs)
                          or node.target in _SHAPED and _splits_batch_sized(node, s, size)
                          ] or candidates
        slots = written_slots(node)
        if slots:
            # an in-place write reads its target as placed: a redistributed copy would take
            # the write, not the storage (a buffer kept whole under cp, filled by slices)
            candidates = [s for s in candidates
                          if all(s.inputs[i] == produced[i] for i in slots)] or candidates
        chosen[node.name] = min(
            enumerate(candidates), key=lambda item: _score(item, produced, sizes, follow_only)
        )[1]
        if key is not None:
            known[key] = chosen[node.name]
    return chosen


def _alike_layers(gm: fx.GraphModule):
    """A node's place among alike nodes -- (stack, layer signature, position): layers of one
    signature have the same ops, shapes and wiring (:mod:`autopar.trace.blocks`), so a node
    whose inputs arrive alike gets the same strategy as its peer in an earlier layer, and the
    rules are asked once per layer kind, not once per layer (80 times for Llama-3-70B) --
    or None outside repeated layers."""
    meta = gm.meta.get(META_KEY)
    signatures = {b.container: b.signature_of for b in meta.blocks} if meta is not None else {}

    def place(facts) -> tuple | None:
        if facts.block is None or facts.position is None or facts.block not in signatures:
            return None
        signature = signatures[facts.block].get(facts.layer)
        return None if signature is None else (facts.block, signature, facts.position)
    return place


def _score(item: tuple[int, Strategy], produced: list[Placement], sizes: list[int],
           follow_only: bool = False) -> tuple:
    """Least communication, then fewest redistributions, then most sharded outputs (with
    ``follow_only``, fewest: a tensor whose split cannot be kept is gathered, not re-split
    along another dim, which would not be the sequence)."""
    index, s = item
    comm = moves = 0
    for have, need, size in zip(produced, s.inputs, sizes):
        if have == need:
            continue
        moves += 1
        if not (isinstance(have, Replicate) and isinstance(need, Shard)):
            comm += size
    sharded = sum(1 for p in s.outputs if not isinstance(p, Replicate))
    return (comm, moves, sharded if follow_only else -sharded, index)


def _nbytes(node: fx.Node) -> int:
    facts = node.meta[META_KEY]
    n = 1
    for d in facts.shapes[0] if facts.shapes else ():
        n *= d
    return max(n, 1)


def _placement(chosen: dict[str, Strategy], node: fx.Node) -> Placement:
    producer, index = value_of(node)
    strategy = chosen.get(producer.name)
    if strategy is None or index >= len(strategy.outputs):
        return R
    return strategy.outputs[index]


def batch_scaled(placement: Placement) -> bool:
    """Does a value with this dp placement shrink with the (micro)batch?"""
    return isinstance(placement, (Shard, Partial))


# Ops that find, order or count tokens by their values (MoE routing). Their indices are
# positions in the tensor they ran on, so no global-index rule shards them; but run on each
# rank's own tokens, indices from local tokens index those same local tokens, and the
# composite (pick a token's expert, run it, add the result back at the token) is what the
# whole batch would compute, token by token. Counts of local tokens sum to the global
# counts: Partial(sum), and a grouped matmul reads them as the sizes of its local groups.
_aten = torch.ops.aten
_FINDS = {_aten.nonzero.default, _aten.where.default, _aten.argwhere.default}
_ORDERS = {_aten.argsort.default, _aten.argsort.stable, _aten.sort.default, _aten.sort.stable}
_COUNTS = {_aten.histc.default, _aten.bincount.default}
_RANGES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step}
_COUNTED = {_aten.to.dtype, _aten._to_copy.default, _aten.cumsum.default, _aten.unbind.int}
# Groups of a rank's tokens by data-dependent sizes (its own counts per expert, ``split`` by
# ``tolist()``), and the groups joined again: each rank's own tokens, in its own order.
_GROUPS = {_aten.split_with_sizes.default, _aten.split.sizes, _aten.cat.default}
_PICKS = {_aten.index.Tensor, _aten.index_select.default}
_SCATTERS = {_aten.scatter_add.default, _aten.scatter.src, _aten.scatter.value,
             _aten.scatter_reduce.two, _aten.scatter_add_.default, _aten.scatter_.src,
             _aten.scatter_.value}
_PUTS = {_aten.index_add.default, _aten.index_copy.default, _aten.index_put.default,
         _aten.scatter_add.default, _aten.scatter.src, _aten.scatter.value,
         _aten.scatter_reduce.two, _aten.index_add_.default, _aten.index_copy_.default,
         _aten.index_put_.default, _aten.scatter_add_.default, _aten.scatter_.src,
         _aten.scatter_.value}


def token_set_strategy(node: fx.Node, produced: list[Placement]) -> Strategy | None:
    """The batch-axis strategy of a routing op reading some rank's own tokens, or None
    (no token input, or not a routing op: its sharding rule decides)."""
    target = node.target
    if target in _COUNTED and produced and produced[0] == Partial("sum"):
        # token counts stay exact counts in any dtype and when summed up (a rule keeps
        # partials floating point), and one per expert when taken apart (``tolist()``)
        n = len(node.meta[META_KEY].shapes)
        return Strategy(tuple(produced), (Partial("sum"),) * n)
    if not any(isinstance(p, Shard) for p in produced):
        return None
    n_out = len(node.meta[META_KEY].shapes)
    rows = Shard(0)
    if target in _SQUEEZES:
        return _squeezed(node, produced[0])
    if target in _GROUPS and all(p == rows for p in produced) and _grouped_rows(node):
        return Strategy(tuple(produced), (rows,) * n_out)
    if target in _FINDS:
        return Strategy(tuple(produced), (rows,) * n_out)
    if target in _COUNTS:
        return Strategy(tuple(produced), (Partial("sum"),) * n_out)
    if target in _ORDERS:
        dim = _arg(node, 1, "dim", -1)
        shard = produced[0]
        rank = len(node.meta[META_KEY].shapes[0])
        if isinstance(shard, Shard) and shard.dim == dim % max(rank, 1):
            return Strategy(tuple(produced), (shard,) * n_out)
        return None
    if target in _PICKS:
        source = produced[0]
        picked_by_tokens = any(isinstance(p, Shard) for p in produced[1:])
        if target is _aten.index_select.default:
            if _arg(node, 1, "dim", 0) != 0:
                return None
        elif list(_arg(node, 1, "indices", []))[:1] == [None]:
            return None  # x[:, i]: the token dim is not the indexed one
        if not (source == R or source == rows):
            return None
        first = list(_arg(node, 1, "indices", [None]))[0] if target is _aten.index.Tensor \
            else _arg(node, 2, "index", None)
        # x[arange(batch)[:, None], ...] (a padding mask picked per sample) reads each
        # rank's own rows too: the range is made for the local batch
        by_position = source == rows and isinstance(first, fx.Node) and _positions(first)
        if picked_by_tokens or by_position:
            return Strategy(tuple(produced), (rows,))
        return None
    if target in _PUTS:
        dest = produced[0]
        puts_rows = target in (_aten.index_put.default, _aten.index_put_.default)
        dim = 0 if puts_rows else _arg(node, 1, "dim", 0)
        inputs = tensor_inputs(node)
        # a constant sized by the local tokens (zeros to add into, positions 0..n) is
        # made on each rank for its own tokens
        local = [isinstance(p, Shard) or makes_constant(a.target) or a.target in _RANGES
                 or (p == R and _scalar(a)) for p, a in zip(produced, inputs)]
        if target in _SCATTERS:  # along ``dim`` within each row: the rows are another dim
            split = next((p for p in produced if isinstance(p, Shard) and p.dim != dim), None)
            if split is not None and local[0] and all(local[1:]) and all(
                    p in (split, R) for p in produced):
                return Strategy(tuple(produced), (split,))
            return None
        # rows put into this rank's rows, or into a fresh table of them
        into = dest if isinstance(dest, Shard) else Shard(dim)
        if into.dim == dim and local[0] and all(local[1:]):
            return Strategy(tuple(produced), (into,))
        return None

    if target in grouped_matmul_ops():
        if isinstance(produced[0], Shard) and produced[0].dim == 0:
            return Strategy(tuple(produced), (rows,))
    return None


_SQUEEZES = {_aten.squeeze.default, _aten.squeeze.dim, _aten.squeeze.dims}
# ops whose output shape is an argument: traced on a microbatch, a size the batch gives
# there is the microbatch's (``passes/localize_shapes`` rewrites the same ones)
_SHAPED = {_aten.expand.default, _aten.view.default, _aten.reshape.default,
           _aten._unsafe_view.default, _aten.repeat.default, _aten.new_zeros.default,
           _aten.new_ones.default, _aten.new_empty.default, _aten.new_full.default}


def _squeezed(node: fx.Node, placement: Placement) -> Strategy | None:
    """``squeeze`` of a tensor split on its batch dim: the program runs traced on its own
    microbatch, so a batch of one there squeezes as traced; the split dim follows."""
    shape = node.args[0].meta[META_KEY].shapes[0]
    if not isinstance(placement, Shard) or shape[placement.dim] == 1:
        return None
    dims = _arg(node, 1, "dim", None)
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    dropped = {d % len(shape) for d in dims if shape[d % len(shape)] == 1}
    return Strategy((placement,), (Shard(placement.dim - sum(d < placement.dim
                                                             for d in dropped),
                                         placement.groups),))


def _grouped_rows(node: fx.Node) -> bool:
    """Does ``node`` split or join along dim 0 by data-dependent sizes (tokens per expert)?"""
    dim = _arg(node, 2 if node.target is not _aten.cat.default else 1, "dim", 0)
    if dim != 0:
        return False
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in tensor_inputs(node)]
    flat = [v for val in vals for v in (val if isinstance(val, (list, tuple)) else [val])]
    return any(_unbacked(v) for v in flat)


def _splits_batch_sized(node: fx.Node, s: Strategy, size: int | None) -> bool:
    """Does ``s`` shard ``node``'s outputs only along dims of the traced batch's size?"""
    shapes = node.meta[META_KEY].shapes
    return all(not isinstance(p, Shard) or (i < len(shapes) and size and size > 1
                                            and shapes[i][p.dim] == size)
               for i, p in enumerate(s.outputs))


def _scalar(node: fx.Node) -> bool:
    """A 0-d tensor (a fill value put into every selected place)."""
    shapes = node.meta[META_KEY].shapes if META_KEY in node.meta else ()
    return bool(shapes) and shapes[0] == ()


def _arg(node: fx.Node, index: int, name: str, default):
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _counted_rows(node: fx.Node, call, n: int):
    """``call`` with every data-dependent size (tokens an expert got, ``u0`` in the trace,
    recorded as 1) replaced by a multiple of ``n``: a rank's own tokens need not split
    evenly, so the rule may shard them."""
    vals = [a.meta.get("val") for a in tensor_inputs(node)]
    out = node.meta.get("val")
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if not any(_unbacked(v) for v in (*vals, *outs)):
        return call

    # a sum of the counts the trace asserts (tokens x top-k) is that size, not a free one
    known = {int(s) for v in (*vals, *outs) if isinstance(v, torch.Tensor)
             for s in v.shape if not _is_unbacked(s)}

    def size(s, m):
        if not _is_unbacked(s):
            return m
        same = next((c for c in sorted(known) if statically_known_true(s == c)), None)
        return same if same is not None else n * _ROWS

    def sized(meta, val):
        if not _unbacked(val):
            return meta
        return TensorMeta(tuple(size(s, m) for s, m in zip(val.shape, meta.shape)), meta.dtype)

    metas = iter(vals)
    args, kwargs = tree_map(
        lambda a: sized(a, next(metas)) if isinstance(a, TensorMeta) else a,
        (tuple(call.args), dict(call.kwargs)))
    outs_meta = tuple(sized(m, v) for m, v in zip(call.out, outs))
    return OpCall(call.target, args, kwargs, outs_meta, call.hints)


_ROWS = 1024  # any multiple of the axis size; large, so no dim looks broadcast (size 1)


def _is_unbacked(size) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size))


def _unbacked(val) -> bool:
    return isinstance(val, torch.Tensor) and any(_is_unbacked(s) for s in val.shape)


_SHAPING = {_aten.unsqueeze.default, _aten.view.default, _aten.reshape.default,
            _aten.expand.default, _aten.slice.Tensor, _aten.to.dtype, _aten.to.device,
            _aten._to_copy.default, _aten.clone.default, _aten.alias.default}


def _positions(node: fx.Node) -> bool:
    """Is ``node`` a range (``arange``) re-shaped, made from no data at all?"""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or not (n.target in _RANGES or n.target in _SHAPING):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _batch_sized(node: fx.Node, size: int | None) -> bool:
    """Is ``node``'s first dim the traced batch (and its value no parameter's)?"""
    shapes = node.meta[META_KEY].shapes
    return bool(size and size > 1 and shapes and shapes[0] and shapes[0][0] == size)
