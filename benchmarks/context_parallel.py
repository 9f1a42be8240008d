"""Context parallelism on this machine: peak memory per rank and step time, predicted and
measured, for cp = 1, 2, 4 at growing sequence length.

Each case trains a GPT (4 layers x 256 hidden, fp32, AdamW) on gloo with ``cp`` processes,
one global batch of 2 sequences, every sequence split over the ranks (zigzag chunks), and
prints the plan's predicted peak memory and activations per rank (modelled) beside the peak
of live tensor bytes torch's MemTracker saw over one step and the median step time
(measured). Activation memory per rank should fall about 1/cp; the memory model should be
within 10% of measured.

    python benchmarks/context_parallel.py                    # the cpu preset
    python benchmarks/context_parallel.py --profile p.json   # a calibrated profile
    python benchmarks/context_parallel.py --seq 512 1024 --algorithm ring
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

from autopar.core.cluster import usable_cores

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fidelity_measured import free_port  # noqa: E402


def cluster_file(nproc: int, profile: Path | None, tmp: Path) -> Path:
    """``nproc`` gloo processes of this machine: the ``cpu`` preset, or a calibrated
    profile's device and links."""
    lines = [f"name: this-machine-{nproc}", "nodes: 1", f"devices_per_node: {nproc}",
             f"cores_per_node: {usable_cores()}", "device:", "  preset: cpu"]
    if profile is not None:
        lines.insert(4, f"profile: {profile}")
    path = tmp / f"cluster-{nproc}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_case(cp: int, seq: int, algorithm: str, cluster: Path, tmp: Path) -> list[dict]:
    out = tmp / f"cp{cp}-seq{seq}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cp}",
           f"--master-port={free_port()}", str(HERE / "workers" / "measure_step.py"),
           "--cp", str(cp), "--cp-algorithm", algorithm, "--seq", str(seq), "--batch", "2",
           "--steps", "3", "--cluster", str(cluster), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"case cp={cp} seq={seq} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", help="a profile from `autopar calibrate` (default: the cpu "
                    "preset)")
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--algorithm", default="all_gather", choices=("all_gather", "ring",
                                                                   "ulysses"))
    args = ap.parse_args()
    profile = Path(args.profile).resolve() if args.profile else None
    print(f"GPT 4 layers x 256 hidden, batch 2, fp32, AdamW, gloo; {args.algorithm} "
          "attention, zigzag\n")
    print(f"{'seq':>5} {'cp':>3} | {'peak MiB':>9} {'peak MiB':>9} {'error':>7} | "
          f"{'act MiB':>8} {'act/cp1':>7} | {'step ms':>8} {'step ms':>8}")
    print(f"{'':>5} {'':>3} | {'modelled':>9} {'measured':>9} {'':>7} | {'modelled':>8} "
          f"{'':>7} | {'modelled':>8} {'measured':>8}")
    errors = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for seq in args.seq:
            base_act = None
            for cp in args.cp:
                ranks = run_case(cp, seq, args.algorithm, cluster_file(cp, profile, tmp), tmp)
                measured = max(r["measured_peak_bytes"] for r in ranks)
                predicted = ranks[0]["predicted_peak_bytes"]
                act = ranks[0]["predicted_memory"]["activations"]
                base_act = act if cp == 1 else base_act
                err = (predicted - measured) / measured
                errors.append(abs(err))
                ratio = f"{act / base_act:>7.2f}" if base_act else f"{'-':>7}"
                print(f"{seq:>5} {cp:>3} | {predicted / 2**20:>9.1f} {measured / 2**20:>9.1f} "
                      f"{err:>+7.1%} | {act / 2**20:>8.1f} {ratio} | "
                      f"{ranks[0]['predicted_step_s'] * 1e3:>8.1f} "
                      f"{statistics.median(r['measured_step_s'] for r in ranks) * 1e3:>8.1f}",
                      flush=True)
    print(f"\npeak memory: worst error {max(errors):.1%} (target <= 10% in every case); "
          "modelled activations per rank vs cp=1 in the act/cp1 column (target ~1/cp); act "
          "is the peak's breakdown, 0 where the peak is the optimizer step (short sequences)")


if __name__ == "__main__":
    main()
