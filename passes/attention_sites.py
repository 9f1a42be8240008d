"""Find attention in a traced graph (analysis only; :mod:`fuse_attention` rewrites).

Two shapes of attention are recognized, by pattern, in any model:

- a ``scaled_dot_product_attention`` call (HF Llama, nanoGPT with flash attention), with
  its mask, dropout, causal flag, scale and GQA; key/value heads repeated by HF's
  ``repeat_kv`` (unsqueeze -> expand -> reshape) are taken before the repeat, so the kernel
  reads each kv head once;
- the decomposed chain of eager attention (HF GPT-2, nanoGPT's math path)::

      matmul(q, k^T) -> [* scale | / scale] -> [+ bias | masked_fill(~keep, -inf)]
                     -> softmax(-1) -> [same-dtype cast] -> [dropout] -> matmul(., v)

  Every intermediate must have the chain as its only user: if the attention probabilities
  are read elsewhere (``output_attentions``), fusing would drop them, so the site is kept
  and the reason recorded.

Each site says what the kernel call needs (q, k, v, bias or keep-mask, causal, scale,
dropout) or why it cannot be fused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.kernels.spec import MAX_HEAD_DIM
from autopar.placements import Replicate, Shard

aten = torch.ops.aten


@dataclass
class AttentionSite:
    """One attention computation in the graph: the node that yields its output, the nodes
    that fusing replaces, and the kernel's arguments (graph nodes or constants)."""

    output: fx.Node
    pattern: str  # "sdpa" or "eager"
    nodes: list[fx.Node] = field(default_factory=list)
    q: fx.Node | None = None
    k: fx.Node | None = None
    v: fx.Node | None = None
    bias: fx.Node | None = None  # additive (float) or keep-mask (bool: attend where True)
    causal: bool = False
    scale: float | None = None
    dropout_p: float = 0.0
    reason: str = ""  # why it cannot be fused ("" = it can)

    @property
    def name(self) -> str:
        return self.output.name

    @property
    def fusable(self) -> bool:
        return not self.reason

    def describe(self) -> str:
        parts = [self.pattern]
        if self.causal:
            parts.append("causal")
        if self.bias is not None:
            parts.append("mask" if _dtype(self.bias) == torch.bool else "bias")
        if self.dropout_p:
            parts.append(f"dropout {self.dropout_p:g}")
        if self.q is not None and self.k is not None:
            q, k = _shape(self.q), _shape(self.k)
            if q and k and len(q) == 4 and len(k) == 4:
                if k[1] and q[1] != k[1]:
                    parts.append(f"GQA {q[1] // k[1]}")
                parts.append(f"head dim {q[3]}")
        return ", ".join(parts)


def _val(node: object):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = _val(node)
    if isinstance(val, torch.Tensor):
        return tuple(int(d) for d in val.shape)
    facts = node.meta.get("autopar")
    if facts is not None and facts.shapes:
        return tuple(facts.shapes[0])
    return None


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = _val(node)
    if isinstance(val, torch.Tensor):
        return val.dtype
    facts = node.meta.get("autopar")
    dtypes = getattr(facts, "dtypes", None)
    if dtypes:
        found = getattr(torch, str(dtypes[0]).removeprefix("torch."), None)
        return found if isinstance(found, torch.dtype) else None
    return None


