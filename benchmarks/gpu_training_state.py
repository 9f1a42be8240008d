"""Training state on one device (a GPU where there is one): resume, export, LoRA.

1. A GPT trains 5 AdamW steps through ``autopar.parallelize``; a second run trains 3,
   saves a checkpoint, and a third loads it into a fresh module and trains 2 more: its
   losses against the uninterrupted run's (**measured**: largest relative difference).
2. ``autopar export`` of that checkpoint loaded into a plain GPT: its loss against the
   checkpointed module's.
3. LoRA (rank 8 on the attention and MLP input linears, everything else frozen): the
   plan's predicted step time and peak memory against measured
   (``torch.cuda.max_memory_allocated`` on CUDA), next to the full fine-tune's.

    python benchmarks/gpu_training_state.py                      # CUDA: 1xH100-80GB
    python benchmarks/gpu_training_state.py --cluster 1xcpu --layers 2 --hidden 128
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.models.lora import LoraConfig, apply_lora
from autopar.runtime.parallel_module import find_loss

CUDA = torch.cuda.is_available()


def build(args: argparse.Namespace, lora: bool = False) -> tuple[GPT, tuple]:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, vocab_size=50304, n_layer=args.layers,
                    n_head=args.hidden // 64, n_embd=args.hidden, bias=False)
    model = GPT(cfg)
    if lora:
        apply_lora(model, LoraConfig(rank=8, alpha=16, targets=("c_attn", "c_fc")))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    return model, (idx, torch.roll(idx, -1, 1))


def train(pm, opt, batch, steps: int) -> list[float]:
    a, k = pm.shard_batch(*batch)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses.append(pm.train_step(*a, **k).item())
        opt.step()
    return losses


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def resume_and_export(args: argparse.Namespace, tmp: Path) -> None:
    model, batch = build(args)
    pm = autopar.parallelize(model, args.cluster, batch)
    whole = train(pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), batch, 5)
    model, batch = build(args)
    pm = autopar.parallelize(model, args.cluster, batch)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    first = train(pm, opt, batch, 3)
    started = time.perf_counter()
    autopar.save_checkpoint(tmp / "ckpt", pm, opt, step=3)
    save_s = time.perf_counter() - started
    model, batch = build(args)
    fresh = autopar.parallelize(model, args.cluster, batch)
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    started = time.perf_counter()
    step = autopar.load_checkpoint(tmp / "ckpt", fresh, opt)
    load_s = time.perf_counter() - started
    rest = train(fresh, opt, batch, 2)
    resumed = first + rest
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, whole))
    print(f"resume (device {fresh.mesh_context.device}, precision "
          f"{fresh.plan.training['precision']}): loaded step {step}; losses "
          f"{[round(x, 5) for x in resumed]} vs uninterrupted {[round(x, 5) for x in whole]}; "
          f"largest relative difference {worst:.2e} (measured); save {save_s:.2f} s, "
          f"load {load_s:.2f} s", flush=True)
    from safetensors.torch import load_file

    from autopar.runtime.weights import export_checkpoint

    out = export_checkpoint(tmp / "ckpt", tmp / "model.safetensors")
    plain, batch = build(args)
    plain.load_state_dict(load_file(str(out)), strict=True)
    device = fresh.mesh_context.device
    plain.to(device)
    with torch.no_grad():
        exported = find_loss(plain(*(t.to(device) for t in batch))).item()
    print(f"export: {out.stat().st_size / 2**20:.0f} MiB; the plain model's fp32 loss "
          f"{exported:.5f} vs the resumed module's step-4 loss {rest[0]:.5f} "
          "(the module trains in the plan's precision)", flush=True)


def lora_memory(args: argparse.Namespace) -> None:
    print(f"\n{'run':<14} {'pred ms':>8} {'meas ms':>8} {'ratio':>6} | {'pred GiB':>8} "
          f"{'meas GiB':>8} {'ratio':>6} | trainable", flush=True)
    for name, lora in (("full", False), ("LoRA r8", True)):
        model, batch = build(args, lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        pm = autopar.parallelize(model, args.cluster, batch)
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
        train(pm, opt, batch, 3)
        sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            train(pm, opt, batch, 1)
            sync()
            times.append(time.perf_counter() - started)
        measured = torch.cuda.max_memory_allocated() if CUDA else float("nan")
        p = pm.plan.predicted
        step = statistics.median(times)
        gib = 2**30
        print(f"{name:<14} {p['step_time_s'] * 1e3:>8.1f} {step * 1e3:>8.1f} "
              f"{step / p['step_time_s']:>6.2f} | {p['peak_memory_bytes'] / gib:>8.2f} "
              f"{measured / gib:>8.2f} {measured / p['peak_memory_bytes']:>6.2f} | "
              f"{trainable / 1e6:.2f}M", flush=True)
        del pm, opt, model
        if CUDA:
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="1xH100-80GB" if CUDA else "1xcpu")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name() if CUDA else 'CPU'}, torch {torch.__version__}; GPT "
          f"{args.layers} x {args.hidden}, batch {args.batch} x {args.seq}\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        resume_and_export(args, Path(tmp))
    lora_memory(args)


if __name__ == "__main__":
    main()
