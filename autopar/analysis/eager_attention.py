"""Recognize eager attention: the decomposed chain HF models write out op by op.

Walking back from a ``softmax`` over the last dim, then forward to the product with v::

    matmul(q, k^T) | bmm(q, k^T) | baddbmm(bias, q, k^T, beta, alpha)
      -> [* c | / c]...                      scaling (also in place: Falcon's ``/=``)
      -> [c * tanh(. / c)]                   soft-capping (Gemma-2)
      -> [+ bias | masked_fill(mask, -inf)]...   T5's relative positions and mask, ...
      -> softmax(-1) -> [same-dtype cast] -> [dropout] -> matmul(., v) | bmm(., v)

BLOOM computes the scores as ``(batch * heads, q_len, k_len)`` with ALiBi added by
``baddbmm`` and views them as ``(batch, heads, q_len, k_len)`` for the mask: such a *flat*
site takes q, k, v from before their flattening reshape, and its output is flattened back.
Key/value heads repeated by HF's ``repeat_kv`` are taken before the repeat (GQA).

Every intermediate must have the chain as its only user: if the attention probabilities
are read elsewhere (``output_attentions``), fusing would drop them, so the site is kept
and the reason recorded.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.analysis.attention_sites import (
    AttentionSite,
    BiasTerm,
    arg,
    causal_constant,
    dtype_of,
    is_call,
    shape_of,
    single_user,
    unrepeated,
    users_of,
)

aten = torch.ops.aten

_PRODUCTS = (aten.matmul.default, aten.bmm.default)
_SCALES = (aten.mul.Tensor, aten.div.Tensor, aten.mul_.Tensor, aten.div_.Tensor)
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _constant(node: fx.Node) -> float | None:
    """``c`` of ``x * c`` or ``x / c`` (as a factor: 1/c for a division), else None."""
    if not is_call(node, *_SCALES) or not isinstance(node.args[1], (int, float)):
        return None
    c = float(node.args[1])
    if is_call(node, aten.div.Tensor, aten.div_.Tensor):
        return 1.0 / c if c else None
    return c


def _masks_out(value: object) -> bool:
    """A fill that removes a key from the softmax: -inf, or the dtype's lowest value (what
    many models use so a fully masked row stays finite)."""
    return isinstance(value, (int, float)) and value <= -1e30


def _is_kt(node: object) -> bool:
    return is_call(node, aten.transpose.int) and sorted(node.args[1:]) in ([-2, -1], [1, 2],
                                                                           [2, 3])


def _product(node: object) -> bool:
    """``q @ k^T`` (or ``baddbmm``'s)."""
    if is_call(node, *_PRODUCTS):
        return _is_kt(node.args[1])
    return is_call(node, aten.baddbmm.default) and _is_kt(node.args[2])


def _leads_to_scores(node: object, depth: int = 8) -> bool:
    """Does ``node`` come from ``q @ k^T`` through ops that transform scores?"""
    for _ in range(depth):
        if _product(node):
            return True
        if is_call(node, aten.add.Tensor) and all(isinstance(a, fx.Node) for a in node.args[:2]):
            return any(_leads_to_scores(a, depth - 1) for a in node.args[:2])
        if not (_constant(node) is not None or is_call(node, aten.tanh.default, *_RESHAPES,
                                                       aten.masked_fill.Scalar)):
            return False
        node = node.args[0]
    return False


def _unflattened(node: fx.Node, like: tuple[int, ...] | None = None) -> fx.Node | None:
    """``x`` of ``reshape(x, (b * h, n, d))`` with ``x`` of shape ``(b, h, n, d)``."""
    if not is_call(node, *_RESHAPES):
        return None
    x = node.args[0]
    inner, outer = shape_of(x), shape_of(node)
    if inner is None or outer is None or len(inner) != 4 or len(outer) != 3:
        return None
    if (inner[0] * inner[1], *inner[2:]) != outer:
        return None
    return x


def _biases(x: fx.Node, nodes: list, terms: list, flat: bool) -> tuple[fx.Node, bool] | None:
    """Walk back over the bias terms (and the flat-to-4d view) added after the scores."""
    while True:
        if is_call(x, aten.add.Tensor) and all(isinstance(a, fx.Node) for a in x.args[:2]):
            if arg(x, 2, "alpha", 1) != 1:
                return None
            a, b = x.args[:2]
            score, bias = (a, b) if _leads_to_scores(a) else (b, a)
            if not _leads_to_scores(score):
                return None
            terms.append(BiasTerm("add", bias, flat=flat))
        elif is_call(x, aten.masked_fill.Scalar) and _masks_out(arg(x, 2, "value")):
            mask = x.args[1]
            if is_call(mask, aten.bitwise_not.default) and len(users_of(mask)) == 1:
                terms.append(BiasTerm("keep", mask.args[0], flat=flat))
                nodes.append(mask)
            else:
                terms.append(BiasTerm("drop", mask, flat=flat))
        elif not flat and is_call(x, *_RESHAPES) and _unflattened_scores(x):
            flat = True
        else:
            return x, flat
        nodes.append(x)
        x = x.args[0]


def _unflattened_scores(view: fx.Node) -> bool:
    """``view`` turns ``(b * h, m, n)`` scores into ``(b, h, m, n)``."""
    inner, outer = shape_of(view.args[0]), shape_of(view)
    return (inner is not None and outer is not None and len(inner) == 3 and len(outer) == 4
            and (outer[0] * outer[1], *outer[2:]) == inner)


def _softcap(x: fx.Node, nodes: list) -> tuple[fx.Node, float | None]:
    """``c * tanh(y / c)`` -> (y, c); anything else -> (x, None)."""
    outer = _constant(x)
    if outer is None or not is_call(x.args[0], aten.tanh.default):
        return x, None
    tanh = x.args[0]
    inner = _constant(tanh.args[0])
    if inner is None or abs(inner * outer - 1.0) > 1e-6 or len(users_of(tanh)) != 1:
        return x, None
    nodes += [x, tanh, tanh.args[0]]
    return tanh.args[0].args[0], outer


def eager_site(softmax: fx.Node) -> AttentionSite | None:
    """The eager chain around ``softmax``, or None when this softmax is not attention."""
    if arg(softmax, 1, "dim") not in (-1, 3):
        return None
    nodes: list[fx.Node] = [softmax]
    terms: list[BiasTerm] = []
    walked = _biases(softmax.args[0], nodes, terms, flat=False)
    if walked is None:
        return None
    x, flat = walked
    x, softcap = _softcap(x, nodes)
    scale = 1.0
    while (c := _constant(x)) is not None:
        scale *= c
        nodes.append(x)
        x = x.args[0]
    if not _product(x):
        return None
    nodes.append(x)
    reason = ""
    if is_call(x, aten.baddbmm.default):
        bias_in, q, kt = x.args[:3]
        beta, alpha = float(arg(x, 3, "beta", 1.0)), float(arg(x, 4, "alpha", 1.0))
        if beta and (scale != 1.0 or softcap):
            reason = "baddbmm's bias is scaled or soft-capped with the scores"
        scale *= alpha
        if beta:
            terms.append(BiasTerm("add", bias_in, factor=beta, flat=flat))
    else:
        q, kt = x.args[:2]
    k = kt.args[0]
    site = AttentionSite(output=softmax, pattern="eager", q=q, k=k, scale=scale,
                         softcap=softcap, flat=flat, reason=reason)
    output = _forward(softmax, nodes, flat)
    if output is None:
        return None
    if output is softmax:
        site.reason = "the attention probabilities are also used elsewhere"
        return site
    v = output.args[1]
    if flat:
        q, k, v = _unflattened(q), _unflattened(k), _unflattened(v)
        if q is None or k is None or v is None:
            return None
    site.q = q
    site.k, site.v = unrepeated(k, v)
    site.output = output
    site.nodes = list(dict.fromkeys(nodes))
    site.dropout_p = _dropout_p(site.nodes)
    site.terms = _simplified(softmax.graph.owning_module, terms, site)
    inner = [n for n in site.nodes if n is not site.output]
    shared = [n.name for n in inner if any(u not in site.nodes for u in users_of(n))]
    if shared and not site.reason:
        site.reason = f"intermediate values are also used elsewhere ({', '.join(shared)})"
    return site


def _forward(softmax: fx.Node, nodes: list, flat: bool) -> fx.Node | None:
    """softmax -> [cast] -> [dropout] -> [flattening view] -> matmul(., v): the product
    node; ``softmax`` itself when the probabilities are read elsewhere too; None when this
    is not attention. Dropout's probability is read back from the nodes."""
    y = softmax
    nxt = single_user(y)
    if is_call(nxt, aten.to.dtype, aten._to_copy.default) and dtype_of(nxt) == dtype_of(y):
        y = nxt
        nodes.append(y)
        nxt = single_user(y)
    if is_call(nxt, aten.dropout.default):
        y = nxt
        nodes.append(y)
        nxt = single_user(y)
    if flat and is_call(nxt, *_RESHAPES):
        y = nxt
        nodes.append(y)
        nxt = single_user(y)
    if is_call(nxt, *_PRODUCTS) and nxt.args[0] is y:
        nodes.append(nxt)
        return nxt
    if nxt is None and len(users_of(y)) > 1:
        return softmax
    return None


def _dropout_p(nodes: list[fx.Node]) -> float:
    for node in nodes:
        if is_call(node, aten.dropout.default):
            return float(arg(node, 1, "p", 0.0)) if bool(arg(node, 2, "train", True)) else 0.0
    return 0.0


def _simplified(gm, terms: list[BiasTerm], site: AttentionSite) -> list[BiasTerm]:
    """Terms in the order they were added; a lone keep-mask that is a constant causal
    triangle becomes ``causal=True`` with no mask."""
    terms = terms[::-1]
    if len(terms) == 1 and terms[0].kind == "keep" and causal_constant(gm, terms[0].node):
        site.causal = True
        return []
    return terms
