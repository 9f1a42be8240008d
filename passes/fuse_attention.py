"""Replace each attention site the plan marks fused with one call of the generated kernel.

The plan lists the attention sites of the model (``plan.attention``, found by
:mod:`autopar.analysis.attention_sites` when planning) and which are fused. This pass finds
them again in the rank's graph — after tensor parallelism, so shapes are local (heads split
over tp) — and rewrites each into ``autopar.kernels.attention(q, k, v, causal=..., scale=...,
bias=..., dropout_p=..., softcap=...)`` (several bias terms summed first by
:func:`attention_bias`), which runs the generated Triton kernels on CUDA (or in Triton's
interpreter) and PyTorch SDPA elsewhere. The printed per-rank program shows these calls.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.analysis.attention_sites import (
    AttentionSite,
    find_attention_sites,
    kernel_compatible,
    placement_ranks,
)
from autopar.kernels import attention as fused_attention
from autopar.ops.context_ops import context_attention
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass

aten = torch.ops.aten


def attention_bias(q: torch.Tensor, terms: tuple, *tensors: torch.Tensor) -> torch.Tensor:
    """A site's bias terms summed into the kernel's one additive bias: ``terms`` holds
    (kind, factor, flat) per tensor (see :class:`BiasTerm`); masks become 0 / -inf."""
    total = None
    for (kind, factor, flat), t in zip(terms, tensors):
        if flat:
            t = t.reshape(q.shape[0], q.shape[1], *t.shape[1:])
        if kind != "add":
            hide = ~t if kind == "keep" else t
            t = torch.zeros(t.shape, dtype=q.dtype, device=q.device).masked_fill(
                hide, float("-inf"))
        elif factor != 1.0:
            t = t * factor
        total = t if total is None else total + t
    return total


def _bias(graph: fx.Graph, site: AttentionSite) -> fx.Node | None:
    if not site.terms or site.bias is not None:
        return site.bias
    terms = tuple((t.kind, t.factor, t.flat) for t in site.terms)
    return graph.call_function(attention_bias, (site.q, terms, *(t.node for t in site.terms)))


def _rewrite(gm: fx.GraphModule, site: AttentionSite, context: dict | None = None) -> None:
    """``context``: the plan's context parallelism (cp > 1), whose attention op replaces the
    kernel call (the site has at most one mask, no soft-cap or dropout: the planner refuses
    them)."""
    graph = gm.graph
    with graph.inserting_before(site.output):
        if context:
            kwargs = {"algorithm": context["algorithm"], "causal": site.causal,
                      "scale": site.scale, "zigzag": context["layout"] == "zigzag"}
            if site.terms:
                kwargs["bias"] = site.bias
            call = graph.call_function(context_attention, (site.q, site.k, site.v), kwargs)
        else:
            kwargs = {"causal": site.causal, "scale": site.scale, "bias": _bias(graph, site),
                      "dropout_p": site.dropout_p}
            if site.softcap:
                kwargs["softcap"] = site.softcap
            call = graph.call_function(fused_attention, (site.q, site.k, site.v), kwargs)
        # a flat site's output is (batch * heads, q_len, head_dim), as its matmul gave
        out = graph.call_function(aten.flatten.using_ints, (call, 0, 1)) if site.flat else call
    call.meta = dict(site.output.meta)
    out.meta = dict(site.output.meta)
    site.output.replace_all_uses_with(out)
    _erase_dead(graph, site.nodes)


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` and what only they used (HF's repeat_kv), once nothing reads them;
    export's metadata assertions on them go too."""
    pending = list(dict.fromkeys(nodes))
    erased: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in erased or node.graph is not graph or node.op != "call_function":
            continue
        for user in list(node.users):
            if user.target is aten._assert_tensor_metadata.default:
                graph.erase_node(user)
        if node.users:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(n for n in inputs if n.op == "call_function")


@register_pass
class FuseAttention(GraphPass):
    name = "fuse-attention"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        entries = {entry["node"]: entry for entry in ctx.plan.attention if entry.get("fused")}
        planned = set(entries)
        if not planned:
            return PassResult(gm, modified=False)
        changes = []
        found = set()
        for site in find_attention_sites(gm):
            if site.name not in planned:
                continue
            found.add(site.name)
            if entries[site.name].get("causal") and not site.causal and len(site.terms) == 1:
                # recognised causal on the traced graph (passes.causal_mask), where the
                # mask's subgraph is whole: the kernel's flag replaces the mask here too
                site.causal, site.terms = True, []
            if not site.fusable:
                changes.append(f"kept {site.name}: {site.reason}")
                continue
            split = [n.name for n in site.nodes if (s := ctx.plan.strategy(n.name, "tp"))
                     is not None and not kernel_compatible(s, placement_ranks(n))]
            if split:
                changes.append(f"kept {site.name}: the plan splits {', '.join(split)} other "
                               "than over batch or heads")
                continue
            context = ctx.plan.context if ctx.plan.mesh.get("cp", 1) > 1 else None
            _rewrite(gm, site, context)
            how = f", cp {context['algorithm']}" if context else ""
            changes.append(f"fused {site.name} ({site.describe()}{how})")
        changes += [f"kept {name}: not found in this rank's graph" for name in sorted(planned - found)]
        return PassResult(gm, modified=any(c.startswith("fused") for c in changes),
                          changes=changes)