def _is(node: object, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def find_attention_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every attention site of ``gm``, in graph order, fusable or with the reason not."""
    sites = []
    for node in gm.graph.nodes:
        if _is(node, aten.scaled_dot_product_attention.default):
            sites.append(_sdpa_site(node))
        elif _is(node, aten.softmax.int, aten._softmax.default):
            site = _eager_site(node)
            if site is not None:
                sites.append(site)
    for site in sites:
        if site.fusable:
            site.reason = _unsupported(site)
    return sites


def _sdpa_site(node: fx.Node) -> AttentionSite:
    site = AttentionSite(output=node, pattern="sdpa", nodes=[node])
    site.q, k, v = node.args[0], node.args[1], node.args[2]
    site.bias = _arg(node, 3, "attn_mask")
    site.dropout_p = float(_arg(node, 4, "dropout_p", 0.0))
    site.causal = bool(_arg(node, 5, "is_causal", False))
    site.scale = _arg(node, 6, "scale")
    site.k, site.v = _unrepeated(k), _unrepeated(v)
    if (site.k is k) != (site.v is v):  # only one of them repeated: keep both as they are
        site.k, site.v = k, v
    return site


def _unrepeated(node: fx.Node) -> fx.Node:
    """``x`` for HF's ``repeat_kv(x)``: reshape(expand(unsqueeze(x, 2), [b, kv, g, s, d]),
    [b, kv * g, s, d]) — the kernel's GQA reads each kv head for its ``g`` query heads."""
    if not _is(node, aten.reshape.default, aten.view.default) or len(node.users) != 1:
        return node
    expand = node.args[0]
    if not _is(expand, aten.expand.default) or len(expand.users) != 1:
        return node
    unsqueeze = expand.args[0]
    if not _is(unsqueeze, aten.unsqueeze.default) or unsqueeze.args[1] != 2 or len(
            unsqueeze.users) != 1:
        return node
    return unsqueeze.args[0]


def _masks_out(value: object) -> bool:
    """A fill that removes a key from the softmax: -inf, or the dtype's lowest value (what
    many models use so a fully masked row stays finite)."""
    return isinstance(value, (int, float)) and value <= -1e30


_SCORE_OPS = (aten.mul.Tensor, aten.div.Tensor, aten.matmul.default, aten.bmm.default)


def _users(node: fx.Node) -> list[fx.Node]:
    """Users that compute something (export's dtype/device assertions do not)."""
    return [u for u in node.users if not _is(u, aten._assert_tensor_metadata.default)]


def _single_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _eager_site(softmax: fx.Node) -> AttentionSite | None:
    """The eager chain around ``softmax``, or None when this softmax is not attention."""
    if _arg(softmax, 1, "dim") not in (-1, 3):
        return None
    # Walk back: softmax <- [mask] <- [scale] <- matmul(q, k^T).
    nodes = [softmax]
    x = softmax.args[0]
    bias = None
    if _is(x, aten.add.Tensor) and all(isinstance(a, fx.Node) for a in x.args[:2]):
        nodes.append(x)
        scores, bias = x.args[0], x.args[1]
        if not _is(scores, *_SCORE_OPS) and _is(bias, *_SCORE_OPS):
            scores, bias = bias, scores
        x = scores
    elif _is(x, aten.masked_fill.Scalar) and _masks_out(_arg(x, 2, "value")):
        fill_where = x.args[1]
        nodes.append(x)
        if _is(fill_where, aten.bitwise_not.default) and len(_users(fill_where)) == 1:
            bias = fill_where.args[0]  # keep-mask: attend where True
            nodes.append(fill_where)
        else:
            bias = ("not", fill_where)  # fill where True: the fusion inverts it
        x = x.args[0]
    scale = 1.0
    if _is(x, aten.mul.Tensor) and isinstance(x.args[1], (int, float)):
        scale, x = float(x.args[1]), _with(nodes, x).args[0]
    elif _is(x, aten.div.Tensor) and isinstance(x.args[1], (int, float)):
        scale, x = 1.0 / float(x.args[1]), _with(nodes, x).args[0]
    if not _is(x, aten.matmul.default, aten.bmm.default):
        return None
    scores = x
    nodes.append(scores)
    q, kt = scores.args
    if not (_is(kt, aten.transpose.int) and sorted(kt.args[1:]) in ([-2, -1], [2, 3])):
        return None
    k = kt.args[0]
    # Walk forward: softmax -> [cast] -> [dropout] -> matmul(., v).
    y = softmax
    dropout_p = 0.0
    site = AttentionSite(output=softmax, pattern="eager", q=q, k=k, scale=scale)
    nxt = _single_user(y)
    if _is(nxt, aten.to.dtype, aten._to_copy.default) and _dtype(nxt) == _dtype(y):
        y = nxt
        nodes.append(y)
        nxt = _single_user(y)
    if _is(nxt, aten.dropout.default):
        train = bool(_arg(nxt, 2, "train", True))
        dropout_p = float(_arg(nxt, 1, "p", 0.0)) if train else 0.0
        y = nxt
        nodes.append(y)
        nxt = _single_user(y)
    if not (_is(nxt, aten.matmul.default, aten.bmm.default) and nxt.args[0] is y):
        if nxt is None and len(_users(y)) > 1:
            site.reason = "the attention probabilities are also used elsewhere"
            return site
        return None
    site.output, site.v, site.dropout_p = nxt, nxt.args[1], dropout_p
    nodes.append(nxt)
    site.nodes = [n for n in dict.fromkeys(nodes) if isinstance(n, fx.Node)]
    if isinstance(bias, tuple):
        site.bias = bias[1]
        site.reason = "masked_fill's mask is not a negated keep-mask"
    else:
        site.bias = bias
    site.causal, site.bias = _causal_constant(softmax.graph.owning_module, site.bias)
    inner = [n for n in site.nodes if n is not site.output]
    shared = [n.name for n in inner if any(u not in site.nodes for u in _users(n))]
    if shared and not site.reason:
        site.reason = f"intermediate values are also used elsewhere ({', '.join(shared)})"
    return site


