"""One process of tests/test_restart.py, under ``torchrun --max-restarts 1``.

Trains a GPT on dp=2 for 5 AdamW steps, the batch of each step drawn from its number, and
saves a checkpoint after every step; it starts from the newest complete checkpoint in
``--dir``. With ``--kill-rank R`` the first attempt's rank R kills itself (SIGKILL) as step 3
begins, so torchrun restarts the job. Writes ``{"attempt", "resumed_from", "losses":
{step: loss}}`` to ``$AUTOPAR_TEST_OUT/rank{r}-attempt{a}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.teardown import leave

STEPS = 5


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 96, (4, 16), generator=gen)
    return idx, torch.roll(idx, -1, 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--kill-rank", type=int, default=None)
    args = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32))
    pm = autopar.parallelize(model, "2xcpu", batch(0), dp=2, recompute=("none",))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    latest = autopar.latest_checkpoint(args.dir)
    step = autopar.load_checkpoint(latest, pm, opt) if latest else 0
    resumed_from = step
    rank = dist.get_rank()
    losses = {}
    while step < STEPS:
        if step == 2 and attempt == 0 and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank, as step 3 begins
        a, k = pm.shard_batch(*batch(step))
        opt.zero_grad()
        loss = pm.train_step(*a, **k).item()
        opt.step()
        step += 1
        losses[step] = loss
        autopar.save_checkpoint(Path(args.dir) / f"step-{step:06d}", pm, opt, step=step)
    out = Path(os.environ["AUTOPAR_TEST_OUT"], f"rank{rank}-attempt{attempt}.json")
    out.write_text(json.dumps({"attempt": attempt, "resumed_from": resumed_from,
                               "losses": losses}))
    return 0


if __name__ == "__main__":
    leave(main())
