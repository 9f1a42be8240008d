"""Expert parallelism: each rank of an ``ep`` group keeps ``experts / ep`` of every MoE
layer's experts, and tokens travel to them and back.

For every expert region (:func:`autopar.analysis.expert_sites.expert_regions`: the grouped matmuls of one
MoE layer, or its einsums over GShard's capacity slots, and the row-wise ops between them)
this pass

- keeps this rank's consecutive block of each stacked expert weight (dim 0);
- sends the region's sorted rows to the ranks owning their experts before it
  (:func:`autopar.ops.expert_ops.dispatch`: counts first, then the rows), and gives the grouped
  matmuls the rows and offsets of the local experts; dense slots go in one even all-to-all
  (:func:`autopar.ops.expert_ops.dispatch_slots`);
- brings the results back to the ranks and rows they came from after it
  (:func:`autopar.ops.expert_ops.combine`).

Everything outside the regions (attention, the router, the sort that groups tokens by
expert) runs on the rank's own tokens as under data parallelism, which ``ep`` is carved out
of: the expert weights' gradients are summed over the ranks holding the same experts by
the runtime (:mod:`autopar.runtime.experts`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from autopar.analysis.expert_sites import ExpertRegion, ExpertRegionError, expert_regions
from autopar.core.errors import PassError
from autopar.core.placements import Shard
from autopar.ops import expert_ops
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass
from autopar.passes.shard_parameters import _set

EP = "ep"
# node.meta key: the index of the expert region a grouped matmul (or einsum, or an expert
# module's linear) belongs to, for the passes after this one (outline-experts)
EXPERT_REGION = "autopar_expert_region"


@register_pass
class ExpertParallel(GraphPass):
    name = "expert-parallel"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        ep = ctx.plan.mesh.get(EP, 1)
        if ep == 1:
            return PassResult(gm, modified=False)
        try:
            regions = expert_regions(gm)
        except ExpertRegionError as e:
            raise PassError(f"cannot run experts in parallel: {e}",
                            where="the model's grouped matmuls",
                            fix="write the experts as grouped matmuls over stacked weights, "
                            "or plan with ep=1") from e
        if not regions:
            raise PassError("the plan has ep > 1 but the model has no expert region",
                            where="plan.mesh.ep", fix="plan with ep=1")
        rank = ctx.coords.get(EP, 0)
        changes: list[str] = []
        kept: set[str] = set()
        for index, region in enumerate(regions):
            for mm in region.matmuls:
                mm.meta[EXPERT_REGION] = index
            if region.experts % ep:
                raise PassError(f"ep={ep} does not divide the {region.experts} experts of "
                                f"{region.matmuls[0].name}",
                                where="plan.mesh.ep", fix="re-plan: ep must divide the experts")
            per = region.experts // ep
            if region.kind == "loop":
                owner = region.expert_dim // per
                _rewire_owner(gm, region, owner, mine=owner == rank,
                              features=_local_features(ctx, region.output))
                if owner == rank:
                    kept.update(region.weight_fqns)
                changes.append(f"{region.matmuls[0].name}: expert {region.expert_dim} "
                               f"{'here' if owner == rank else f'on ep rank {owner}'}, its rows "
                               "sent there and back")
                continue
            for fqn in region.weight_fqns:
                if fqn not in kept:
                    kept.add(fqn)
                    _keep_block(gm, fqn, rank, ep)
            _rewire(gm.graph, region)
            changes.append(f"{region.matmuls[0].name}: experts {rank * per}-"
                           f"{(rank + 1) * per - 1} of {region.experts} here, rows dispatched "
                           "and combined over ep")
        gm.meta["autopar_expert_params"] = sorted(kept)
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
        return PassResult(gm, modified=True, changes=changes)


def _keep_block(gm: fx.GraphModule, fqn: str, rank: int, ep: int) -> None:
    """This rank's consecutive experts of a stacked weight, as an ordinary parameter."""
    value = operator.attrgetter(fqn)(gm)
    per = value.shape[0] // ep
    local = value.detach()[rank * per:(rank + 1) * per].clone().contiguous()
    if isinstance(value, nn.Parameter):
        local = nn.Parameter(local, requires_grad=value.requires_grad)
    _set(gm, fqn, local)


