"""What two gloo processes on this machine's cores cost a training step, part by part.

The cost model prices one CPU process computing alone well, and two sharing a 2-core
machine 25-55% low (``benchmarks/results/cpu_steps_plan_time_2026-11-27e.md``). This times
the demo GPT's forward, backward and optimizer step (measured, medians, the slowest rank)
in alternating rounds of:

- ``alone``: one process;
- ``pair``: two processes each training its own replica (sharing the cores, no messages);
- ``ddp``: two processes under DDP (gloo, ``gradient_as_bucket_view``, autopar's buckets);
- ``ddp-one-bucket``: DDP with one bucket, all-reduced after backward (nothing overlaps);
- ``autopar``: ``autopar.parallelize`` pinned to dp=2 (forward and backward as one
  ``train_step``, shown as the backward): what autopar's runtime costs over DDP;

so that what sharing the cores costs (pair / alone) and what DDP's all-reduce costs during
a step (ddp - pair) are separated, and the machine's drift falls on every mode alike.

    python benchmarks/cpu_step_parts.py                  # 5 rounds, about 2 minutes
    python benchmarks/cpu_step_parts.py --rounds 9 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fidelity_measured import free_port  # noqa: E402

MODES = {"alone": (1, "none"), "pair": (2, "none"), "ddp": (2, "ddp"),
         "ddp-one-bucket": (2, "ddp-one-bucket"), "autopar": (2, "autopar"), "autopar-zero1": (2, "autopar-zero1"),
         "autopar-zero2": (2, "autopar-zero2"), "autopar-zero3": (2, "autopar-zero3")}


def run(mode: str, batch: int, steps: int, tmp: Path) -> dict:
    nproc, sync = MODES[mode]
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / "workers" / "step_parts_worker.py"),
           "--sync", sync, "--batch", str(batch), "--steps", str(steps), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent),
                                                        os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per process")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the modes to time (default: all)")
    args = parser.parse_args()
    modes = args.modes
    rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:  # each round starts one mode later
                rounds[mode].append(run(mode, args.batch, args.steps, Path(tmp)))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    keys = ("forward_s", "backward_s", "optimizer_s", "step_s")
    print(f"demo GPT, batch {args.batch} per process, {args.rounds} rounds on "
          f"{os.cpu_count()} cores (measured; medians over rounds, range in brackets, ms)")
    print(f"{'mode':<16}" + "".join(f"{k[:-2]:>24}" for k in keys))
    med = {}
    for mode, rows in rounds.items():
        med[mode] = {k: statistics.median(row[k] for row in rows) for k in keys}
        cells = "".join(f"{med[mode][k] * 1e3:>9.1f} [{min(r[k] for r in rows) * 1e3:5.1f}-"
                        f"{max(r[k] for r in rows) * 1e3:5.1f}]" for k in keys)
        print(f"{mode:<16}{cells}")
    ms = 1e3

    def shown(*names: str) -> bool:
        return all(name in med for name in names)

    if shown("pair", "alone"):
        print(f"\nsharing the cores: pair / alone = "
              f"{med['pair']['step_s'] / med['alone']['step_s']:.2f} (step), "
              f"{med['pair']['backward_s'] / med['alone']['backward_s']:.2f} (backward)")
    if shown("ddp", "ddp-one-bucket", "pair"):
        print(f"DDP's all-reduce in a step: ddp - pair = "
              f"{(med['ddp']['step_s'] - med['pair']['step_s']) * ms:.1f} ms; one bucket "
              f"after backward: "
              f"{(med['ddp-one-bucket']['step_s'] - med['pair']['step_s']) * ms:.1f} ms")
    if shown("autopar", "ddp"):
        print(f"autopar's runtime over DDP: autopar - ddp = "
              f"{(med['autopar']['step_s'] - med['ddp']['step_s']) * ms:.1f} ms a step")
    for stage in (1, 2, 3):
        if shown(f"autopar-zero{stage}", "autopar"):
            print(f"ZeRO-{stage} over ZeRO-0 in autopar: " + ", ".join(
                f"{k[:-2]} {(med[f'autopar-zero{stage}'][k] - med['autopar'][k]) * ms:+.1f} ms"
                for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1) + "\n")


if __name__ == "__main__":
    main()
