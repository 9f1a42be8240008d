"""Predicted vs measured on this machine: peak memory per rank and step time.

Runs real training steps of a GPT on gloo with 1, 2 and 4 processes — data, tensor and
data x tensor parallelism, each with and without recomputation, plus bf16 mixed precision
and recomputation per layer (one mode per layer) — and prints, per case, the
plan's predicted peak memory (modelled) next to the peak of live tensor bytes that torch's
MemTracker saw over a whole step (measured), and the predicted step time with a calibrated
``cpu`` profile next to the median measured step time.

    python benchmarks/fidelity_measured.py                  # calibrates first (~1 min)
    python benchmarks/fidelity_measured.py --profile p.json # reuse a profile
    python benchmarks/fidelity_measured.py --state-only     # ZeRO-1/2 and LoRA rows alone
    python benchmarks/fidelity_measured.py --ground-only --rounds 3 --fp32-only --write-ground

``--rounds N`` runs every case N times, each round starting one case later (this VM's speed
drifts by 10-30% between minutes), and compares the medians: one slow launch then moves no
row. ``--ground-only`` runs the rows that ``--write-ground`` records (several processes,
fp32, no LoRA).

Targets: peak memory within 10% in every case; step time median error <= 25%.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.core.cluster import usable_cores

HERE = Path(__file__).resolve().parent
CASES = [  # (processes, dp, tp, recompute: a mode or one per layer, precision[, zero,
    #          microbatches[, lora]])
    (1, 1, 1, "none", "fp32"),
    (1, 1, 1, "full", "fp32"),
    (2, 2, 1, "none", "fp32"),
    (2, 2, 1, "full", "fp32"),
    (2, 1, 2, "none", "fp32"),
    (2, 1, 2, "full", "fp32"),
    (4, 2, 2, "none", "fp32"),
    (4, 2, 2, "full", "fp32"),
    # mixed precision (bf16 matmuls, fp32 master weights) and recomputation per layer
    (1, 1, 1, "none", "bf16"),
    (2, 2, 1, "none", "bf16"),
    (1, 1, 1, "full,none,none,full", "fp32"),
    (2, 2, 1, "full,none,op,none", "bf16"),
    # ZeRO-1 and 2 (FSDP2, weights whole through the step): stage 1 keeps whole gradients
    # over its microbatches, stage 2 only their shards
    (2, 2, 1, "none", "fp32", 1, 2),
    (2, 2, 1, "none", "fp32", 2, 2),
    (2, 2, 1, "none", "fp32", 2, 1),
    (2, 2, 1, "full", "fp32", 2, 1),
    # LoRA: frozen base weights (no gradients, no optimizer states); QLoRA: stored in NF4
    (2, 2, 1, "none", "fp32", 0, 1, "lora"),
    (2, 2, 1, "none", "fp32", 0, 1, "qlora"),
    (2, 1, 2, "none", "fp32", 0, 1, "lora"),
    # CPU offload of ZeRO-3's shards (on this machine the host is the device: the model
    # must then count them as host memory that the CPU process still holds)
    (2, 2, 1, "none", "fp32", 3, 1, "none", "optimizer+params"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(out: Path, nproc: int, quick: bool, default_dtype_only: bool = False) -> Path:
    """``autopar calibrate``; ``default_dtype_only`` for runs that train in fp32 only (this
    CPU's 16-bit matmuls alone take over ten minutes of a full calibration)."""
    cmd = [sys.executable, "-m", "autopar.cli.main", "calibrate", "--out", str(out),
           "--nproc", str(nproc)] + (["--quick"] if quick else []) + (
               ["--default-dtype-only"] if default_dtype_only else [])
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def cluster_file(profile: Path, links: Path, nproc: int, tmp: Path) -> Path:
    """This machine as a cluster of ``nproc`` gloo processes: the device calibrated with one
    process (``profile``), sharing this machine's cores (``cores_per_node``: each process runs
    one thread, so with more processes than cores each gets a share), and the link calibrated
    with ``nproc`` processes (``links``: gloo's latency grows when processes outnumber
    cores)."""
    device = json.loads(profile.read_text())["device"]
    lines = [f"name: this-machine-{nproc}", "nodes: 1", f"devices_per_node: {nproc}",
             f"cores_per_node: {usable_cores()}", f"profile: {links}", "device:",
             "  preset: cpu",
             "  peak_flops: {" + ", ".join(f"{k}: {v}" for k, v in
                                             device["peak_flops"].items()) + "}",
             f"  memory_bandwidth_bytes_per_s: {device['memory_bandwidth_bytes_per_s']}"]
    if device.get("corun_slowdown"):  # measured with the processes training at once
        lines.append(f"  corun_slowdown: {device['corun_slowdown']}")
    path = tmp / f"cluster-{nproc}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_case(nproc: int, dp: int, tp: int, recompute: str, precision: str, cluster: Path,
             tmp: Path, zero: int = 0, microbatches: int = 1, lora: str = "none",
             offload: str = "none") -> list[dict]:
    out = tmp / (f"{nproc}-{dp}-{tp}-{recompute}-{precision}-z{zero}-m{microbatches}-{lora}-"
                 f"{offload.replace('+', '-')}")
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / "workers" / "measure_step.py"),
           "--dp", str(dp), "--tp", str(tp), "--recompute", recompute, "--precision", precision,
           "--zero", str(zero), "--microbatches", str(microbatches), "--lora", lora,
           "--offload", offload,
           "--cluster", str(cluster), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        # e.g. torch's MemTracker refuses a module called several times per step (more
        # than one microbatch): say so on the row, go on with the others
        lines = [line for line in proc.stderr.splitlines() if "Error" in line]
        return [{"error": (lines[-1] if lines else proc.stderr[-300:]).strip()[:200]}]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", help="a profile from `autopar calibrate` (default: make one)")
    ap.add_argument("--state-only", action="store_true",
                    help="only the training-state rows (ZeRO-1/2, LoRA, QLoRA)")
    ap.add_argument("--write-ground", action="store_true",
                    help="record the multi-process rows as the gloo evidence of "
                    "cost_models/ground.json (validated ground; the nccl evidence is kept), "
                    "fp32 rows only: the others check the profile's 16-bit matmul rates, not a "
                    "parallel scheme")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every case this many times, alternated; medians are compared")
    ap.add_argument("--ground-only", action="store_true",
                    help="only the rows --write-ground records (several processes, fp32, "
                    "no LoRA)")
    ap.add_argument("--fp32-only", action="store_true",
                    help="skip the 16-bit rows (a profile measured with fp32 matmuls only, "
                    "as `autopar demo` makes, has the preset's 16-bit rates)")
    args = ap.parse_args()
    compared: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        profile = Path(args.profile).resolve() if args.profile else tmp / "profile.json"
        if not args.profile:
            print("calibrating this machine (autopar calibrate) ...", flush=True)
            calibrate(profile, 2, quick=False, default_dtype_only=args.fp32_only)
        links = {1: profile, 2: profile}
        print("calibrating the link with 4 processes (autopar calibrate --quick) ...", flush=True)
        links[4] = calibrate(tmp / "profile-4.json", 4, quick=True,
                             default_dtype_only=args.fp32_only)
        print("\nGPT 4 layers x 256 hidden, batch 8 x 256 tokens, AdamW, gloo (recompute per "
              "layer: one mode per layer)\n")
        print(f"{'ranks':>5} {'mesh':<15} {'recompute':<19} {'prec':<5} {'tp-sharded':>10} | "
              f"{'peak MiB':>9} {'peak MiB':>9} {'error':>7} | {'step ms':>8} {'step ms':>8} "
              f"{'error':>7}")
        print(f"{'':>5} {'':<15} {'':<19} {'':<5} {'weights':>10} | {'modelled':>9} {'measured':>9} "
              f"{'':>7} | {'modelled':>8} {'measured':>8}")
        memory_errors, time_errors = [], []
        cases = []
        for nproc, dp, tp, recompute, precision, *more in CASES:
            zero, microbatches, lora, offload = (*more, *(0, 1, "none", "none")[len(more):])
            if args.state_only and not (zero or lora != "none"):
                continue
            if args.fp32_only and precision != "fp32":
                continue
            if args.ground_only and not (nproc > 1 and precision == "fp32" and lora == "none"):
                continue
            cases.append((nproc, dp, tp, recompute, precision, zero, microbatches, lora,
                          offload))
        measured: dict[tuple, list[list[dict]]] = {case: [] for case in cases}
        for r in range(max(1, args.rounds)):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                nproc, dp, tp, recompute, precision, zero, microbatches, lora, offload = case
                cluster = cluster_file(profile, links[nproc], nproc, tmp)
                measured[case].append(run_case(nproc, dp, tp, recompute, precision, cluster,
                                               tmp / f"round{r}", zero, microbatches, lora,
                                               offload))
            if args.rounds > 1:
                print(f"  round {r + 1}/{args.rounds} done", flush=True)
        for case in cases:
            nproc, dp, tp, recompute, precision, zero, microbatches, lora, offload = case
            launches = [ranks for ranks in measured[case] if "error" not in ranks[0]]
            if not launches:
                print(f"{nproc:>5} dp{dp}xtp{tp} z{zero} m{microbatches} {lora} {offload}: "
                      f"not measured ({measured[case][0][0]['error']})", flush=True)
                continue
            ranks = launches[0]
            measured_peak = max(r["measured_peak_bytes"] for r in ranks)
            predicted_peak = ranks[0]["predicted_peak_bytes"]
            measured_step = statistics.median(  # over the launches, of each one's median
                statistics.median(r["measured_step_s"] for r in launch) for launch in launches)
            predicted_step = ranks[0]["predicted_step_s"]
            mem_err = (predicted_peak - measured_peak) / measured_peak
            time_err = (predicted_step - measured_step) / measured_step
            memory_errors.append(abs(mem_err))
            time_errors.append(abs(time_err))
            if nproc > 1 and lora == "none" and precision == "fp32":
                compared.append({"source": f"fidelity_measured-{time.strftime('%Y-%m-%d')}",
                                 "mesh": {"dp": dp, "tp": tp}, "zero": zero,
                                 "devices_per_node": nproc, "error": time_err})
            mesh = (f"dp{dp}xtp{tp}" + (f" z{zero} m{microbatches}" if zero else "")
                    + (f" {lora}" if lora != "none" else "")
                    + (" offload" if offload != "none" else ""))
            print(f"{nproc:>5} {mesh:<15} {recompute:<19} {precision:<5} "
                  f"{ranks[0]['tp_sharded']:>10} | "
                  f"{predicted_peak / 2**20:>9.1f} {measured_peak / 2**20:>9.1f} {mem_err:>+7.1%} | "
                  f"{predicted_step * 1e3:>8.1f} {measured_step * 1e3:>8.1f} {time_err:>+7.1%}",
                  flush=True)
        print(f"\npeak memory: worst error {max(memory_errors):.1%} (target <= 10% in every case)")
        print(f"step time: median error {statistics.median(time_errors):.1%} (target <= 25%)")
    if args.write_ground and compared:
        from autopar.cost_models.ground import evidence_from_rows, write_ground

        print(f"\nwrote {write_ground(evidence_from_rows(compared, 'gloo'))}")


if __name__ == "__main__":
    main()
