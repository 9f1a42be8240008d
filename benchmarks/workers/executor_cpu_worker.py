"""One process of benchmarks/executor_cpu.py (run under torchrun, gloo, 2 ranks).

For one row it builds autopar's program (``autopar.parallelize`` with the row's mesh pinned),
eager and compiled (``compile=True``), and the hand-written native equivalent (DDP, FSDP2 ``fully_shard`` per block,
``parallelize_module`` tensor parallelism), optionally ``torch.compile``d, from the same
weights, then times their training steps alternately (forward, backward, AdamW) and writes
the medians (rank 0) as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.runtime.parallel_module import find_loss


def build(model: str, layers: int, hidden: int, seq: int, batch: int):
    """(module, (args, kwargs) of one global batch) for ``model`` (gpt: autopar's nanoGPT,
    llama: Hugging Face's)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 2048
    idx = torch.randint(0, vocab, (batch, seq), generator=gen)
    torch.manual_seed(0)
    if model == "gpt":
        from autopar.models import GPT, GPTConfig

        net = GPT(GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=8,
                            n_embd=hidden))
        return net, ((idx, idx.roll(-1, 1)), {})
    from autopar.models.hf import build_llama

    net = build_llama(layers=layers, hidden=hidden, heads=8, kv_heads=4, ffn=hidden * 3,
                      vocab=vocab, seq=seq)
    return net, ((), {"input_ids": idx, "labels": idx.clone(), "use_cache": False})


def blocks(net: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (what FSDP2 shards and torch.compile compiles)."""
    for path in ("transformer.h", "model.layers"):
        try:
            return list(net.get_submodule(path))
        except AttributeError:
            continue
    raise SystemExit("no transformer blocks found")


def native(net: nn.Module, row: str, compiled: bool) -> nn.Module:
    """The native PyTorch program for ``row``: what a user would write by hand."""
    if compiled:
        for block in blocks(net):  # per block, as torchtitan compiles
            block.compile()
    if row == "dp":
        return nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
    if row == "zero3":
        from torch.distributed.fsdp import fully_shard

        for block in blocks(net):
            fully_shard(block)
        fully_shard(net)
        return net
    if row == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for block in blocks(net):
            parallelize_module(block, mesh, plan)
        return net
    raise SystemExit(f"unknown row {row!r}")


def local_batch(row: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """This rank's part of the global batch for the native program (dp rows split it)."""
    if row == "tp":
        return args, kwargs
    rank, world = dist.get_rank(), dist.get_world_size()

    def cut(v):
        return v.chunk(world, 0)[rank] if isinstance(v, torch.Tensor) else v
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", choices=("dp", "zero3", "tp"), required=True)
    ap.add_argument("--model", choices=("gpt", "llama"), required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    net, (a, k) = build(args.model, args.layers, args.hidden, args.seq, args.batch)
    mesh = {"dp": {"dp": 2, "tp": 1, "zero": 0}, "zero3": {"dp": 2, "tp": 1, "zero": 3},
            "tp": {"dp": 1, "tp": 2, "tp_splits_batch": False}}[args.row]
    programs = {}
    for name, compile in (("autopar", False), ("autopar compiled", True)):
        pm = autopar.parallelize(copy.deepcopy(net), "2xcpu", (a, k), pp=1, recompute="none",
                                 precision="fp32", microbatches=1, compile=compile, **mesh)
        programs[name] = (pm, *pm.shard_batch(*a, **k))
    la, lk = local_batch(args.row, a, k)
    programs["native eager"] = (native(copy.deepcopy(net), args.row, False), la, lk)
    programs["native compiled"] = (native(copy.deepcopy(net), args.row, True), la, lk)
    optimizers = {name: torch.optim.AdamW(p.parameters(), lr=1e-4)
                  for name, (p, _, _) in programs.items()}

    def step(name: str) -> float:
        program, sa, sk = programs[name]
        opt = optimizers[name]
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if name.startswith("autopar"):
            program.train_step(*sa, **sk)
        else:
            find_loss(program(*sa, **sk)).backward()
        opt.step()
        dist.barrier()
        return time.perf_counter() - start

    compile_s = {}
    for name in programs:  # warm-up (compilation happens here)
        start = time.perf_counter()
        for _ in range(args.warmup):
            step(name)
        compile_s[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(args.steps):  # alternated: a busy moment hits every program alike
        for name in programs:
            times[name].append(step(name))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"row": args.row, "model": args.model, "mesh": pm.plan.mesh,
                       "median_s": {n: statistics.median(t) for n, t in times.items()},
                       "warmup_s": compile_s, "steps": args.steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
