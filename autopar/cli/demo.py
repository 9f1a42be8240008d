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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autopar.calibrate.corun_split import split_corun
from autopar.calibrate.from_run import fit_runs, read_run, refit_profile
from autopar.cli.demo_data import BATCH, SEQ, demo_batches, demo_model
from autopar.core.cluster import usable_cores
from autopar.core.cluster.profile import read_profile, write_profile
from autopar.core.errors import AutoparError
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_alternatives, format_settings, format_step

WARMUP = 2
"""Steps left out of the single-device median (the first allocate and warm the caches)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


THREADS = 1
"""Threads per process, the demo's workers' and its single-device run's alike: its step
times are compared (with a core's worth of threads each, a loaded machine slowed the
caller's run 3x against a worker's, measured)."""


def single_device_losses(steps: int) -> tuple[list[float], list[float]]:
    """The losses of one process training the demo, and each step's seconds (measured),
    with the workers' threads."""
    model = demo_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, step_s = [], []
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        for x, y in demo_batches(steps):
            started = time.perf_counter()
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step_s.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return losses, step_s


def demo_profile_cache(nproc: int) -> Path:
    """Where the demo keeps the profile it refitted from its last run on this machine."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "autopar" / f"demo-profile-{socket.gethostname()}-{nproc}.json"


def measure_this_machine(nproc: int, cache: Path, again: bool = False) -> Path:
    """Calibrate this machine for ``nproc`` processes (quick, fp32 matmuls) into ``cache``
    (``again``: asked for with --remeasure, over the profile kept there)."""
    from autopar.calibrate import host_info
    from autopar.cli.calibrate_cmd import measure_profile

    why = ("--remeasure: measuring this machine again" if again else
           "no profile of this machine yet: measuring it first")
    print(f"{why} (autopar calibrate --quick, fp32 matmuls only; 40-80 s on 2 cores) "
          "...", flush=True)
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
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
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
    return _pinned_demo_plan(cluster, pins)


def one_process_prediction(cluster: str) -> Plan:
    """The single-device run (one process, the whole batch at once, no recomputation) as
    the cost model prices it on ``cluster``."""
    return _pinned_demo_plan(cluster, {"devices": 1, "dp": 1, "tp": 1, "pp": 1,
                                       "microbatches": 1, "zero": 0, "recompute": "none"})


def _pinned_demo_plan(cluster: str, pins: dict) -> Plan:
    """The demo model's plan on ``cluster`` with ``pins`` (keyword arguments of ``plan``)."""
    from autopar.api.planning import plan as make_plan

    return make_plan(demo_model(), cluster, demo_batches(1)[0], **pins)


def plan_lines(plan: Plan) -> list[str]:
    """The plan in a few lines: its mesh, why that many devices, its modelled step, and
    what it beat (the full summary: ``autopar plan``)."""
    head = format_settings(plan, "demo GPT")
    keep = [line for line in head if line.startswith(("mesh ", "devices "))]
    step = format_step(plan)[2:4]
    return ["the plan (modelled)", *keep, *step, *format_alternatives(plan)[1:]]


def _median_past(step_s: list[float], warmup: int) -> tuple[float, str]:
    """The median step past the first ``warmup`` (allocating, warming caches), and which
    steps that is."""
    first = min(warmup, len(step_s) - 1)
    return statistics.median(step_s[first:]), f"{first + 1}-{len(step_s)}"


