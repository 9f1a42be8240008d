"""autopar's program vs the hand-written native PyTorch program, **measured** on this CPU.

Two processes on gloo (one thread each), the same model and global batch, fp32, no
recomputation. Per row, autopar's program (``autopar.parallelize`` with the mesh pinned),
eager and compiled (``compile=True``), against what a user writes by hand: DDP (dp, ZeRO-0), FSDP2 ``fully_shard`` per block
(ZeRO-3), ``parallelize_module`` with column/row-wise linears (tp, Hugging Face Llama),
each eager and ``torch.compile``d per block (as torchtitan compiles). Steps alternate
between the programs (a busy moment hits them alike); medians of ``--steps`` after
``--warmup`` (which includes compilation). ``x native`` = autopar's eager step / the
native eager one; ``x compiled`` = autopar compiled / native compiled (1.00: as fast; the
issue's bar is <= 1.05 there); ``own gain`` = autopar eager / autopar compiled.

    python benchmarks/executor_cpu.py                # every row, ~5 minutes
    python benchmarks/executor_cpu.py --rows dp-gpt  # one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from fidelity_measured import free_port  # noqa: E402

WORKER = ROOT / "benchmarks" / "workers" / "executor_cpu_worker.py"
ROWS = {  # name: (worker row, model, label)
    "dp-gpt": ("dp", "gpt", "GPT, dp2 (DDP)"),
    "dp-llama": ("dp", "llama", "HF Llama, dp2 (DDP)"),
    "zero3-gpt": ("zero3", "gpt", "GPT, dp2 ZeRO-3 (FSDP2)"),
    "tp-llama": ("tp", "llama", "HF Llama, tp2 (parallelize_module)"),
}


def run_row(name: str, extra: list[str]) -> dict:
    row, model, _ = ROWS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               f"--master-port={free_port()}", str(WORKER), "--row", row, "--model", model,
               "--out", str(out), *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    extra = [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "layers", "hidden",
                                                   "seq", "batch")]
    print("executor on CPU (measured, gloo, 2 ranks x 1 thread, fp32): medians of "
          f"{args.steps} alternated steps after {args.warmup} warm-up\n")
    print(f"{'row':36} {'autopar s':>10} {'compiled':>9} {'native s':>9} {'compiled':>9} "
          f"{'x native':>9} {'x compiled':>11} {'own gain':>9}")
    worst = 0.0
    for name in args.rows:
        r = run_row(name, extra)
        t = r["median_s"]
        eager = t["autopar"] / t["native eager"]  # eager against eager
        compiled = t["autopar compiled"] / t["native compiled"]  # compiled against compiled
        worst = max(worst, compiled)
        print(f"{ROWS[name][2]:36} {t['autopar']:10.4f} {t['autopar compiled']:9.4f} "
              f"{t['native eager']:9.4f} {t['native compiled']:9.4f} {eager:9.2f} "
              f"{compiled:11.2f} {t['autopar'] / t['autopar compiled']:9.2f}")
    print(f"\nworst: autopar compiled {worst:.2f}x the compiled native program (bar: 1.05x); "
          "own gain: autopar eager / autopar compiled (compile=True).")


if __name__ == "__main__":
    main()
