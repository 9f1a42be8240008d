"""The chunked cross-entropy on this machine: peak memory per rank with and without it,
predicted (modelled) and measured, on a GPT whose vocabulary dominates its memory.

Each case trains a GPT (2 layers x 128 hidden, fp32, AdamW) on one gloo process, measures
the peak of live tensor bytes torch's MemTracker saw over one step (measured), and prints
it beside the plan's predicted peak (modelled), once with ``chunked_loss`` (the default: one
log-sum-exp a token kept) and once with torch's cross-entropy (``--no-chunked-loss``: the
``[tokens, vocab]`` log-softmax kept, and its gradient made beside it). The modelled drop
should equal the measured one.

    python benchmarks/chunked_loss.py                       # vocab 32768, 2 x 512 tokens
    python benchmarks/chunked_loss.py --vocab 50304 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from context_parallel import cluster_file  # noqa: E402
from fidelity_measured import free_port  # noqa: E402


def run_case(args: argparse.Namespace, chunked: bool, cluster: Path, tmp: Path) -> dict:
    out = tmp / ("chunked" if chunked else "whole")
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={free_port()}", str(HERE / "workers" / "measure_step.py"),
           "--layers", "2", "--hidden", "128", "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--batch", str(args.batch), "--steps", "2",
           "--cluster", str(cluster), "--out", str(out)]
    if not chunked:
        cmd.append("--no-chunked-loss")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"case chunked={chunked} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "rank0.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    tokens = args.seq * args.batch
    buffer = tokens * args.vocab * 4
    print(f"GPT 2 layers x 128 hidden, vocab {args.vocab}, {args.batch} x {args.seq} tokens, "
          f"fp32, AdamW, 1 gloo process; one [tokens, vocab] fp32 buffer = "
          f"{buffer / 2**20:.1f} MiB\n")
    print(f"{'loss':>8} | {'peak MiB':>9} {'peak MiB':>9} {'error':>7}")
    print(f"{'':>8} | {'modelled':>9} {'measured':>9}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cluster = cluster_file(1, None, tmp)
        runs = {}
        for chunked in (False, True):
            r = run_case(args, chunked, cluster, tmp)
            runs[chunked] = r
            predicted, measured = r["predicted_peak_bytes"], r["measured_peak_bytes"]
            print(f"{'chunked' if chunked else 'torch':>8} | {predicted / 2**20:>9.1f} "
                  f"{measured / 2**20:>9.1f} {(predicted - measured) / measured:>+7.1%}",
                  flush=True)
    drop_model = runs[False]["predicted_peak_bytes"] - runs[True]["predicted_peak_bytes"]
    drop_meas = runs[False]["measured_peak_bytes"] - runs[True]["measured_peak_bytes"]
    for chunked, r in runs.items():
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["predicted_memory"].items()
                          if isinstance(v, (int, float)) and v)
        print(f"{'chunked' if chunked else 'torch'} modelled MiB: {parts}")
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["measured_by_kind"].items() if v)
        print(f"{'chunked' if chunked else 'torch'} measured MiB: {parts}")
    print(f"\npeak drop: modelled {drop_model / 2**20:.1f} MiB, measured "
          f"{drop_meas / 2**20:.1f} MiB ({drop_meas / buffer:.2f} x the buffer). In fp32 the "
          "chunked loss keeps the logits in place of an equal log-softmax, so it saves the "
          "log-softmax's gradient less one block; under bf16 autocast it also keeps 2-byte "
          "logits in place of the 4-byte log-softmax.")


if __name__ == "__main__":
    main()