def run_demo(args: argparse.Namespace) -> int:
    print(f"autopar demo: a {sum(p.numel() for p in demo_model().parameters()) / 1e6:.2f}M-"
          f"parameter GPT, batch {BATCH} x {SEQ} bytes, {args.steps} AdamW steps\n")
    cache = demo_profile_cache(args.nproc)
    profile = Path(args.profile) if getattr(args, "profile", None) else None
    remeasure = getattr(args, "remeasure", False)
    if profile is None and cache.exists() and not remeasure:
        try:
            read_profile(cache)
            profile = cache
        except AutoparError:
            profile = None  # a damaged cache: plan from the preset and write it again
    elif profile is not None:
        read_profile(profile)  # a bad --profile fails here, with its own message
    if profile is None and not getattr(args, "preset", False):
        profile = measure_this_machine(args.nproc, cache, again=remeasure and cache.exists())
    reference, ref_s = single_device_losses(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        cluster, source = demo_cluster(args.nproc, profile, tmp)
        record = getattr(args, "record_run", None) or os.path.join(tmp, "run")
        result = run_workers(args.nproc, args.steps, cluster, os.path.join(tmp, "result.json"),
                             record)
        plan = Plan.from_dict(result["plan"])
        print("\n".join(plan_lines(plan)))
        ran = (f"{args.nproc} gloo processes" if plan.world_size == args.nproc else
               f"the plan's {plan.world_size} of {args.nproc} gloo processes")
        print(f"\nlosses (measured): single device vs {ran}")
        worst = max(abs(a - b) for a, b in zip(reference, result["losses"]))
        shown = sorted({0, 1, len(reference) - 1})
        for i in shown:
            a, b = reference[i], result["losses"][i]
            print(f"  step {i + 1:>3}  {a:>10.6f}  {b:>10.6f}  |diff| {abs(a - b):.1e}")
        print(f"  largest |diff| over {len(reference)} steps {worst:.1e} (fp32 rounding "
              f"{'only' if worst < 1e-4 else 'EXCEEDED'})")
        print()
        one = _median_past(ref_s, WARMUP)
        print("\n".join(step_time_report(plan, cluster, source, record, cache, args.nproc, tmp,
                                                one)))
        print("\nnext: `autopar plan gpt2 --cluster 8xH100-80GB` plans a real model for a "
              "real cluster;\n      `autopar demo --nproc 4` uses more processes, "
              "`autopar plan --help` lists what can be pinned")
        if plan.world_size < args.nproc:
            print("      on a quieter machine, `autopar demo --remeasure` measures it again "
                  f"(the plan may then use all {args.nproc})")
    return 0 if worst < 1e-4 else 1


def step_time_report(plan: Plan, cluster: str, source: str, record: str, cache: Path,
                     nproc: int, tmp: str, single: tuple[float, str]) -> list[str]:
    """Predicted next to measured step time (both one step, past the warm-up), the
    single-device step measured the same way, and both once refitted to this run and that
    step (device speed and co-run slowdown apart: ``autopar.calibrate.corun_split``)."""
    try:
        run = read_run(record)
    except AutoparError as err:
        return [f"step time: predicted {plan.predicted['step_time_s'] * 1e3:.1f} ms (modelled, "
                f"planned with {source}); measured: nothing past the warm-up steps to compare "
                f"({err.fix or err.what})"]
    steps = list(run.fitted_steps)
    measured = run.measured_step_s()
    lines = ["step time, one step (median past the warm-up)",
             f"  predicted   {plan.predicted['step_time_s'] * 1e3:8.1f} ms   modelled, "
             f"planned with {source}",
             f"  measured    {measured * 1e3:8.1f} ms   measured, {plan.world_size} "
             f"process{'es' if plan.world_size > 1 else ''}, median of steps "
             f"{steps[0] + 1}-{steps[-1] + 1}",
             f"  one device  {single[0] * 1e3:8.1f} ms   measured, one process, median of "
             f"steps {single[1]}, the same batch ({single[0] / measured:.2f}x the plan's step)"]
    if plan.world_size > 1 and single[0] < measured:
        lines.append("  (one process is faster on this machine than the plan's processes, "
                     "which the model did not predict: the refit below corrects it)")
    try:
        fit = fit_runs([run])
    except AutoparError as err:
        return lines + [f"  (no refit: {err.what})"]
    split = split_corun(fit, run, one_process_prediction(cluster).predicted["step_time_s"],
                        single[0])
    fit = split or fit
    write_profile(refit_profile([run], fit), cache)
    refit_cluster, _ = demo_cluster(nproc, cache, tmp)
    again = pinned_prediction(plan, refit_cluster)
    error = (plan.predicted["step_time_s"] - measured) / measured
    after = (again.predicted["step_time_s"] - measured) / measured
    sizes = len({p.nbytes for p in fit.link_points})
    link = ("the link" if fit.link is not None else "no collective ran, link kept" if not sizes
            else f"link kept ({sizes} message size{'s' if sizes != 1 else ''} recorded)")
    what = f"device {fit.device_scale:.2f}x the plan's"
    if split is not None:
        what += (f", co-run slowdown {split.corun_slowdown:.2f} a further process (was "
                 f"{float(fit.base_device.get('corun_slowdown', 0.0)):.2f})")
    lines += [
        f"  refitted    {again.predicted['step_time_s'] * 1e3:8.1f} ms   modelled, same "
        f"configuration, refitted to this run{' and the one-process step' if split else ''}: "
        f"{what}; {link}",
        f"  error       {error:+8.1%} before the refit, {after:+.1%} after (predicted vs "
        "measured)",
    ]
    if split is not None:
        one = one_process_prediction(refit_cluster).predicted["step_time_s"]
        lines.append(f"  one device  {one * 1e3:8.1f} ms   modelled after the refit "
                     f"({(one - single[0]) / single[0]:+.1%} vs measured)")
    return lines + [f"refitted profile saved to {cache}; the next demo plans with it"]
