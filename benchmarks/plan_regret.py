"""Measured regret: is the automatic plan as fast as the best layout, measured?

For each model and each launch of 2 and 4 gloo processes on this machine (one thread each),
trains the automatic plan (``autopar.parallelize`` with nothing pinned: it may use fewer
devices) and every pinned layout of the same processes — data, tensor and pipeline
parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-V where legal), ZeRO 0/1/2/3, recomputation
none/full, and fewer ranks (1; 2 of 4) — round-robin (each round times every layout for a
few steps, rounds start one layout later each time), and takes each layout's median step
time (measured). A pinned layout whose plan is the automatic plan's own program is timed
once, not twice (two timings of one program differ only by noise). Then

    regret = auto / best - 1

per model and launch, with the median and worst regret over all of them, and every
layout's predicted step (modelled, with a calibrated ``cpu`` profile as
``fidelity_measured.py`` makes it) next to its measured step: the cost model's errors per
layout kind.

    python benchmarks/plan_regret.py                        # calibrates first (~1-2 min)
    python benchmarks/plan_regret.py --profile p.json --profile-4 p4.json --json regret.json
    python benchmarks/plan_regret.py --quick                # smoke run: 2 models, 3 rounds

The cluster description gives this machine's cores (``cores_per_node``): with more
processes than cores each gets a share of a core, and a plan on fewer ranks (the others idle,
blocked in a broadcast, not computing) gets more of the machine (modelled), and the link
calibrated with one process per core (``intra_node_link_uncontended``).

Models (``benchmarks/workers/regret_worker.py``): the demo GPT, a tiny HF Llama (random
weights), a deep narrow GPT, and a wide shallow GPT. Every plan is made for this machine as
calibrated (its device and its gloo links): a plan made for other links would be measured on
these, and its regret would be the description's error, not the planner's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))

from fidelity_measured import calibrate, cluster_file, free_port  # noqa: E402

MODEL_ORDER = ("demo", "llama", "gpt-deep", "wide")
MODEL_WHAT = {  # (as regret_worker.MODELS says; kept here so the table needs no torch import)
    "demo": "demo GPT: 4 layers x 128, batch 8 x 64, vocab 256 (calibrated links)",
    "llama": "HF Llama: 4 layers x 128 (GQA 4/2), ffn 256, batch 8 x 64 (calibrated links)",
    "gpt-deep": "GPT: 8 layers x 64, batch 8 x 128, vocab 512 (calibrated links)",
    "wide": "wide GPT: 2 layers x 384, batch 4 x 32, vocab 256 (calibrated links)",
}


def run_launch(model: str, nproc: int, cluster: Path, tmp: Path, args: argparse.Namespace
               ) -> dict[str, Any]:
    out = tmp / f"{model}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / "workers" / "regret_worker.py"),
           "--model", model, "--cluster", str(cluster), "--repeats", str(args.repeats),
           "--steps", str(args.steps), "--time-limit", str(args.time_limit), "--out", str(out)]
    if args.only:
        cmd += ["--only", args.only]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.launch_timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "nproc": nproc, "error": f"timed out after "
                f"{args.launch_timeout} s", "layouts": []}
    if proc.returncode != 0 or not out.exists():
        return {"model": model, "nproc": nproc, "layouts": [],
                "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def plan_text(p: dict[str, Any]) -> str:
    """A layout in a few words: devices, mesh, schedule, microbatches, ZeRO, recomputation."""
    mesh = "x".join(f"{a}{n}" for a, n in p["mesh"].items() if n > 1) or "1 device"
    if p["devices"] < p["cluster_devices"]:
        mesh = f"{p['devices']} of {p['cluster_devices']}: {mesh}"
    sched = f" {p['schedule']}" + (f"/v{p['virtual_stages']}" if p["schedule"] == "interleaved"
                                   else "") if p["schedule"] else ""
    return (f"{mesh}{sched} m{p['microbatches']}x{p['microbatch']} Z{p['zero']} "
            f"rc-{p['recompute']}")


def kind_of(layout: str, plan: dict[str, Any]) -> str:
    """The layout's kind, for the error summary."""
    if layout == "auto":
        return "auto"
    if plan["devices"] < plan["cluster_devices"]:
        return "fewer ranks"
    mesh = {a: n for a, n in plan["mesh"].items() if n > 1}
    if "pp" in mesh:
        return f"pp {plan['schedule']}" if len(mesh) == 1 else "pp x dp"
    if len(mesh) > 1:
        return "dp x tp"
    if "tp" in mesh:
        return "tp"
    if plan["zero"]:
        return f"dp zero{plan['zero']}"
    return "dp recompute" if plan["recompute"] != "none" else "dp"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows, layouts = [], []
    for res in results:
        ok = [r for r in res["layouts"] if r["status"] == "ok" and r["step_s"]]
        for r in res["layouts"]:
            entry = {"model": res["model"], "ranks": res["nproc"], "layout": r["layout"],
                     "status": r["status"], "pins": r.get("pins")}
            if r["status"] == "ok" and r["step_s"]:
                measured = statistics.median(r["step_s"])
                predicted = r["plan"]["predicted"]["step_time_s"]
                entry.update(same_plan_as=r.get("same_plan_as"),
                             plan=r["plan"], text=plan_text(r["plan"]),
                             kind=kind_of(r["layout"], r["plan"]),
                             measured_step_s=measured, measured_samples_s=r["step_s"],
                             predicted_step_s=predicted,
                             error=(predicted - measured) / measured)
            layouts.append(entry)
        auto = next((r for r in ok if r["layout"] == "auto"), None)
        if auto is None or not ok:
            rows.append({"model": res["model"], "ranks": res["nproc"],
                         "error": res.get("error") or "the automatic plan did not run"})
            continue
        best = min(ok, key=lambda r: statistics.median(r["step_s"]))
        auto_s, best_s = statistics.median(auto["step_s"]), statistics.median(best["step_s"])
        rows.append({"model": res["model"], "ranks": res["nproc"],
                     "auto_plan": plan_text(auto["plan"]),
                     "auto_predicted_s": auto["plan"]["predicted"]["step_time_s"],
                     "auto_measured_s": auto_s, "best_layout": best["layout"],
                     "best_plan": plan_text(best["plan"]), "best_measured_s": best_s,
                     "regret": auto_s / best_s - 1,
                     "auto_devices_why": auto["plan"]["devices_why"]})
    regrets = [r["regret"] for r in rows if "regret" in r]
    return {"rows": rows, "layouts": layouts,
            "median_regret": statistics.median(regrets) if regrets else None,
            "worst_regret": max(regrets) if regrets else None}


