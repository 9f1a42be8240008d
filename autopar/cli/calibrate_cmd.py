"""``autopar calibrate``: measure this machine, print what was measured, write a profile.

    autopar calibrate --quick --out cpu-profile.json     # about 80 s on 2 cores
    autopar calibrate --out cpu-profile.json --nproc 4   # a few minutes
    autopar calibrate --device cuda --nproc 8 --out h100-profile.json
    autopar calibrate --from-run runs/today --out cpu-profile.json   # refit from training

Every number printed here is measured (or fitted to measurements, and labelled so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from autopar.calibrate import (
    KINDS,
    LINK_KIND,
    CalibrationError,
    CollectivePoint,
    DeviceCalibration,
    calibrate_device,
    fit_link,
    format_sharded_host,
    host_info,
    make_profile,
    measure_busy_latency,
    measure_collectives,
    measure_corun,
    measure_sharded_host,
)
from autopar.calibrate.rounds import DEVICE_ROUNDS, average_rounds
from autopar.core.cluster.compute_share import usable_cores
from autopar.core.cluster.profile import Profile, write_profile
from autopar.core.units import format_bytes, format_seconds


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure the device and the collectives, print both tables, write ``args.out``."""
    if getattr(args, "from_run", None):
        return run_calibrate_from_run(args.from_run, args.out)
    device_type = getattr(args, "device", "cpu") or "cpu"
    threads = getattr(args, "threads", None) or 1
    quick = bool(getattr(args, "quick", False))
    _check_args(device_type, args.nproc, Path(args.out))
    host = host_info(device_type, args.nproc, threads, quick)
    start = time.perf_counter()
    print(
        f"autopar calibrate: {device_type} ({host['device_name']}), {threads} thread"
        f"{'s' if threads > 1 else ''} per process, {args.nproc} {host['backend']} processes"
        f"{', quick' if quick else ''}\n",
        flush=True,
    )
    profile = measure_profile(device_type, args.nproc, host, threads=threads, quick=quick,
                              default_dtype_only=bool(getattr(args, "default_dtype_only",
                                                              False)))
    path = write_profile(profile, args.out)
    print(
        f"\nwrote {path} in {time.perf_counter() - start:.0f} s; a cluster file uses it with "
        f"'profile: {path}'"
    )
    return 0


