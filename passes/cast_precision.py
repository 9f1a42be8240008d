"""Write the plan's per-node precision into this rank's program, as casts.

``plan.precision`` gives every floating node the dtype it computes in
(:mod:`autopar.analysis.precision`). This pass makes each node's floating inputs arrive in that dtype:
where an input is stored in another one, a ``cast_to(x, dtype)`` is inserted before the
node. A matmul the plan lowers to bf16 thus reads ``cast_to(weight, torch.bfloat16)`` — the
fp32 parameter stays the optimizer's master copy, and autograd returns its gradient in fp32
— and a normalisation kept fp32 reads ``cast_to(x, torch.float32)``. Nodes that follow type
promotion get no cast. fp8 linears call :func:`autopar.ops.fp8_ops.fp8_linear`.

Export's ``_assert_tensor_metadata`` checks (that a value keeps its traced dtype) go: the
plan changes dtypes on purpose.

Runs after the passes that replace nodes (attention fusion, chunked losses): a replacement
keeps the replaced node's facts, so it is found by the name the plan knows. Chunked and
vocabulary-parallel cross-entropies read low-precision logits and upcast one block at a
time themselves, so their logits are not cast (no fp32 copy of them exists).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from autopar.analysis.precision import TORCH_DTYPES, WORD_OF_DTYPE, stored_word, traced_noop_cast
from autopar.core.graph_facts import META_KEY
from autopar.ops import comm_ops
from autopar.ops.fp8_ops import fp8_linear
from autopar.ops.local_ops import LOCAL_IMPLS
from autopar.ops.loss_ops import chunked_cross_entropy
from autopar.ops.step_copies import cast_weight
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass

aten = torch.ops.aten


def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is): the casts the plan's precision adds."""
    return x if x.dtype == dtype else x.to(dtype)


_CASTS = (cast_to, cast_weight)


def _caster(source: fx.Node):
    """A parameter's cast makes one copy per step (:mod:`autopar.ops.step_copies`); any
    other value's, one per use."""
    facts = source.meta.get(META_KEY)
    param = (source.op == "get_attr" and facts is not None and facts.param is not None
             and not facts.param.is_buffer)
    return cast_weight if param else cast_to


_UPCASTS_ITSELF = {chunked_cross_entropy, *(f for name, f in LOCAL_IMPLS.items()
                                            if "cross_entropy" in name)}
"""Losses that read low-precision logits and upcast block by block."""

_DTYPE_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)
_COLLECTIVES = (comm_ops.redistribute, comm_ops.redistribute_output, comm_ops.gather_scatter_grad,
                comm_ops.grad_all_reduce)


def _cast_before_collectives(arg: fx.Node, want: str, words: Mapping[str, str],
                             stored: dict[fx.Node, str]) -> fx.Node | None:
    """When ``arg`` is the end of a chain of collectives whose every reader computes in
    ``want``, cast the chain's source instead, so the collectives move the smaller dtype
    (the cost model prices it so); the cast node, or None when that is not so."""
    chain = []
    node = arg
    while node.op == "call_function" and node.target in _COLLECTIVES:
        chain.append(node)
        node = node.args[0]
    if not chain or stored.get(node) in (None, want):
        return None
    for link in chain:
        for user in link.users:
            if user in chain:
                continue
            word = words.get(_planned_name(user))
            if word is None or stored_word(word) != want or user.target in _UPCASTS_ITSELF:
                return None
    first = chain[-1]
    with first.graph.inserting_before(first):
        cast = first.graph.call_function(_caster(node), (node, TORCH_DTYPES[want]))
    cast.meta = {k: v for k, v in node.meta.items() if k != META_KEY}
    first.replace_input_with(node, cast)
    for link in chain:
        stored[link] = want
    stored[cast] = want
    return cast


def _planned_name(node: fx.Node) -> str:
    facts = node.meta.get(META_KEY)
    return facts.name if facts is not None else node.name


def _traced_word(node: fx.Node) -> str | None:
    facts = node.meta.get(META_KEY)
    if facts is not None and facts.dtypes:
        return WORD_OF_DTYPE.get(str(facts.dtypes[0]))
    val = node.meta.get("val")
    return WORD_OF_DTYPE.get(str(val.dtype)) if isinstance(val, torch.Tensor) else None