def print_report(summary: dict[str, Any]) -> None:
    print("\nregret of the automatic plan (step times: predicted = modelled, others measured; "
          "medians)\n")
    head = (f"{'model':<9} {'ranks':>5}  {'auto plan':<40} {'pred ms':>8} {'auto ms':>8}  "
            f"{'best layout':<18} {'best ms':>8} {'regret':>7}")
    print(head)
    print("-" * len(head))
    for r in summary["rows"]:
        if "error" in r:
            print(f"{r['model']:<9} {r['ranks']:>5}  failed: {r['error'][:200]}")
            continue
        print(f"{r['model']:<9} {r['ranks']:>5}  {r['auto_plan']:<40} "
              f"{r['auto_predicted_s'] * 1e3:>8.1f} {r['auto_measured_s'] * 1e3:>8.1f}  "
              f"{r['best_layout']:<18} {r['best_measured_s'] * 1e3:>8.1f} {r['regret']:>+7.1%}")
    if summary["median_regret"] is not None:
        print(f"\nregret: median {summary['median_regret']:+.1%}, worst "
              f"{summary['worst_regret']:+.1%} (measured)")
    print("\nevery layout: predicted (modelled) vs measured step; error = (predicted - "
          "measured) / measured; spread = (max - min) / median of the rounds\n")
    head = (f"{'model':<9} {'ranks':>5} {'layout':<18} {'plan':<44} {'pred ms':>8} "
            f"{'meas ms':>8} {'error':>7} {'spread':>7}")
    print(head)
    print("-" * len(head))
    for e in summary["layouts"]:
        if "measured_step_s" not in e:
            print(f"{e['model']:<9} {e['ranks']:>5} {e['layout']:<18} {e['status'][:90]}")
            continue
        s = e["measured_samples_s"]
        spread = (max(s) - min(s)) / e["measured_step_s"]
        print(f"{e['model']:<9} {e['ranks']:>5} {e['layout']:<18} {e['text']:<44} "
              f"{e['predicted_step_s'] * 1e3:>8.1f} {e['measured_step_s'] * 1e3:>8.1f} "
              f"{e['error']:>+7.1%} {spread:>7.0%}"
              + (f"  (the same plan as {e['same_plan_as']}: timed once)"
                 if e.get("same_plan_as") else ""))
    kinds: dict[str, list[float]] = {}
    for e in summary["layouts"]:
        if "error" in e and not e.get("same_plan_as"):  # a shared measurement counts once
            kinds.setdefault(e["kind"], []).append(e["error"])
    print("\nstep-time error by layout kind (predicted vs measured)\n")
    print(f"{'kind':<14} {'n':>3} {'median error':>13} {'median |error|':>15} {'worst':>8}")
    for kind, errs in sorted(kinds.items()):
        worst = max(errs, key=abs)
        print(f"{kind:<14} {len(errs):>3} {statistics.median(errs):>+13.1%} "
              f"{statistics.median(map(abs, errs)):>15.1%} {worst:>+8.1%}")
    summary["error_by_kind"] = {k: {"n": len(v), "median": statistics.median(v),
                                    "median_abs": statistics.median(map(abs, v)),
                                    "worst": max(v, key=abs)} for k, v in kinds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a profile from `autopar calibrate` (default: make one)")
    ap.add_argument("--profile-4", help="a profile from `autopar calibrate --nproc 4` for the "
                    "links of 4 processes (default: make one, --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the demo and wide models, 3 rounds")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODEL_ORDER)}")
    ap.add_argument("--ranks", default="2,4", help="process counts to launch (default 2,4)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 7; --quick 3)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per timed sample")
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT s per candidate")
    ap.add_argument("--only", default=None, help="comma-separated layout names (debugging)")
    ap.add_argument("--launch-timeout", type=int, default=1800)
    ap.add_argument("--json", help="also write every result (plans, predictions, samples) here")
    args = ap.parse_args()
    models = (args.models.split(",") if args.models else
              ["demo", "wide"] if args.quick else list(MODEL_ORDER))
    if unknown := [m for m in models if m not in MODEL_ORDER]:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; use {', '.join(MODEL_ORDER)}")
    args.repeats = args.repeats or (3 if args.quick else 7)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        profile = Path(args.profile).resolve() if args.profile else tmp / "profile.json"
        if not args.profile:
            print("calibrating this machine (autopar calibrate) ...", flush=True)
            calibrate(profile, 2, quick=args.quick, default_dtype_only=True)  # fp32 plans
        links = {1: profile, 2: profile}
        if 4 in ranks and args.profile_4:
            links[4] = Path(args.profile_4).resolve()
        elif 4 in ranks:
            print("calibrating the link with 4 processes (autopar calibrate --quick) ...",
                  flush=True)
            links[4] = calibrate(tmp / "profile-4.json", 4, quick=True, default_dtype_only=True)
        # the calibrated profiles the clusters name, kept with the results (they are temporary)
        profiles = {str(n): json.loads(Path(p).read_text()) for n, p in links.items()}
        results = []
        for model in models:
            for nproc in ranks:
                cluster = cluster_file(profile, links[nproc], nproc, tmp)
                print(f"{model} on {nproc} processes: {MODEL_WHAT[model]} ...", flush=True)
                res = run_launch(model, nproc, cluster, tmp, args)
                res["cluster"] = cluster.read_text()
                results.append(res)
                if "error" in res:
                    print(f"  failed: {res['error'][-1500:]}", flush=True)
                else:
                    print(f"  {len(res['layouts'])} layouts in {res['wall_s']:.0f} s", flush=True)
    summary = summarize(results)
    print_report(summary)
    if args.json:
        data = {"label": "step times: predicted_* modelled, measured_* measured (this machine, "
                "gloo, OMP_NUM_THREADS=1)", "machine_cores": os.cpu_count(),
                "repeats": args.repeats, "steps_per_sample": args.steps, "models": {
                    m: MODEL_WHAT[m] for m in models}, **summary, "launches": results,
                "profiles": profiles}
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