def measure_profile(device_type: str, nproc: int, host: dict, *, threads: int = 1,
                    quick: bool = False, default_dtype_only: bool = False,
                    say: Callable[[str], None] = lambda text: print(text, flush=True),
                    progress: Callable[[str], None] | None = None) -> Profile:
    """Measure this machine as ``autopar calibrate`` does; ``say`` gets each table (all
    measured), ``progress`` each phase's name. ``autopar demo`` calls it on a machine it has
    no profile for, with ``default_dtype_only`` (the 16-bit matmuls of a CPU take minutes)."""
    progress = progress or _progress
    # one process: the speed of a process computing alone; what the others computing beside
    # it cost is measured on training steps below (microbenchmarks run together miss most
    # of it, and processes outnumbering the cores would count the time-slicing twice). A
    # CPU is measured in rounds between the other phases, averaged (autopar.calibrate.rounds)
    rounds: list[DeviceCalibration] = []
    count = DEVICE_ROUNDS if device_type == "cpu" else 1

    def device_round() -> None:
        if len(rounds) < count:
            progress(f"the device (round {len(rounds) + 1} of {count})")
            rounds.append(calibrate_device(device_type, quick=quick, threads=threads,
                                           default_dtype_only=default_dtype_only))

    device_round()
    progress(f"collectives ({nproc} processes)")
    points = measure_collectives(nproc, device_type=device_type, quick=quick, threads=threads)
    device_round()
    say(format_collectives(points))
    busy = corun = sharded = None
    cores = usable_cores()
    if device_type == "cpu":
        progress(f"busy latency ({nproc} computing processes)")
        busy = measure_busy_latency(nproc, threads=threads, quick=quick)
        say(f"\nbusy latency (measured: a 16 KiB message while every process computes, "
            f"less the same on idle processes)\n  {busy['busy_latency_s'] * 1e6:.0f} µs per "
            "asynchronous message (DDP bucket, FSDP gather, pipeline send)")
        at_once = min(nproc, cores)
        if at_once >= 2:
            progress(f"co-run slowdown ({at_once} processes training at once, one per core)")
            corun = measure_corun(at_once, threads=threads, quick=quick)
            say(format_corun(corun))
            progress(f"FSDP2 host work ({at_once} processes)")
            sharded = measure_sharded_host(at_once, threads=threads, quick=quick)
            say(format_sharded_host(sharded))
    uncontended = None
    if device_type == "cpu" and 2 <= cores < nproc:
        # gloo is slower while processes outnumber cores; a plan on at most `cores` of them
        # (autopar may use fewer devices) runs on this link instead
        progress(f"collectives and busy latency again with {cores} processes (one per core)")
        few = measure_collectives(cores, device_type=device_type, quick=quick, threads=threads)
        few_busy = measure_busy_latency(cores, threads=threads, quick=quick)
        fit = fit_link(p for p in few if p.kind == LINK_KIND)
        say(f"\nwith {cores} processes (one per core; fitted to the measured all-reduce): "
            f"{fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s, latency {fit.latency_s * 1e6:.0f} µs, "
            f"busy latency {few_busy['busy_latency_s'] * 1e6:.0f} µs")
        uncontended = (few, few_busy)
    while len(rounds) < count:
        device_round()
    device = average_rounds(rounds)
    say(format_device(device))
    return make_profile(device, points, host, busy, uncontended, corun, sharded)


def format_corun(corun: dict) -> str:
    """The co-run slowdown, with the step times it came from (measured)."""
    samples = corun["samples"]
    ratios = sorted(s["together_s"] / s["alone_s"] for s in samples)
    return (f"\nco-run slowdown (measured: a small transformer's training step with "
            f"{corun['processes']} processes training at once vs each alone, {len(samples)} "
            f"alternating samples)\n  together / alone: median {statistics.median(ratios):.2f}"
            f" (range {ratios[0]:.2f}-{ratios[-1]:.2f}); {corun['corun_slowdown']:.3f} of a "
            "step per further process computing")


def run_calibrate_from_run(directories: Sequence[str], out: str | Path) -> int:
    """Refit the profile from recorded runs, print the fit, write ``out``."""
    from autopar.calibrate.from_run import fit_runs, format_fit, read_run, refit_profile

    out = Path(out)
    if out.is_dir():
        raise CalibrationError(f"--out {out} is a directory", where="--out",
                               fix=f"name a file, e.g. --out {out / 'profile.json'}")
    runs = [read_run(d) for d in directories]
    fit = fit_runs(runs)
    print(f"autopar calibrate --from-run: {len(runs)} run(s)\n")
    print(format_fit(runs, fit))
    path = write_profile(refit_profile(runs, fit), out)
    print(f"\nwrote {path}; a cluster file uses it with 'profile: {path}'")
    return 0


