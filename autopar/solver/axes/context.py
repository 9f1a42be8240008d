"""Context parallelism in the search: which meshes may split the sequence, what the
sequence marking scales, and which attention algorithm a setting runs (chosen by cost).

The sequence is marked like the batch (:mod:`autopar.analysis.batch_axis`): every token
input is split along dim 1 and the split is carried through the graph; a value that follows
it shrinks ``cp`` times on a rank. Attention is the one place tokens meet, so each attention
site is priced with :func:`autopar.cost_models.context_parallel.attention_comm` for the
algorithm the setting runs, and the algorithm is the cheapest the user allows, held to
validated ground (:func:`held_to_ground`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.analysis.attention_sites import arg, find_attention_sites, shape_of
from autopar.analysis.batch_axis import propagate_input_dim
from autopar.core.knobs import CP_ALGORITHMS
from autopar.core.placements import Partial, Replicate, Shard
from autopar.core.values import tensor_inputs
from autopar.cost_models.comm import axis_link, busy_latency
from autopar.cost_models.context_parallel import (
    AttentionComm,
    AttentionShape,
    attention_comm,
    unsupported,
)
from autopar.strategies import Strategy

CP_LONG_CONTEXT = 32768
"""Sequences from this length on are searched with cp > 1 beside cp = 1; shorter ones only
when no plan fits without it (a search-space bound: published recipes below it, Llama 3's
8,192-token stage and torchtitan's 8k runs, use no cp, and the cp meshes triple the solves;
a pinned cp is always planned)."""

CP_SEARCH_MIN_TOKENS = 1024
"""The solver tries ``cp`` > 1 on its own only while every rank keeps at least this many
tokens of a sequence (a search-space bound, not a result: shorter shards give attention
blocks too small to hide a K/V transfer behind, and a pinned ``cp`` is always planned)."""


@dataclass(frozen=True)
class ContextSite:
    """One attention site as context parallelism sees it (whole-sequence shapes)."""

    decision: int  # the decision whose node yields the site's output
    nodes: frozenset[str]  # every node the site's kernel replaces
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool
    masked: bool = False  # a mask or bias term (padding): all_gather only


def context_sites(problem) -> list[ContextSite]:
    """The problem's fusable attention sites with (batch, heads, seq, head_dim) tensors,
    one per decision (the layers a decision folds share it; computed once per problem)."""
    if "context_sites" not in problem.cache:
        out: dict[int, ContextSite] = {}
        for site in find_attention_sites(problem.gm):
            q, k = shape_of(site.q), shape_of(site.k)
            index = problem.decision_of.get(site.output.name)
            if not site.fusable or index is None or not q or not k:
                continue
            names = frozenset(n.name for n in site.nodes)
            if index in out:  # the same site in another layer: its nodes too
                names |= out[index].nodes
            out[index] = ContextSite(index, names, q[0], q[1], k[1], q[2], q[3], site.causal,
                                     bool(site.terms))
        problem.cache["context_sites"] = list(out.values())
    return problem.cache["context_sites"]


def cp_refusal(gm: fx.GraphModule, cp: int, layout: str, seq_len: int | None,
               fused: bool = True) -> str:
    """Why the sequence of ``gm`` cannot be split over ``cp`` ranks ("" when it can);
    ``fused``: attention runs as the fused kernels (context attention replaces them)."""
    if cp <= 1:
        return ""
    if not fused:
        return ("attention fusion is off (--no-fuse-attention), but under cp attention runs "
                "as the fused kernels passing keys and values between ranks")
    if not seq_len or seq_len <= 1:
        return "the model's inputs have no sequence dimension (dim 1 of the token inputs)"
    chunks = 2 * cp if layout == "zigzag" else cp
    if seq_len % chunks:
        how = f"2·cp = {chunks} zigzag chunks" if layout == "zigzag" else f"cp = {cp}"
        return f"the sequence of {seq_len} tokens does not split into {how}"
    sites = find_attention_sites(gm)
    if not sites:
        return "no attention was recognised in the model, so nothing would let its tokens meet"
    for site in sites:
        if not site.fusable:
            return (f"attention {site.name} cannot run as the fused kernel ({site.reason}); "
                    "under cp every attention must")
        if site.pattern != "sdpa":
            return (f"attention {site.name} is an eager chain ({site.describe()}); under cp "
                    "the context attention op replaces SDPA calls only")
        if site.dropout_p or site.softcap or (site.terms and (site.bias is None or site.causal)):
            return (f"attention {site.name} has {site.describe()}: under cp the kernels take "
                    "a causal flag or one mask, not a soft-cap, dropout or a mask with a "
                    "causal flag")
        if site.terms and not _rows_of_sequence(site.bias, seq_len):
            return (f"attention {site.name}'s mask {site.bias.name} is not over (queries, keys) "
                    f"of the {seq_len}-token sequence")
        q, k = shape_of(site.q), shape_of(site.k)
        if q[2] != seq_len or k[2] != seq_len:
            return (f"attention {site.name} attends {q[2]} queries to {k[2]} keys, not the "
                    f"{seq_len}-token sequence (cross-attention is not split over cp)")
    return ""


def _rows_of_sequence(mask: fx.Node, seq_len: int) -> bool:
    """Is ``mask`` (batch, heads, queries, keys) with the whole sequence's keys, and its
    queries the sequence's or broadcast?"""
    shape = shape_of(mask)
    return bool(shape) and len(shape) == 4 and shape[3] == seq_len and shape[2] in (1, seq_len)


