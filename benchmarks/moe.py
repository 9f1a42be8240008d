"""Expert parallelism, predicted vs measured on this machine: step time, peak memory and the
all-to-all volume of a small MoE GPT for ep = 1, 2, 4 (4 gloo processes, dp=4).

    python benchmarks/moe.py                  # calibrates first (~1 min)
    python benchmarks/moe.py --profile p.json # reuse a profile

Each row: the plan's predicted step time and peak memory (modelled, with this machine's
calibrated profile) beside the median measured step time and the peak of live tensor bytes
MemTracker saw over a step (measured), and the tokens each rank sends to other ranks' experts
per step (modelled from the plan; dispatch and combine, forward and backward).
Target: peak memory within 10%.
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
from fidelity_measured import calibrate, cluster_file, free_port  # noqa: E402

NPROC, DP = 4, 4
EPS = (1, 2, 4)


def run(ep: int, cluster: Path, tmp: Path) -> list[dict]:
    out = tmp / f"ep{ep}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
           f"--master-port={free_port()}", str(HERE / "workers" / "moe_step.py"),
           "--dp", str(DP), "--ep", str(ep), "--cluster", str(cluster), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"ep={ep} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", help="a profile from `autopar calibrate` (default: make one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        profile = Path(args.profile).resolve() if args.profile else tmp / "profile.json"
        if not args.profile:
            print("calibrating this machine (autopar calibrate) ...", flush=True)
            calibrate(profile, 2, quick=False)
        print(f"calibrating the link with {NPROC} processes (autopar calibrate --quick) ...",
              flush=True)
        links = calibrate(tmp / f"profile-{NPROC}.json", NPROC, quick=True)
        cluster = cluster_file(profile, links, NPROC, tmp)
        print("\nMoE GPT 2 layers x 256 hidden, 8 experts top-2 (ffn 512, sorted tokens, "
              "grouped matmuls), batch 8 x 128 tokens, AdamW, gloo, dp=4\n")
        print(f"{'ep':>3} | {'step ms':>9} {'step ms':>9} {'error':>7} | {'peak MiB':>9} "
              f"{'peak MiB':>9} {'error':>7} | {'a2a MiB/step':>12} {'a2a ms':>7}")
        print(f"{'':>3} | {'modelled':>9} {'measured':>9} {'':>7} | {'modelled':>9} "
              f"{'measured':>9} {'':>7} | {'modelled':>12} {'modelled':>7}")
        worst = 0.0
        for ep in EPS:
            ranks = run(ep, cluster, tmp)
            r0 = ranks[0]
            measured_step = max(r["measured_step_s"] for r in ranks)
            measured_peak = max(r["measured_peak_bytes"] for r in ranks)
            step_err = (r0["predicted_step_s"] - measured_step) / measured_step
            mem_err = (r0["predicted_peak_bytes"] - measured_peak) / measured_peak
            worst = max(worst, abs(mem_err))
            print(f"{ep:>3} | {r0['predicted_step_s'] * 1e3:>9.1f} {measured_step * 1e3:>9.1f} "
                  f"{step_err:>+7.1%} | {r0['predicted_peak_bytes'] / 2**20:>9.1f} "
                  f"{measured_peak / 2**20:>9.1f} {mem_err:>+7.1%} | "
                  f"{r0['all_to_all_bytes'] / 2**20:>12.2f} {r0['all_to_all_s'] * 1e3:>7.1f}",
                  flush=True)
        print(f"\npeak memory: worst error {worst:.1%} (target <= 10%)")


if __name__ == "__main__":
    main()
