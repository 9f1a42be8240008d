"""``autopar demo``: plan a small GPT for 2 local CPU processes, train it on gloo, and
print the single-device and parallel losses side by side."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

from autopar.cli.demo_data import BATCH, SEQ, demo_batches, demo_model
from autopar.cli.summary import format_plan
from autopar.errors import AutoparError
from autopar.plan import Plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_device_losses(steps: int) -> tuple[list[float], float]:
    model = demo_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    started = time.perf_counter()
    for x, y in demo_batches(steps):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - started


def run_demo(args: argparse.Namespace) -> int:
    print(f"autopar demo: a {sum(p.numel() for p in demo_model().parameters()) / 1e6:.2f}M-"
          f"parameter GPT, batch {BATCH} x {SEQ} bytes, {args.steps} AdamW steps\n")
    reference, ref_s = single_device_losses(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={_free_port()}", "-m", "autopar.cli.demo_worker",
               "--steps", str(args.steps), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            raise AutoparError(
                f"the {args.nproc} demo processes failed (exit {proc.returncode})",
                where="autopar.cli.demo_worker",
                fix="see the output below\n" + proc.stderr[-4000:],
            )
        with open(out) as f:
            result = json.load(f)
    plan = Plan.from_dict(result["plan"])
    print(format_plan(plan, "demo GPT"))
    print(f"\nlosses (measured): single device vs {args.nproc} gloo processes")
    print(f"  {'step':>4}  {'single':>10}  {'parallel':>10}  {'|diff|':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(reference, result["losses"]), 1):
        worst = max(worst, abs(a - b))
        print(f"  {i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    print(f"\nlargest difference {worst:.2e}; single-device {ref_s:.2f} s, parallel steps "
          f"{sum(result['step_s']):.2f} s (measured, this machine)")
    return 0 if worst < 1e-4 else 1
