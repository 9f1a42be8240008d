"""Train a small nanoGPT on two CPU processes, parallelized by autopar.

    torchrun --nproc-per-node 2 examples/nanogpt.py
    torchrun --nproc-per-node 2 examples/nanogpt.py --pp 2 --schedule 1f1b --microbatches 4
    torchrun --nproc-per-node 2 --max-restarts 3 examples/nanogpt.py --ckpt runs/nanogpt

The model is an ordinary single-device GPT. ``autopar.parallelize`` traces it, solves a
placement plan for the cluster ("2xcpu": two CPU ranks talking over gloo), and returns this
rank's part of the model; the training loop below is the one you would write for one
device. The data is this file's own text, one byte per token, so the loss visibly falls.
Pass ``--dp 2``, ``--tp 2`` or ``--pp 2`` (with a ``--schedule`` and ``--microbatches``) to
pin a layout instead of letting the solver choose; the loop does not change.

Every ``--every`` steps it saves a checkpoint under ``--ckpt``, and it starts from the
newest complete one there: under ``torchrun --max-restarts N`` a job whose rank dies is
restarted and goes on from its last checkpoint, with the losses of an uninterrupted run
(the step number picks the batch). A checkpoint also loads under another layout or
another number of processes.
"""

import argparse
import os
import shutil
from pathlib import Path

import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig

BATCH = 16  # global batch, in sequences; each rank trains on its share
STEPS = 50


def get_batch(data: torch.Tensor, block_size: int, step: int):
    """Random windows of the text, drawn from the step number: every rank draws the same
    global batch, and a resumed run the batches it would have had."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - block_size - 1, (BATCH,), generator=gen)
    x = torch.stack([data[i : i + block_size] for i in starts])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in starts])
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    for degree in ("dp", "tp", "pp", "microbatches"):
        ap.add_argument(f"--{degree}", type=int, default=None)
    ap.add_argument("--schedule", default=None, help="gpipe, 1f1b, interleaved or zb_v")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (default: none)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    args = ap.parse_args()
    pinned = {k: v for k, v in vars(args).items()
              if v is not None and k not in ("ckpt", "every")}
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=128)
    model = GPT(config)
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)

    module = autopar.parallelize(model, "2xcpu", get_batch(data, config.block_size, 0), **pinned)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    rank = int(os.environ.get("RANK", "0"))
    step = 0
    latest = autopar.latest_checkpoint(args.ckpt) if args.ckpt else None
    if latest is not None:
        step = autopar.load_checkpoint(latest, module, optimizer)

    if rank == 0:
        print(f"plan: mesh {module.plan.mesh}, ZeRO-{module.plan.training['zero']}, "
              f"predicted step {module.plan.predicted['step_time_s'] * 1e3:.1f} ms (modelled)"
              + (f"; resumed from {latest} (step {step})" if latest else ""))
    while step < STEPS:
        inputs, kwargs = module.shard_batch(*get_batch(data, config.block_size, step))
        loss = module.train_step(*inputs, **kwargs)  # forward + backward over the microbatches
        module.clip_grad_norm_(1.0)  # by the whole model's gradient norm, as on one device
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}")
        if args.ckpt and step % args.every == 0:
            path = autopar.save_checkpoint(Path(args.ckpt) / f"step-{step:06d}", module,
                                           optimizer, step=step)
            if rank == 0:  # keep the two newest
                for old in sorted(Path(args.ckpt).glob("step-*"))[:-2]:
                    shutil.rmtree(old)
                print(f"saved {path}")


if __name__ == "__main__":
    main()
