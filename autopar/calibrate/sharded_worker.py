"""One rank of FSDP2's host-work benchmark; ``autopar calibrate`` launches it with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        autopar/calibrate/sharded_worker.py --out sharded.json

Every rank trains the same small transformer (``--blocks`` encoder layers and a head) three
ways, in rounds that each start one way later, so the machine's drift falls on all three:

- ``plain``: its own replica, unsharded, no messages (forward + backward, then AdamW);
- ``sharded``: FSDP2 as ZeRO-1/2 run it (each layer and the root ``fully_shard``-ed with
  ``reshard_after_forward=False``: a gather per unit per step, a reduce-scatter per unit),
  and AdamW over the DTensor shards;
- ``bare``: FSDP2's data movement alone, on plain tensors of the same sizes: per unit the
  all-gather and its copy-out into per-parameter buffers, then the gradients' copy-in and
  the reduce-scatter; and AdamW over plain tensors shaped as this rank's shards.

So ``sharded - plain - bare`` is the host work FSDP2 adds per step beyond its collectives
and copies (hooks, DTensor wrapping, parameter swaps), and the optimizer's ``sharded -
bare`` what stepping DTensors costs over plain tensors. It is run as a script, not imported,
and uses only torch and the standard library. Rank 0 writes the slowest rank's medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from autopar.runtime.teardown import leave


def _model(blocks: int, hidden: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(hidden, max(1, hidden // 64), 4 * hidden, dropout=0.0,
                                       batch_first=True, norm_first=True)
    return nn.Sequential(*(copy.deepcopy(layer) for _ in range(blocks)), nn.Linear(hidden, 256))


def _units(model: nn.Sequential) -> list[list[nn.Parameter]]:
    """The parameters of each FSDP unit: every layer, then the root's own (the head)."""
    return [list(m.parameters()) for m in model[:-1]] + [list(model[-1].parameters())]


class _Bare:
    """FSDP2's per-step data movement on plain tensors (see the module docstring)."""

    def __init__(self, units: list[list[nn.Parameter]], world: int) -> None:
        self.world = world
        self.units = []
        for params in units:
            shards = [math.ceil(p.numel() / world) for p in params]
            self.units.append({
                "shard": torch.randn(sum(shards)),
                "gathered": torch.empty(world * sum(shards)),
                "buffers": [torch.empty(world, s) for s in shards],
                "grads": [torch.randn(world, s) for s in shards],
                "sizes": shards,
            })
        self.params = [nn.Parameter(torch.randn(s)) for u in self.units for s in u["sizes"]]
        for p in self.params:
            p.grad = torch.randn_like(p)

    def step(self) -> None:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        for u in self.units:  # forward: gather, copy out
            gather(u["gathered"], u["shard"])
            torch.split_with_sizes_copy(u["gathered"].view(self.world, -1), u["sizes"], dim=1,
                                        out=u["buffers"])
        for u in reversed(self.units):  # backward: copy in, reduce-scatter
            full = torch.cat(u["grads"], dim=1)
            scatter(u["shard"], full.view(-1))


def _median_s(step, optimizer_step, steps: int) -> tuple[float, float]:
    """Median seconds of ``step`` and of the ``optimizer_step`` after it."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        middle = time.perf_counter()
        optimizer_step()
        times.append((middle - start, time.perf_counter() - middle))
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    try:
        torch.manual_seed(0)
        plain = _model(args.blocks, args.hidden)
        sharded = copy.deepcopy(plain)
        bare = _Bare(_units(plain), world)
        for layer in sharded[:-1]:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(sharded, reshard_after_forward=False)
        optimizers = {"plain": torch.optim.AdamW(plain.parameters(), lr=1e-4),
                      "sharded": torch.optim.AdamW(sharded.parameters(), lr=1e-4),
                      "bare": torch.optim.AdamW(bare.params, lr=1e-4)}
        x = torch.randn(4, 64, args.hidden)
        y = torch.randint(0, 256, (4, 64))

        def forward_backward(model: nn.Module) -> None:
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

        def optimizer_step(name: str) -> None:
            optimizers[name].step()
            if name != "bare":  # the bare gradients stay: they stand for the next step's
                optimizers[name].zero_grad()

        passes = {"plain": lambda: forward_backward(plain),
                  "sharded": lambda: forward_backward(sharded), "bare": bare.step}
        names = list(passes)
        for name in names:  # warm up: the first steps allocate
            passes[name]()
            optimizer_step(name)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                samples[name].append(_median_s(passes[name], lambda n=name: optimizer_step(n),
                                               args.steps))
        medians = torch.tensor([statistics.median(s[i] for s in samples[name])
                                for name in names for i in (0, 1)], dtype=torch.float64)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
        if dist.get_rank() == 0:
            values = medians.tolist()
            out = {"world_size": world, "blocks": args.blocks, "hidden": args.hidden,
                   "rounds": args.rounds, "steps": args.steps,
                   "tensors": sum(1 for _ in plain.parameters()),
                   "units": len(_units(plain))}
            for k, name in enumerate(names):
                out[f"{name}_s"] = values[2 * k]
                out[f"{name}_optimizer_s"] = values[2 * k + 1]
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f)
        dist.barrier()  # every rank past its last collective, rank 0's file written
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()  # not through the interpreter's teardown (autopar.runtime.teardown)


if __name__ == "__main__":
    main()