def _check_args(device_type: str, nproc: int, out: Path) -> None:
    """Fail before measuring for a minute, not after."""
    if nproc < 2:
        raise CalibrationError(
            f"collectives need at least 2 processes, got --nproc {nproc}",
            where="--nproc",
            fix="use --nproc 2 or more",
        )
    if out.is_dir():
        raise CalibrationError(
            f"--out {out} is a directory",
            where="--out",
            fix=f"name a file, e.g. --out {out / 'profile.json'}",
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CalibrationError(
            f"cannot create the folder for --out {out}: {err}",
            where="--out",
            fix="write the profile somewhere writable",
        ) from None
    if device_type != "cuda":
        return
    if not torch.cuda.is_available():
        raise CalibrationError(
            "--device cuda, but torch sees no CUDA device",
            where="--device",
            fix="calibrate on a GPU machine with a CUDA build of torch, or use --device cpu",
        )
    if nproc > torch.cuda.device_count():
        raise CalibrationError(
            f"--nproc {nproc} is more than the {torch.cuda.device_count()} GPUs here",
            where="--nproc",
            fix=f"use --nproc {torch.cuda.device_count()} or fewer",
        )


def _progress(what: str) -> None:
    print(f"  measuring {what} ...", file=sys.stderr, flush=True)


def format_device(device: DeviceCalibration) -> str:
    """Matmul points, elementwise points and the resulting device numbers (all measured)."""
    floor = device.kernel_floor_s
    lines = [
        f"kernel floor (measured: tiny ops under autograd) {floor * 1e6:.2f} µs; 'busy' below is the "
        + ("time net of it" if device.net_floor_s else
           "whole time (a GPU launches the next kernel while one runs)"),
        "",
    ]
    for dtype in device.peak_flops:
        lines.append(f"matmul {dtype} (measured; efficiency = busy GFLOP/s / the best)")
        lines.append(
            f"  {'m x k x n':<18} {'FLOP':>7} {'time':>10} {'GFLOP/s':>8} {'efficiency':>10}"
        )
        for p in device.matmuls:
            if p.dtype != dtype:
                continue
            mark = ""
            rate, eff = (f"{p.rate(device.net_floor_s) / 1e9:>8.1f}",
                         f"{device.efficiency(p):>10.2f}")
            if p.skinny:
                mark = "  skinny: fits the memory overlap, not the curve"
            elif not p.in_curve(floor):  # its time net of the floor is noise: no rate
                mark = "  under 2x the floor: not in the curve"
                rate, eff = f"{'-':>8}", f"{'-':>10}"
            lines.append(
                f"  {f'{p.m} x {p.k} x {p.n}':<18} {_si(p.flops):>7} {format_seconds(p.seconds):>10}"
                f" {rate} {eff}{mark}"
            )
        lines.append("")
    lines.append("elementwise out-of-place add (measured; bytes = 2 reads + 1 write)")
    lines.append(f"  {'tensor':<10} {'time':>10} {'GB/s':>8}")
    for b in device.bandwidth:
        lines.append(
            f"  {format_bytes(b.tensor_bytes):<10} {format_seconds(b.seconds):>10} {b.rate(device.net_floor_s) / 1e9:>8.1f}"
        )
    if device.attention:
        lines += ["", "fused attention, causal SDPA (measured; efficiency = the time the matmul "
                  "curve gives the FLOPs run / busy time)"]
        lines.append(f"  {'b x h x seq x d':<20} {'dtype':<5} {'forward':>10} {'backward':>10}"
                     f" {'efficiency fwd, bwd':>20}")
        for p in device.attention:
            if p.dtype not in device.peak_flops:
                continue
            fwd, bwd = device.attention_pass_efficiency(p)
            lines.append(
                f"  {f'{p.batch} x {p.heads} x {p.seq} x {p.head_dim}':<20} {p.dtype:<5} "
                f"{format_seconds(p.forward_s):>10} {format_seconds(p.backward_s):>10} "
                f"{f'{fwd:.2f}, {bwd:.2f}':>20}"
            )
    if device.view_s:
        lines += ["", f"op without a kernel (measured: a view or transpose under autograd, per "
                  f"pass) {device.view_s * 1e6:.2f} µs"]
    if device.op_rates:
        bandwidth = device.memory_bandwidth_bytes_per_s
        lines += ["", "ops inside a training step (measured; per output element, net of the "
                  "floor; the roofline's is 8 bytes / bandwidth)"]
        lines.append(f"  {'op':<12} {'forward':>10} {'backward':>10}")
        lines += [f"  {op:<12} {fwd * 1e9:>7.2f} ns {bwd * 1e9:>7.2f} ns"
                  for op, (fwd, bwd) in device.op_rates.items()]
        lines.append(f"  {'(roofline)':<12} {8 / bandwidth * 1e9:>7.2f} ns "
                     f"{16 / bandwidth * 1e9:>7.2f} ns")
    curve = device.matmul_efficiency_curve
    lines += [
        "",
        "device (measured; written to the profile)",
        *(
            f"  {'peak ' + dtype:<20} {flops / 1e9:>9.1f} GFLOP/s  best busy matmul rate, net "
            "of the traffic left apart"
            for dtype, flops in device.peak_flops.items()
        ),
        f"  {'matmul efficiency':<20} {curve[-1][1]:>9.2f}          at the largest size",
        f"  {'matmul curve':<20} {len(curve):>9d} points   {_si(curve[0][0])}-"
        f"{_si(curve[-1][0])} FLOP, {device.curve_dtype}",
        f"  {'memory bandwidth':<20} {device.memory_bandwidth_bytes_per_s / 1e9:>9.1f} GB/s     "
        "median over sizes; memory efficiency 1.0",
        f"  {'kernel floor':<20} {floor * 1e6:>9.2f} µs",
        f"  {'memory overlap':<20} {device.memory_overlap:>9.2f}          of a matmul's traffic "
        "hidden under its arithmetic (skinny matmuls; 1 on GPUs: the roofline)",
    ]
    if device.attention_efficiency is not None:
        lines.append(f"  {'attention efficiency':<20} {device.attention_efficiency:>9.2f}          "
                     "of the matmul rate, forward and backward together")
    if len(device.attention_efficiency_curve) > 1:
        points = ", ".join(f"{e:.2f} at {_si(f)}" for f, e in device.attention_efficiency_curve)
        lines.append(f"  {'attention curve':<20} {points} FLOP (score matmul per call)")
    return "\n".join(lines)


def format_collectives(points: Sequence[CollectivePoint]) -> str:
    """Each measured collective, the link fitted to the all-reduces, and per-kind fits."""
    link = fit_link(p for p in points if p.kind == LINK_KIND)
    n = points[0].world_size
    lines = [
        "",
        f"collectives over {n} processes (measured; bus bandwidth as nccl-tests counts it;",
        "'link' is how far the fitted link's ring-model time is from the measured one)",
        f"  {'collective':<15} {'size':>8} {'time':>10} {'bus GB/s':>9} {'link':>9}",
    ]
    for p in sorted(points, key=lambda p: (KINDS.index(p.kind), p.nbytes)):
        predicted = link.predict(p.kind, p.nbytes, p.world_size)
        lines.append(
            f"  {p.kind:<15} {format_bytes(p.nbytes):>8} {format_seconds(p.seconds):>10} "
            f"{p.bus_bandwidth / 1e9:>9.3f} {(predicted - p.seconds) / p.seconds:>+9.0%}"
        )
    per_kind = []
    for kind in KINDS:
        own = [p for p in points if p.kind == kind]
        if len({p.nbytes for p in own}) >= 2:
            fit = fit_link(own)
            per_kind.append(
                f"  {kind:<15} {fit.latency_s * 1e6:>8.1f} µs {fit.bandwidth_bytes_per_s / 1e9:>8.3f}"
                f" GB/s  median error {fit.median_error:.0%}"
            )
    lines += [
        "",
        f"intra-node link (fitted to the {link.points} {LINK_KIND} points; written to the profile)",
        f"  {'latency':<15} {link.latency_s * 1e6:>8.1f} µs",
        f"  {'bus bandwidth':<15} {link.bandwidth_bytes_per_s / 1e9:>8.3f} GB/s",
        f"  {'fit error':<15} {link.median_error:>8.0%} median, {link.max_error:.0%} worst",
        "fitted per collective (recorded in the profile's measurements)",
        *per_kind,
    ]
    return "\n".join(lines)


def _si(x: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


