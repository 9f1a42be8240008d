"""Debugging aid: run the single-device graph and this rank's program side by side and
report the first nodes whose reassembled global value differs.

    torchrun --nproc-per-node 4 tests/workers/compare_nodes.py --model llama --dp 2 --tp 2 \
        --cluster tests/clusters/cpu-fast-links.yaml
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.fx as fx
import yaml

import autopar
from autopar.core.placements import Partial, Replicate, Shard, parse_placement
from autopar.ops import comm_ops
from autopar.runtime.teardown import leave
from tests.workers.equivalence import build


class Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.retain_grad()
        self.values[n.name] = out
        return out


def grad_whole(g: torch.Tensor, p, axis: str) -> torch.Tensor:
    """Reassemble a gradient held under autopar's convention for placement p on axis."""
    group = comm_ops._GROUPS.get(axis)
    if group is None:
        return g
    n = dist.get_world_size(group)
    if axis == "dp":  # each rank holds the gradient of its own loss term
        if isinstance(p, Shard):
            return comm_ops._gather(g, p, group, n) / n
        out = g.clone()
        dist.all_reduce(out, group=group)
        return out / n
    if isinstance(p, Shard):
        return comm_ops._gather(g, p, group, n)
    if isinstance(p, Partial) and p.reduce == "avg":
        return g * n
    return g


def assemble(x: torch.Tensor, p, axis: str) -> torch.Tensor:
    group = comm_ops._GROUPS.get(axis)
    if group is None or isinstance(p, Replicate):
        return x
    n = dist.get_world_size(group)
    if isinstance(p, Partial):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / n if p.reduce == "avg" else out
    return comm_ops._gather(x, p, group, n)


def scalar_loss(gm: fx.GraphModule, rec: Recorder) -> torch.Tensor:
    """The first scalar tensor among the graph's outputs (the loss, wherever the model's
    output structure puts it)."""
    found: list[fx.Node] = []
    output = next(n for n in gm.graph.nodes if n.op == "output")
    fx.node.map_arg(output.args, found.append)
    for node in found:
        value = rec.values.get(node.name)
        if isinstance(value, torch.Tensor) and value.ndim == 0 and value.requires_grad:
            return value
    raise RuntimeError("no scalar loss among the graph's outputs")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--cluster")
    ap.add_argument("--dp", type=int)
    ap.add_argument("--tp", type=int)
    ap.add_argument("--layout-seed", type=int,
                    help="plan a random layout, as tests/workers/hf_matrix.py's tp2_random")
    args = ap.parse_args()
    if args.layout_seed is not None:
        import zlib

        from autopar.solver.model import cpsat

        cpsat.LAYOUT_NOISE_SEED = args.layout_seed + zlib.crc32(args.model[4:].encode())
    if args.model.startswith("zoo:"):
        from tests.hf_zoo import build as build_zoo

        model, (a, k) = build_zoo(args.model[4:])
    else:
        model, (a, k) = build(args.model)
    ref_gm = autopar.trace(copy.deepcopy(model), (a, k))
    world = int(os.environ["WORLD_SIZE"])
    cluster = yaml.safe_load(open(args.cluster))
    cluster.update(nodes=1, devices_per_node=world)
    pm = autopar.parallelize(model, cluster, (a, k), dp=args.dp, tp=args.tp, recompute=("none",))
    rec_ref = Recorder(ref_gm)
    rec_ref.run(*torch.utils._pytree.tree_leaves((a, k)))
    la, lk = pm.shard_batch(*a, **k)
    rec = Recorder(pm._program)
    rec.run(*torch.utils._pytree.tree_leaves((la, lk)))
    rank = dist.get_rank()
    scalar_loss(ref_gm, rec_ref).backward()
    scalar_loss(pm._program, rec).backward()
    bad = 0
    for node in ref_gm.graph.nodes:
        name = node.name
        if name not in rec.values or name not in pm.plan.strategies:
            continue
        local, ref = rec.values[name], rec_ref.values[name]
        if not isinstance(local, torch.Tensor) or local.grad is None or ref.grad is None:
            continue
        g = local.grad
        for axis in ("tp", "dp"):
            g = grad_whole(g, parse_placement(pm.plan.strategies[name][axis]["out"][0]), axis)
        ok = g.shape == ref.grad.shape and torch.allclose(g.double(), ref.grad.double(), rtol=1e-4, atol=1e-6)
        if not ok and rank == 0:
            bad += 1
            print("GRAD MISMATCH", name, node.target, pm.plan.strategies[name], flush=True)
    bad = 0
    for node in ref_gm.graph.nodes:
        name = node.name
        if name not in rec.values or name not in pm.plan.strategies:
            continue
        local = rec.values[name]
        if not isinstance(local, torch.Tensor):
            continue
        local = local.detach()
        if not isinstance(local, torch.Tensor):
            continue
        g = local
        for axis in ("tp", "dp"):
            out = pm.plan.strategies[name][axis]["out"][0]
            g = assemble(g, parse_placement(out), axis)
        ref = rec_ref.values[name]
        ok = g.shape == ref.shape and torch.allclose(g.double(), ref.double(), rtol=1e-4, atol=1e-5)
        if not ok and rank == 0 and bad < 5:
            bad += 1
            print("MISMATCH", name, node.target, pm.plan.strategies[name], tuple(g.shape), tuple(ref.shape), flush=True)


if __name__ == "__main__":
    main()
    leave()