def sequence_scaled(problem, seq_len: int) -> frozenset[tuple[int, int]]:
    """Values (decision, output) that follow the sequence split (computed once)."""
    if "sequence_scaled" not in problem.cache:
        marking = propagate_input_dim(problem.gm, seq_len, seq_len, dim=1, follow_only=True,
                                      overrides=attention_overrides(problem.gm))
        keys = set()
        for d in problem.decisions:
            s = marking.get(d.name)
            if s is None:
                continue
            keys.update((d.index, i) for i, p in enumerate(s.outputs)
                        if isinstance(p, (Shard, Partial)))
        problem.cache["sequence_scaled"] = frozenset(keys)
    return problem.cache["sequence_scaled"]


def cp_strategies(gm: fx.GraphModule, cp: int, seq_len: int) -> dict:
    """Node name -> strategy on the ``cp`` axis: the token inputs split along the sequence,
    carried through the graph as far as rules allow (what the runtime executes). An SDPA
    site reads its queries, keys and values split (its context attention op passes the
    keys and values between ranks), so no collective is inserted before it."""
    return propagate_input_dim(gm, cp, seq_len, dim=1, follow_only=True,
                               overrides=attention_overrides(gm))


def attention_overrides(gm: fx.GraphModule) -> dict[str, Strategy]:
    """Each fusable SDPA site on the cp axis: q, k, v and the output split along the
    sequence (dim 2 of (batch, heads, seq, head_dim)); a mask read as this rank's rows of
    queries (dim 2), every key whole (or whole, when its rows broadcast)."""
    out = {}
    for site in find_attention_sites(gm):
        if site.pattern != "sdpa" or not site.fusable:
            continue
        node = site.output
        split = Shard(2)
        rest = [Replicate()] * (len(tensor_inputs(node)) - 3)
        mask = arg(node, 3, "attn_mask")
        if isinstance(mask, fx.Node) and rest and (shape_of(mask) or (0, 0, 1))[2] > 1:
            rest[0] = split
        out[node.name] = Strategy((split, split, split, *rest), (split,))
    return out


def site_shape(site: ContextSite, tables) -> AttentionShape:
    """The site on one rank of ``tables``' setting: the microbatch, heads split over tp
    (when tp divides them; attention under tp splits heads), the compute precision."""
    setting = tables.setting
    tp = setting.tp

    def split(heads: int) -> int:
        return heads // tp if heads % tp == 0 else heads

    batch = max(site.batch * setting.microbatch // max(tables.traced_batch, 1), 1)
    return AttentionShape(batch, split(site.heads), split(site.kv_heads), site.seq,
                          site.head_dim, tables.element_bytes)


def site_comm(tables, site: ContextSite, algorithm: str, compute_fwd_s: float,
              compute_bwd_s: float) -> AttentionComm:
    """Modelled exposed time and buffers of ``algorithm`` at one site of ``tables``."""
    setting, cluster = tables.setting, tables.cluster
    return attention_comm(
        algorithm, site_shape(site, tables), setting.cp, axis_link(cluster, setting.mesh, "cp"),
        compute_fwd_s=compute_fwd_s, compute_bwd_s=compute_bwd_s,
        overlap=cluster.backend != "gloo", busy_s=busy_latency(cluster, setting.mesh, "cp"),
        backend=cluster.backend, device=cluster.device)


def algorithm_costs(tables, allowed: tuple[str, ...] = CP_ALGORITHMS) -> dict[str, float | str]:
    """Per algorithm: modelled seconds it adds per microbatch over every site, or why it
    cannot run. ``tables`` must price attention without communication (its setting's
    algorithm "auto")."""
    out: dict[str, float | str] = {}
    sites = context_sites(tables.problem)
    for algorithm in allowed:
        total = 0.0
        for site in sites:
            why = unsupported(algorithm, site_shape(site, tables), tables.setting.cp,
                              site.masked)
            if why:
                total = None
                out[algorithm] = why
                break
            d = tables.problem.decisions[site.decision]
            f, b, _ = tables.times(d, d.candidates[0]) if d.candidates else (0.0, 0.0, 0.0)
            total += site_comm(tables, site, algorithm, f, b).total_s * d.count
        if total is not None:
            out[algorithm] = total
    return out


def cheapest(costs: dict[str, float | str]) -> str | None:
    """The algorithm with the least modelled time (ties: the order of CP_ALGORITHMS)."""
    return held_to_ground(costs, 0.0, {})


def held_to_ground(costs: dict[str, float | str], base_s: float,
                   margins: dict[str, float]) -> str | None:
    """The algorithm a search runs: the least ``(base_s + its seconds) x (1 + its ground
    margin)``, as the search ranks whole layouts (``layout_trials.ground_margin``), so an
    algorithm the cost model was never checked on must win by the model's error there
    (ties: the order of CP_ALGORITHMS). ``base_s``: the rest of the microbatch's time.

    >>> held_to_ground({"ring": 2.0, "ulysses": 1.0}, 10.0, {"ring": 0.0, "ulysses": 0.25})
    'ring'
    >>> held_to_ground({"ring": 9.0, "ulysses": 1.0}, 10.0, {"ring": 0.0, "ulysses": 0.25})
    'ulysses'
    """
    timed = [((base_s + v) * (1 + margins.get(a, 0.0)), CP_ALGORITHMS.index(a), a)
             for a, v in costs.items() if not isinstance(v, str)]
    return min(timed)[2] if timed else None
