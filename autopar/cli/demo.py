"""``autopar demo``: plan a small GPT for 2 local CPU processes, train it on gloo, and
print the single-device and parallel losses side by side, then the predicted step time next
to the measured one.

The first demo on a machine measures it (``autopar calibrate --quick``'s measurements with
fp32 matmuls only, about 80 s on 2 cores) and plans with that profile: a preset is
another machine's numbers, and this project's 2-core VMs alone differ 2x in speed from day
to day. The demo records its run (``ParallelModule.record_run``) and refits this machine's
profile from it (:mod:`autopar.calibrate.from_run`), keeping the result in the user's cache
(``$XDG_CACHE_HOME/autopar``, per host and process count), which later demos plan with. It
prints the refitted prediction of the same configuration too. ``--preset`` plans a first
demo with the ``cpu`` preset instead, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autopar.calibrate.from_run import fit_runs, read_run, refit_profile
from autopar.cli.demo_data import BATCH, SEQ, demo_batches, demo_model
from autopar.core.cluster import usable_cores
from autopar.core.cluster.profile import read_profile, write_profile
from autopar.core.errors import AutoparError
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_plan


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


def demo_profile_cache(nproc: int) -> Path:
    """Where the demo keeps the profile it refitted from its last run on this machine."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "autopar" / f"demo-profile-{socket.gethostname()}-{nproc}.json"


def measure_this_machine(nproc: int, cache: Path) -> Path:
    """Calibrate this machine for ``nproc`` processes (quick, fp32 matmuls) into ``cache``."""
    from autopar.calibrate import host_info
    from autopar.cli.calibrate_cmd import measure_profile

    print("no profile of this machine yet: measuring it first (autopar calibrate --quick, "
          "fp32 matmuls only; about 80 s) ...", flush=True)
    started = time.perf_counter()
    profile = measure_profile("cpu", nproc, host_info("cpu", nproc, 1, True), quick=True,
                              default_dtype_only=True, say=lambda _: None,
                              progress=lambda what: print(f"  measuring {what} ...", flush=True))
    write_profile(profile, cache)
    print(f"measured in {time.perf_counter() - started:.0f} s; kept as {cache}\n", flush=True)
    return cache


