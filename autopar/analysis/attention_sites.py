"""Find attention in a traced graph (analysis only; :mod:`fuse_attention` rewrites).

Two shapes of attention are recognized, by pattern, in any model:

- a ``scaled_dot_product_attention`` call (HF Llama, nanoGPT with flash attention), with
  its mask, dropout, causal flag, scale and GQA; key/value heads repeated by HF's
  ``repeat_kv`` (unsqueeze -> expand -> reshape) are taken before the repeat, so the kernel
  reads each kv head once;
- the decomposed chain of eager attention, in the variants HF models write
  (:mod:`autopar.analysis.eager_attention`): scaling, soft-capping (Gemma-2), additive biases
  (T5's relative positions, BLOOM's ALiBi through ``baddbmm``), masks, and the
  ``(batch * heads, seq, dim)`` layout of BLOOM.

Each site says what the kernel call needs (q, k, v, bias terms, causal, scale, softcap,
dropout) or why it cannot be fused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.analysis.causal_mask import computed_causal
from autopar.core.placements import Replicate, Shard
from autopar.kernels.spec import MAX_HEAD_DIM

aten = torch.ops.aten


@dataclass(frozen=True)
class BiasTerm:
    """One term of the scores' bias: ``add`` (``factor`` x a float tensor), ``keep`` (a bool
    mask, attend where True) or ``drop`` (a bool mask, masked where True). ``flat``: the
    tensor is laid out ``(batch * heads, ...)`` like the scores of a flat site."""

    kind: str
    node: fx.Node
    factor: float = 1.0
    flat: bool = False


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
    terms: list[BiasTerm] = field(default_factory=list)  # summed into the kernel's bias
    causal: bool = False
    scale: float | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before bias
    dropout_p: float = 0.0
    flat: bool = False  # scores and output are (batch * heads, ...): the output is flattened
    reason: str = ""  # why it cannot be fused ("" = it can)

    @property
    def name(self) -> str:
        return self.output.name

    @property
    def fusable(self) -> bool:
        return not self.reason

    @property
    def bias(self) -> fx.Node | None:
        """The kernel's bias when it is one tensor as it stands (else None: no bias, or
        terms the fusion combines)."""
        if len(self.terms) == 1 and self.terms[0].kind in ("add", "keep"):
            term = self.terms[0]
            return term.node if term.factor == 1.0 and not term.flat else None
        return None

    def describe(self) -> str:
        parts = [self.pattern]
        if self.causal:
            parts.append("causal")
        masks = sum(t.kind != "add" for t in self.terms)
        biases = len(self.terms) - masks
        if masks:
            parts.append("mask" if masks == 1 else f"{masks} masks")
        if biases:
            parts.append("bias" if biases == 1 else f"{biases} biases")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.dropout_p:
            parts.append(f"dropout {self.dropout_p:g}")
        if self.flat:
            parts.append("(batch*heads) layout")
        if self.q is not None and self.k is not None:
            q, k = shape_of(self.q), shape_of(self.k)
            if q and k and len(q) == 4 and len(k) == 4:
                if k[1] and q[1] != k[1]:
                    parts.append(f"GQA {q[1] // k[1]}")
                parts.append(f"head dim {q[3]}")
        return ", ".join(parts)


def _val(node: object):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    val = _val(node)
    if isinstance(val, torch.Tensor):
        return tuple(int(d) for d in val.shape)
    facts = node.meta.get("autopar")
    if facts is not None and facts.shapes:
        return tuple(facts.shapes[0])
    return None


def dtype_of(node: fx.Node) -> torch.dtype | None:
    val = _val(node)
    if isinstance(val, torch.Tensor):
        return val.dtype
    facts = node.meta.get("autopar")
    dtypes = getattr(facts, "dtypes", None)
    if dtypes:
        found = getattr(torch, str(dtypes[0]).removeprefix("torch."), None)
        return found if isinstance(found, torch.dtype) else None
    return None


def is_call(node: object, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def users_of(node: fx.Node) -> list[fx.Node]:
    """Users that compute something (export's dtype/device assertions do not)."""
    return [u for u in node.users if not is_call(u, aten._assert_tensor_metadata.default)]


def single_user(node: fx.Node) -> fx.Node | None:
    users = users_of(node)
    return users[0] if len(users) == 1 else None


def find_attention_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every attention site of ``gm``, in graph order, fusable or with the reason not."""
    from autopar.analysis.eager_attention import eager_site

    sites = []
    for node in gm.graph.nodes:
        if is_call(node, aten.scaled_dot_product_attention.default):
            sites.append(_sdpa_site(node))
        elif is_call(node, aten.softmax.int, aten._softmax.default):
            site = eager_site(node)
            if site is not None:
                sites.append(site)
    causal: dict[fx.Node, bool] = {}  # one mask is shared by every layer
    for site in sites:
        if site.fusable:
            site.reason = _unsupported(site)
        if site.fusable and not site.causal and len(site.terms) == 1:
            _recognise_causal(site, causal)
    return sites


def _recognise_causal(site: AttentionSite, seen: dict[fx.Node, bool]) -> None:
    """A single mask term the model computes from positions that is causal becomes the
    kernel's ``causal`` flag (see :mod:`autopar.analysis.causal_mask`)."""
    term = site.terms[0]
    q, k = shape_of(site.q), shape_of(site.k)
    if term.flat or q[2] != k[2]:
        return
    if term.node not in seen:
        seen[term.node] = computed_causal(term.node, term.kind, q[2], (q[0], q[1], k[1], q[3]))
    if seen[term.node]:
        site.causal, site.terms = True, []


def _sdpa_site(node: fx.Node) -> AttentionSite:
    site = AttentionSite(output=node, pattern="sdpa", nodes=[node])
    site.q, k, v = node.args[0], node.args[1], node.args[2]
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node):
        site.terms = [BiasTerm("keep" if dtype_of(mask) == torch.bool else "add", mask)]
    site.dropout_p = float(arg(node, 4, "dropout_p", 0.0))
    site.causal = bool(arg(node, 5, "is_causal", False))
    site.scale = arg(node, 6, "scale")
    site.k, site.v = unrepeated(k, v)
    return site


