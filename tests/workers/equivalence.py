"""Train a model for 3 steps single-device and under autopar; compare losses and gradients.

Run by tests/test_equivalence.py under torchrun:
    torchrun --nproc-per-node 4 tests/workers/equivalence.py --model gpt --dp 2 --tp 2
Prints one JSON line per rank: {"rank", "losses", "reference", "max_grad_err", "ok"}.
"""

from __future__ import annotations

import argparse
import copy
import json
import operator
import os
import re
import sys

import torch
import torch.distributed as dist

import autopar
from autopar.comm_ops import local_slice
from autopar.placements import Shard, parse_placement

STEPS = int(os.environ.get('AUTOPAR_TEST_STEPS', 3))


def build(name: str, layers: int = 2):
    torch.manual_seed(0)
    if name == "gpt":
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=layers, n_head=4, n_embd=32))
        idx = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
        tgt = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
        return model, ((idx, tgt), {})
    if name == "gptmath":  # explicit softmax attention (what selective recompute targets)
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                              attention="math"))
        idx = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
        tgt = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
        return model, ((idx, tgt), {})
    if name == "llama":
        from autopar.models.hf import build_llama

        model = build_llama(layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=96, seq=16)
        ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
        return model, ((), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    raise SystemExit(f"unknown model {name}")


def loss_of(out):
    return autopar.runtime.parallel_module.find_loss(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--cluster", default=None)
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--pp", type=int, default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--microbatches", type=int, default=None, help="pin microbatches per step")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--zero", default="0,3", help="ZeRO stages the solver may pick")
    ap.add_argument("--microbatch", type=int, default=None, help="pin sequences per microbatch")
    ap.add_argument("--recompute", default="none", help="recompute modes the solver may pick")
    args = ap.parse_args()

    model, (a, k) = build(args.model, args.layers)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_losses, ref_grads = [], {}
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss = loss_of(reference(*a, **k))
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        ref_opt.step()

    world = int(os.environ.get("WORLD_SIZE", 1))
    cluster = f"{world}xcpu"
    if args.cluster:  # a cluster file, resized to the launched world
        import yaml

        cluster = yaml.safe_load(open(args.cluster))
        cluster.update(nodes=1, devices_per_node=world)
    zero = tuple(int(z) for z in args.zero.split(","))
    pm = autopar.parallelize(model, cluster, (a, k), dp=args.dp, tp=args.tp, pp=args.pp,
                             zero=zero, microbatch=args.microbatch,
                             microbatches=args.microbatches, schedule=args.schedule,
                             recompute=tuple(args.recompute.split(",")))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    la, lk = pm.shard_batch(*a, **k)
    grads = {}
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pm.train_step(*la, **lk).item())
        grads = {n: _whole(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
        opt.step()

    # Compare this rank's gradient shards with the same slices of the reference gradients.
    coords = pm.mesh_context.coords
    max_err = 0.0
    checked = 0
    for name, g in grads.items():
        fqn = _strip(name)
        ref = ref_grads.get(fqn)
        if ref is None:
            ref = ref_grads.get(_tied_name(fqn, reference))
        if ref is None:
            continue
        for axis, text in _placements(pm, fqn).items():
            p = parse_placement(text)
            if isinstance(p, Shard) and pm.plan.mesh[axis] > 1:
                ref = local_slice(ref, p, pm.plan.mesh[axis], coords[axis])
        err = ((g - ref).abs() / (ref.abs() + 1e-6)).max().item() if g.shape == ref.shape else float("inf")
        close = torch.allclose(g, ref, rtol=args.rtol, atol=1e-6)
        if not close:
            max_err = max(max_err, err)
            if os.environ.get("AUTOPAR_TEST_VERBOSE"):
                print(f"grad mismatch {fqn}: {err:.3g} {g.flatten()[:4].tolist()} {ref.flatten()[:4].tolist()}", file=sys.stderr)
        checked += 1
    losses_ok = all(abs(x - y) <= args.rtol * abs(y) + 1e-7 for x, y in zip(losses, ref_losses))
    ok = losses_ok and max_err == 0.0 and checked > 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    record = {"rank": rank, "mesh": pm.plan.mesh, "zero": pm.plan.training["zero"],
              "microbatches": pm.plan.batch["microbatches"],
              "recompute": pm.plan.training["recompute"],
              "schedule": pm.plan.pipeline.get("schedule"), "losses": losses,
              "reference": ref_losses, "grads_checked": checked, "max_grad_err": max_err, "ok": ok,
              "sharded": sorted(f for f, ax in pm.plan.params.items() if ax.get("tp", "R") != "R")}
    print(json.dumps(record), flush=True)
    out_dir = os.environ.get("AUTOPAR_TEST_OUT")
    if out_dir:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(record, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """FSDP2 keeps gradients as DTensor shards over dp; compare whole (tp-local) tensors."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()


def _placements(pm, fqn: str) -> dict:
    """The plan's placements of a parameter, looking through tied names."""
    if fqn in pm.plan.params:
        return pm.plan.params[fqn]
    named = {_strip(n): p for n, p in pm.named_parameters(remove_duplicate=False)}
    target = named.get(fqn)
    for name, p in named.items():
        if p is target and name in pm.plan.params:
            return pm.plan.params[name]
    return {}


def _strip(name: str) -> str:
    """A parameter's model name from its name under the ParallelModule (DDP's ``module.``,
    pipeline stages' list index)."""
    return re.sub(r"^(wrapped|_program)\.(\d+\.)?(module\.)?", "", name)


def _tied_name(fqn: str, model) -> str | None:
    target = operator.attrgetter(fqn)(model) if fqn else None
    for n, p in model.named_parameters(remove_duplicate=False):
        if p is target:
            return n
    return None


if __name__ == "__main__":
    sys.exit(main())