def demo_cluster(nproc: int, profile: Path | None, tmp: str) -> tuple[str, str]:
    """The cluster the demo plans for — ``nproc`` gloo processes sharing this machine's
    cores — and where its numbers come from (for the report)."""
    path = Path(tmp) / "this-machine.yaml"
    lines = ["name: this-machine", "nodes: 1", f"devices_per_node: {nproc}",
             f"cores_per_node: {usable_cores()}", "backend: gloo", "device:", "  preset: cpu"]
    if profile is not None:
        lines.append(f"profile: {json.dumps(str(profile.resolve()))}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if profile is None:
        return str(path), "the cpu preset (another machine's numbers; no profile yet)"
    return str(path), f"profile {profile}"


def run_workers(nproc: int, steps: int, cluster: str, out: str, record: str | None = None,
                plan: str | None = None) -> dict:
    """Launch the demo's ``nproc`` gloo processes; rank 0's result (losses, plan)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={_free_port()}", "-m", "autopar.cli.demo_worker",
           "--steps", str(steps), "--out", out, "--cluster", cluster]
    cmd += ["--record-run", record] if record else []
    cmd += ["--plan", plan] if plan else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not os.path.exists(out):
        raise AutoparError(
            f"the {nproc} demo processes failed (exit {proc.returncode})",
            where="autopar.cli.demo_worker",
            fix="see the output below\n" + proc.stderr[-4000:],
        )
    with open(out) as f:
        return json.load(f)


def pinned_prediction(plan: Plan, cluster: str) -> Plan:
    """The plan autopar makes on ``cluster`` with every choice of ``plan`` pinned (mesh,
    microbatches, schedule, ZeRO, recomputation, and the devices of a plan that uses fewer
    than the cluster has): its modelled step under other numbers."""
    from autopar.api.planning import plan as make_plan

    pins: dict = {"dp": plan.mesh.get("dp", 1), "tp": plan.mesh.get("tp", 1),
                  "pp": plan.mesh.get("pp", 1), "microbatches": plan.batch["microbatches"],
                  "zero": plan.training["zero"], "recompute": plan.training["recompute"],
                  "precision": plan.training["precision"]}
    if plan.world_size < plan.cluster["devices"]:
        pins["devices"] = plan.world_size
    if plan.pipeline:  # zb_v's two chunks per rank are its own, not virtual_stages=
        pins["schedule"] = plan.pipeline["schedule"]
        if plan.pipeline["schedule"] == "interleaved":
            pins["virtual_stages"] = plan.pipeline["virtual_stages"]
    return make_plan(demo_model(), cluster, demo_batches(1)[0], **pins)


def why_chosen(plan: Plan) -> list[str]:
    """The solver's alternatives, fastest first: why this plan (all modelled)."""
    solved = [c for c in plan.solver.get("candidates", []) if "step_time_s" in c]
    solved.sort(key=lambda c: c["step_time_s"])
    best: dict[tuple, dict] = {}
    for c in solved:
        best.setdefault((c["pp"], c["dp"], c["tp"]), c)
    lines = [f"why this plan (modelled): the fastest of {len(solved)} settings solved that fit "
             "in memory; the best of each mesh:"]
    for c in best.values():
        mesh = f"pp={c['pp']} dp={c['dp']} tp={c['tp']}"
        extra = f" {c['schedule']}" + (f" x{c['virtual']}" if c.get("virtual", 1) > 1 else "") \
            if c["pp"] > 1 else ""
        lines.append(f"  {mesh:<16} {c['microbatches']} microbatch(es){extra}, ZeRO-{c['zero']},"
                     f" recompute {c['recompute']}: {c['step_time_s'] * 1e3:8.1f} ms")
    return lines


def run_demo(args: argparse.Namespace) -> int:
    print(f"autopar demo: a {sum(p.numel() for p in demo_model().parameters()) / 1e6:.2f}M-"
          f"parameter GPT, batch {BATCH} x {SEQ} bytes, {args.steps} AdamW steps\n")
    cache = demo_profile_cache(args.nproc)
    profile = Path(args.profile) if getattr(args, "profile", None) else None
    if profile is None and cache.exists():
        try:
            read_profile(cache)
            profile = cache
        except AutoparError:
            profile = None  # a damaged cache: plan from the preset and write it again
    elif profile is not None:
        read_profile(profile)  # a bad --profile fails here, with its own message
    if profile is None and not getattr(args, "preset", False):
        profile = measure_this_machine(args.nproc, cache)
    reference, ref_s = single_device_losses(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        cluster, source = demo_cluster(args.nproc, profile, tmp)
        record = getattr(args, "record_run", None) or os.path.join(tmp, "run")
        result = run_workers(args.nproc, args.steps, cluster, os.path.join(tmp, "result.json"),
                             record)
        plan = Plan.from_dict(result["plan"])
        print(format_plan(plan, "demo GPT"))
        print("\n" + "\n".join(why_chosen(plan)))
        print(f"\nlosses (measured): single device vs {args.nproc} gloo processes")
        print(f"  {'step':>4}  {'single':>10}  {'parallel':>10}  {'|diff|':>9}")
        worst = 0.0
        for i, (a, b) in enumerate(zip(reference, result["losses"]), 1):
            worst = max(worst, abs(a - b))
            print(f"  {i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
        print(f"\nlargest difference {worst:.2e}; single-device {ref_s:.2f} s, parallel steps "
              f"{sum(result['step_s']):.2f} s (measured, this machine)")
        print()
        print("\n".join(step_time_report(plan, source, record, cache, args.nproc, tmp)))
    return 0 if worst < 1e-4 else 1


def step_time_report(plan: Plan, source: str, record: str, cache: Path, nproc: int,
                     tmp: str) -> list[str]:
    """Predicted next to measured step time, and the prediction once refitted to this run."""
    try:
        run = read_run(record)
    except AutoparError as err:
        return [f"step time: predicted {plan.predicted['step_time_s'] * 1e3:.1f} ms (modelled, "
                f"planned with {source}); measured: nothing past the warm-up steps to compare "
                f"({err.fix or err.what})"]
    steps = list(run.fitted_steps)
    measured = run.measured_step_s()
    lines = ["step time: predicted (modelled) vs measured, per step",
             f"  predicted   {plan.predicted['step_time_s'] * 1e3:8.1f} ms   modelled, "
             f"planned with {source}",
             f"  measured    {measured * 1e3:8.1f} ms   measured, median of steps "
             f"{steps[0] + 1}-{steps[-1] + 1} (steps 1-{steps[0]} are warm-up)"]
    try:
        fit = fit_runs([run])
    except AutoparError as err:
        return lines + [f"  (no refit: {err.what})"]
    write_profile(refit_profile([run], fit), cache)
    refit_cluster, _ = demo_cluster(nproc, cache, tmp)
    again = pinned_prediction(plan, refit_cluster)
    error = (plan.predicted["step_time_s"] - measured) / measured
    after = (again.predicted["step_time_s"] - measured) / measured
    sizes = len({p.nbytes for p in fit.link_points})
    link = ("link" if fit.link is not None else
            f"not the link (kept: {sizes} message size{'s' if sizes != 1 else ''} recorded)")
    lines += [
        f"  refitted    {again.predicted['step_time_s'] * 1e3:8.1f} ms   modelled, same "
        f"configuration; device speed ({fit.device_scale:.2f}x the plan's) and {link} "
        "refitted to this run",
        f"  error       {error:+8.1%} before the refit, {after:+.1%} after",
        f"refitted profile saved to {cache}; the next `autopar demo` plans with it "
        f"(`autopar calibrate --from-run DIR` does the same for any recorded run)",
    ]
    return lines
