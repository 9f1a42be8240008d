"""The closed calibration loop on this machine: plan, train and record, refit, plan again.

    python benchmarks/calibration_loop.py                      # calibrates first (--quick)
    python benchmarks/calibration_loop.py --profile p.json     # start from a profile
    python benchmarks/calibration_loop.py --preset             # start from the cpu preset

1. plan the demo GPT (``autopar demo``'s model and data) for 2 gloo processes with the
   starting profile (``autopar calibrate --quick``, unless given), train ``--steps`` steps
   with the run recorded (``ParallelModule.record_run``);
2. refit the profile from that run (``autopar calibrate --from-run``);
3. plan again with the refitted profile, train and record ``--steps`` steps of that plan.

It prints each plan's predicted step time (modelled) next to the measured one (median over
the steps after the first, the warm-up). Targets (issue 11): within 25% before the refit,
within 10% after.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from autopar.calibrate.from_run import fit_runs, format_fit, read_run, refit_profile
from autopar.cli.demo import demo_cluster, run_workers
from autopar.cluster.profile import write_profile


def run_and_record(nproc: int, steps: int, cluster: str, tmp: Path, name: str):
    record = tmp / name
    result = run_workers(nproc, steps, cluster, str(tmp / f"{name}.json"), str(record))
    return read_run(record), result


def row(label: str, run) -> str:
    mesh = " x ".join(f"{k}{v}" for k, v in run.plan["mesh"].items() if v > 1) or "1"
    extra = ""
    if run.plan.get("pipeline"):
        extra = f" {run.plan['pipeline']['schedule']}"
    extra += f" ZeRO-{run.plan['training']['zero']}"
    predicted, measured = run.predicted(), run.measured_step_s()
    return (f"{label:<28} {mesh + extra:<22} {predicted * 1e3:>9.1f} {measured * 1e3:>9.1f} "
            f"{(predicted - measured) / measured:>+8.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--profile", help="starting profile (default: autopar calibrate --quick)")
    start.add_argument("--preset", action="store_true", help="start from the cpu preset")
    ap.add_argument("--steps", type=int, default=21, help="steps per run (the first is warm-up)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--keep", help="keep the runs and profiles in this directory")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(args.keep or tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        if args.preset:
            profile, source = None, "cpu preset"
        elif args.profile:
            profile, source = Path(args.profile), f"profile {args.profile}"
        else:
            profile, source = tmp / "quick-profile.json", "autopar calibrate --quick"
            print("calibrating this machine (autopar calibrate --quick) ...", flush=True)
            subprocess.run([sys.executable, "-m", "autopar.cli.main", "calibrate", "--quick",
                            "--nproc", str(args.nproc), "--out", str(profile)],
                           check=True, capture_output=True)
        cluster, _ = demo_cluster(args.nproc, profile, str(tmp))
        print(f"1. plan with {source}; train {args.steps} steps, recorded", flush=True)
        before, _ = run_and_record(args.nproc, args.steps, cluster, tmp, "run-before")
        fit = fit_runs([before])
        refit = write_profile(refit_profile([before], fit), tmp / "refit-profile.json")
        print("2. refit (autopar calibrate --from-run)\n")
        print("   " + format_fit([before], fit).replace("\n", "\n   "), flush=True)
        refit_dir = tmp / "refit"
        refit_dir.mkdir(exist_ok=True)
        cluster, _ = demo_cluster(args.nproc, refit, str(refit_dir))
        print(f"\n3. plan again with {refit.name}; train {args.steps} steps, recorded", flush=True)
        after, _ = run_and_record(args.nproc, args.steps, cluster, tmp, "run-after")
        print(f"\ndemo GPT, {args.nproc} gloo processes, {args.steps} steps per run "
              "(measured: median of steps 2 on)\n")
        print(f"{'':<28} {'plan':<22} {'modelled':>9} {'measured':>9} {'error':>8}")
        print(f"{'':<28} {'':<22} {'step ms':>9} {'step ms':>9}")
        print(row(f"before refit ({'preset' if args.preset else 'calibrated'})", before))
        print(row("after refit (from the run)", after))
        err_before = abs(before.predicted() - before.measured_step_s()) / before.measured_step_s()
        err_after = abs(after.predicted() - after.measured_step_s()) / after.measured_step_s()
        print(f"\nbefore: {err_before:.1%} (target <= 25%); after: {err_after:.1%} "
              "(target <= 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