def _with(nodes: list, node: fx.Node) -> fx.Node:
    nodes.append(node)
    return node


def _causal_constant(gm: fx.GraphModule | None, mask: fx.Node | None) -> tuple[bool, fx.Node | None]:
    """A keep-mask that is a constant lower-triangular buffer (nanoGPT's ``causal``), or a
    top-left slice of one, is causal attention: the kernel then skips the blocks above the
    diagonal and needs no mask."""
    if mask is None or gm is None:
        return False, mask
    source = mask
    while _is(source, aten.alias.default, aten.detach.default) or (
            _is(source, aten.slice.Tensor) and _arg(source, 2, "start", 0) in (0, None)):
        source = source.args[0]
    if source.op != "get_attr":
        return False, mask
    try:
        value = operator.attrgetter(source.target)(gm)
    except AttributeError:
        return False, mask
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.dim() < 2:
        return False, mask
    if any(d != 1 for d in value.shape[:-2]) or value.dtype != torch.bool:
        return False, mask
    square = value.reshape(value.shape[-2:])
    if square.shape[0] == square.shape[1] and torch.equal(square, torch.ones_like(square).tril()):
        return True, None
    return False, mask


def _unsupported(site: AttentionSite) -> str:
    """Why the generated kernels cannot run this site ("" when they can)."""
    shapes = {name: _shape(n) for name, n in (("q", site.q), ("k", site.k), ("v", site.v))
              if isinstance(n, fx.Node)}
    if len(shapes) != 3:
        return "q, k or v is not a tensor"
    if any(s is None or len(s) != 4 for s in shapes.values()):
        return f"q, k, v are not (batch, heads, seq, head_dim): {shapes}"
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    if k != v:
        return f"k and v shapes differ ({k} vs {v}); the kernels need one head dim"
    if q[3] > MAX_HEAD_DIM:
        return f"head dim {q[3]} is above the kernels' {MAX_HEAD_DIM}"
    if k[1] == 0 or q[1] % k[1]:
        return f"{q[1]} query heads are not a multiple of {k[1]} kv heads"
    dtype = _dtype(site.q)
    if dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not fp32/fp16/bf16"
    if isinstance(site.bias, fx.Node):
        b = _shape(site.bias)
        try:
            if b is not None and torch.broadcast_shapes(b, (q[0], q[1], q[2], k[2])) != (
                    q[0], q[1], q[2], k[2]):
                return f"the mask {b} does not broadcast to (batch, heads, q_len, k_len)"
        except RuntimeError:
            return f"the mask {b} does not broadcast to (batch, heads, q_len, k_len)"
    return ""


def kernel_compatible(strategy) -> bool:
    """Can a fused site run under this tp strategy of one of its nodes? The kernel computes
    whole rows of attention per (batch, head): q, k, v and the output may be split over batch
    (dim 0) or heads (dim 1) only — a split head dim would leave partial scores, a split
    sequence would need a query offset."""
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (0, 1))
               for p in (*strategy.inputs, *strategy.outputs))