def _rewire(graph: fx.Graph, region: ExpertRegion) -> None:
    if region.kind == "dense":
        _rewire_slots(graph, region)
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(region.matmuls, key=order.__getitem__)
    with graph.inserting_before(first):
        sent = graph.call_function(expert_ops.dispatch, (region.rows, region.offs, EP))
        rows = graph.call_function(operator.getitem, (sent, 0))
        offs = graph.call_function(operator.getitem, (sent, 1))
        route = graph.call_function(operator.getitem, (sent, 2))
    rows.meta["val"] = region.rows.meta.get("val")
    offs.meta["val"] = region.offs.meta.get("val")
    route.meta["val"] = torch.empty(0, dtype=torch.int64, device="meta")
    for mm in region.matmuls:
        args = list(mm.args)
        if args[0] is region.rows:
            args[0] = rows
        if len(args) > 2:
            args[2] = offs
        else:
            mm.kwargs = {**mm.kwargs, "offs": offs}
        mm.args = tuple(args)
    out = region.output
    outside = [u for u in out.users if u not in region.members]
    with graph.inserting_after(out):
        back = graph.call_function(expert_ops.combine, (out, route, EP))
    back.meta["val"] = out.meta.get("val")
    for user in outside:
        user.replace_input_with(out, back)


def _rewire_slots(graph: fx.Graph, region: ExpertRegion) -> None:
    """Dense capacity slots: one even all-to-all each way (experts <-> sequences)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(region.matmuls, key=order.__getitem__)
    with graph.inserting_before(first):
        sent = graph.call_function(expert_ops.dispatch_slots,
                                   (region.rows, region.expert_dim, EP))
    sent.meta["val"] = region.rows.meta.get("val")
    for mm in region.matmuls:
        equation, operands = mm.args[0], list(mm.args[1])
        mm.args = (equation, [sent if o is region.rows else o for o in operands],
                   *mm.args[2:])
    out = region.output
    outside = [u for u in out.users if u not in region.members]
    with graph.inserting_after(out):
        back = graph.call_function(expert_ops.combine_slots, (out, region.expert_dim, EP))
    back.meta["val"] = out.meta.get("val")
    for user in outside:
        user.replace_input_with(out, back)


def _local_features(ctx: PassContext, node: fx.Node) -> int:
    """The last dim of ``node``'s value on this rank (split when tp shards it)."""
    features = int(node.meta["val"].shape[-1])
    s = ctx.plan.strategy(node.name, "tp")
    last = node.meta["val"].ndim - 1
    if s is not None and isinstance(s.outputs[0], Shard) and s.outputs[0].dim == last:
        features //= ctx.plan.mesh.get("tp", 1)
    return features


def _rewire_owner(gm: fx.GraphModule, region: ExpertRegion, owner: int, mine: bool,
                  features: int) -> None:
    """An expert written as its own module: its rows go to the rank holding it and back.
    Elsewhere the expert's ops and weights are dropped; the rank sends its rows and takes
    back their results, joining the owner's all-to-alls in forward and backward."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(region.matmuls, key=order.__getitem__)
    with graph.inserting_before(first):
        sent = graph.call_function(expert_ops.to_owner, (region.rows, owner, EP))
        rows = graph.call_function(operator.getitem, (sent, 0))
        route = graph.call_function(operator.getitem, (sent, 1))
    rows.meta["val"] = region.rows.meta.get("val")
    route.meta["val"] = torch.empty(0, dtype=torch.int64, device="meta")
    out = region.output
    outside = [u for u in out.users if u not in region.members]
    if mine:
        for mm in region.matmuls:
            if mm.args[0] is region.rows:
                mm.args = (rows, *mm.args[1:])
        made = out
        with graph.inserting_after(out):
            back = graph.call_function(expert_ops.combine, (made, route, EP))
    else:
        with graph.inserting_before(first):
            made = graph.call_function(expert_ops.no_rows, (rows, int(features)))
            back = graph.call_function(expert_ops.combine, (made, route, EP))
        made.meta["val"] = out.meta.get("val")
    back.meta["val"] = out.meta.get("val")
    for user in outside:
        user.replace_input_with(out, back)
    if not mine:
        _drop(gm, region)


def _drop(gm: fx.GraphModule, region: ExpertRegion) -> None:
    """Erase an expert this rank does not hold: its ops, then its weights."""
    graph = gm.graph
    reads = []  # each weight's and bias's read, from the matmul up to its get_attr (casts,
    for mm in region.matmuls:  # collectives)
        for n in mm.args[1:3]:
            while isinstance(n, fx.Node):
                reads.append(n)
                n = n.args[0] if n.op == "call_function" and n.args else None
    doomed = set(region.members)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            for user in list(node.users):  # trace-time asserts on the expert's values
                if user not in doomed and not user.users:
                    graph.erase_node(user)
            graph.erase_node(node)
    for n in reads:
        if not n.users:
            graph.erase_node(n)
    for fqn in region.weight_fqns:
        owner_path, _, attr = fqn.rpartition(".")
        owner_module = gm.get_submodule(owner_path) if owner_path else gm
        if attr in owner_module._parameters:
            del owner_module._parameters[attr]