def stored_words(gm: fx.GraphModule, words: Mapping[str, str],
                 params: str = "fp32") -> dict[fx.Node, str]:
    """The dtype word each floating value of ``gm`` is stored in when run with ``words``:
    a planned node's own, a parameter's ``params``, else its first floating input's (a
    collective or view keeps its input's dtype), else as traced."""
    out: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        traced = _traced_word(node)
        planned = words.get(_planned_name(node))
        if node.target in _CASTS:
            out[node] = WORD_OF_DTYPE[str(node.args[1])]
        elif planned is not None:
            out[node] = stored_word(planned)
        elif node.op == "get_attr" and traced in ("fp32", "bf16", "fp16"):
            facts = node.meta.get(META_KEY)
            buffer = facts is not None and facts.param is not None and facts.param.is_buffer
            out[node] = traced if buffer else params
        elif node.op in ("call_function", "call_method"):
            inherited = next((out[a] for a in node.all_input_nodes if a in out), None)
            if inherited is not None and traced is not None:
                out[node] = inherited
            elif traced is not None:
                out[node] = traced
        elif traced is not None:
            out[node] = traced
    return out


def _retarget_noop_casts(gm: fx.GraphModule, words: Mapping[str, str]) -> int:
    """A cast that changed nothing while tracing casts to the plan's dtype instead (see
    :func:`autopar.analysis.precision.traced_noop_cast`); how many."""
    count = 0
    for node in gm.graph.nodes:
        word = words.get(_planned_name(node))
        if word is None or node.target not in _DTYPE_CASTS or traced_noop_cast(node) is None:
            continue
        want = TORCH_DTYPES[stored_word(word)]
        node.target, node.args, node.kwargs = cast_to, (node.args[0], want), {}
        count += 1
    return count


def _cast_back(gm: fx.GraphModule, words: Mapping[str, str]) -> int:
    """Cast the outputs the plan hands back in another dtype (a normalisation computed in
    fp32 whose input was 16-bit) right after they are made; how many."""
    count = 0
    for node in list(gm.graph.nodes):
        word = words.get(_planned_name(node)) if node.op == "call_function" else None
        if word is None or node.target is cast_to:
            continue
        with gm.graph.inserting_after(node):
            back = gm.graph.call_function(cast_to, (node, TORCH_DTYPES[word]))
        back.meta = {k: v for k, v in node.meta.items() if k != META_KEY}
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        count += 1
    return count


@register_pass
class CastPrecision(GraphPass):
    name = "cast-precision"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        words = ctx.plan.precision
        if not words or set(words.values()) == {"fp32"}:
            return PassResult(gm, modified=False)
        params = ctx.plan.precision_policy.get("params", "fp32")
        retargeted = _retarget_noop_casts(gm, words)
        back = _cast_back(gm, ctx.plan.precision_policy.get("cast_back", {}))
        stored = stored_words(gm, words, params)
        casts: dict[tuple[fx.Node, str], fx.Node] = {}
        counts: dict[str, int] = {}
        fp8 = 0
        for node in list(gm.graph.nodes):
            if node.op not in ("call_function", "call_method") or node.target in _CASTS:
                continue
            word = words.get(_planned_name(node))
            if word is None or node.target in _UPCASTS_ITSELF:
                continue
            if word == "fp8" and node.target is aten.linear.default:
                node.target = fp8_linear
                fp8 += 1
                continue
            want = stored_word(word)
            for arg in node.all_input_nodes:
                have = stored.get(arg)
                if have is None or have == want or have not in TORCH_DTYPES:
                    continue
                if _cast_before_collectives(arg, want, words, stored) is not None:
                    counts[want] = counts.get(want, 0) + 1
                    continue
                key = (arg, want)
                if key not in casts:  # one cast per value and dtype, before its first use
                    with gm.graph.inserting_before(node):
                        cast = gm.graph.call_function(_caster(arg),
                                                      (arg, TORCH_DTYPES[want]))
                    cast.meta = {k: v for k, v in arg.meta.items() if k != META_KEY}
                    casts[key] = cast
                    counts[want] = counts.get(want, 0) + 1
                node.replace_input_with(arg, casts[key])
        # export's checks that values keep their traced dtypes no longer hold, on purpose
        checks = [n for n in gm.graph.nodes if n.target is aten._assert_tensor_metadata.default]
        for check in checks:
            gm.graph.erase_node(check)
        changes = [f"{n} value(s) cast to {w}" for w, n in sorted(counts.items())]
        if back:
            changes.append(f"{back} normalisation output(s) cast back to their input's dtype")
        if retargeted:
            changes.append(f"{retargeted} cast(s) that were no-ops while tracing follow the plan")
        if fp8:
            changes.append(f"{fp8} linear(s) in fp8 (tensorwise scaling)")
        return PassResult(gm, modified=bool(changes), changes=changes)