def unrepeated(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``k, v`` before HF's ``repeat_kv`` when both went through it (else as they are)."""
    uk, uv = _unrepeated(k), _unrepeated(v)
    return (uk, uv) if (uk is k) == (uv is v) else (k, v)


def _unrepeated(node: fx.Node) -> fx.Node:
    """``x`` for HF's ``repeat_kv(x)``: reshape(expand(unsqueeze(x, 2), [b, kv, g, s, d]),
    [b, kv * g, s, d]) — the kernel's GQA reads each kv head for its ``g`` query heads."""
    if not is_call(node, aten.reshape.default, aten.view.default) or len(node.users) != 1:
        return node
    expand = node.args[0]
    if not is_call(expand, aten.expand.default) or len(expand.users) != 1:
        return node
    unsqueeze = expand.args[0]
    if not is_call(unsqueeze, aten.unsqueeze.default) or unsqueeze.args[1] != 2 or len(
            unsqueeze.users) != 1:
        return node
    return unsqueeze.args[0]


def causal_constant(gm: fx.GraphModule | None, mask: fx.Node | None) -> bool:
    """Is ``mask`` (a keep-mask) a constant lower-triangular buffer (nanoGPT's ``causal``),
    or a top-left slice of one? The kernel then skips the blocks above the diagonal and
    needs no mask."""
    if mask is None or gm is None:
        return False
    source = mask
    while is_call(source, aten.alias.default, aten.detach.default) or (
            is_call(source, aten.slice.Tensor) and arg(source, 2, "start", 0) in (0, None)):
        source = source.args[0]
    if source.op != "get_attr":
        return False
    try:
        value = operator.attrgetter(source.target)(gm)
    except AttributeError:
        return False
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.dim() < 2:
        return False
    if any(d != 1 for d in value.shape[:-2]) or value.dtype != torch.bool:
        return False
    square = value.reshape(value.shape[-2:])
    return square.shape[0] == square.shape[1] and torch.equal(
        square, torch.ones_like(square).tril())


def term_shape(term: BiasTerm, q: tuple[int, ...]) -> tuple[int, ...] | None:
    """A bias term's shape as the kernel sees it: ``(batch * heads, ...)`` unflattened."""
    shape = shape_of(term.node)
    if shape is None or not term.flat:
        return shape
    if not shape or shape[0] != q[0] * q[1]:
        return None
    return (q[0], q[1], *shape[1:])


def _unsupported(site: AttentionSite) -> str:
    """Why the generated kernels cannot run this site ("" when they can)."""
    shapes = {name: shape_of(n) for name, n in (("q", site.q), ("k", site.k), ("v", site.v))
              if isinstance(n, fx.Node)}
    if len(shapes) != 3:
        return "q, k or v is not a tensor"
    if any(s is None or len(s) != 4 for s in shapes.values()):
        return f"q, k, v are not (batch, heads, seq, head_dim): {shapes}"
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    if k != v:
        return f"k and v shapes differ ({k} vs {v}); the kernels need one head dim"
    if q[0] != k[0] or q[3] != k[3]:
        return f"q {q} and k {k} differ in batch or head dim"
    if q[3] > MAX_HEAD_DIM:
        return f"head dim {q[3]} is above the kernels' {MAX_HEAD_DIM}"
    if k[1] == 0 or q[1] % k[1]:
        return f"{q[1]} query heads are not a multiple of {k[1]} kv heads"
    dtype = dtype_of(site.q)
    if dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not fp32/fp16/bf16"
    scores = (q[0], q[1], q[2], k[2])
    for term in site.terms:
        b = term_shape(term, q)
        try:
            ok = b is None or torch.broadcast_shapes(b, scores) == scores
        except RuntimeError:
            ok = False
        if not ok:
            return f"the {term.kind} term {term.node.name} {b} does not broadcast to " \
                   f"(batch, heads, q_len, k_len) {scores}"
    return ""


def kernel_compatible(strategy, ranks: tuple[int, ...] | None = None) -> bool:
    """Can a fused site run under this tp strategy of one of its nodes? The kernel computes
    whole rows of attention per (batch, head): q, k, v, scores and the output may be split
    over batch (dim 0) or heads (dim 1 of a 4-d tensor; in the ``(batch * heads, ...)``
    layout dim 0 holds both) only — a split head dim would leave partial scores, a split
    sequence would need a query offset. ``ranks``: the tensors' ranks (inputs, then
    outputs), 4 each if not given."""
    placements = (*strategy.inputs, *strategy.outputs)
    ranks = ranks or (4,) * len(placements)
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and (
        (p.dim == 0 and r >= 3) or (p.dim == 1 and r == 4))) for p, r in zip(placements, ranks))


def placement_ranks(node: fx.Node) -> tuple[int, ...]:
    """The ranks of ``node``'s tensor inputs and outputs, in its strategy's order."""
    from autopar.core.values import tensor_inputs

    ins = [len(shape_of(a) or ()) for a in tensor_inputs(node)]
    facts = node.meta.get("autopar")
    outs = [len(s) for s in facts.shapes] if facts is not None else [len(shape_of(node) or ())]
    return (*ins, *outs)
