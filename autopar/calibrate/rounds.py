"""One device measured in several rounds spread over a calibration, and averaged.

Why: the project's 2-core VMs switch between a fast and a slow state every few seconds.
Measured on 2026-11-29 over 30 s of back-to-back samples (one thread):

| quantity | fast state | slow state |
|---|---:|---:|
| per-op floor under autograd | 6.2 µs (37% of samples) | 11.9 µs (57%) |
| 256 x 256 x 256 matmul | 406 µs | 500 µs |
| 4 MiB elementwise add | 291 µs | 361 µs |

A measurement of a few tens of milliseconds lands in one state, and the quantities of one
calibration, measured one after another, land in different ones: six quick calibrations
put the demo's predicted step anywhere from 50 to 68 ms, and the per-op floor alone from
6.5 to 14 µs. A training run of a few seconds sees the mixture. So :func:`measure_rounds`
measures the whole device ``rounds`` times, between the calibration's other phases, and
:func:`average_rounds` keeps each point's mean time: the expected time under the states the
rounds saw.

Only the device is measured in rounds: the collectives, the busy latency and the co-run
slowdown are measured by processes of their own, each already over repeats of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import fmean

from autopar.calibrate.collectives import CalibrationError
from autopar.calibrate.device_fit import DeviceCalibration

DEVICE_ROUNDS = 3
"""Rounds a CPU is measured in: at the start, after the collectives, and at the end of a
calibration (each adds ~8 s to a quick one on 2 cores). A GPU is measured once."""


def average_rounds(rounds: Sequence[DeviceCalibration]) -> DeviceCalibration:
    """The calibration whose every measured time is the mean over ``rounds`` (each must
    have measured the same points, as :func:`~autopar.calibrate.matmul.calibrate_device`
    does with the same arguments).

    >>> from autopar.calibrate.device_fit import BandwidthPoint, MatmulPoint
    >>> def cal(s):
    ...     return DeviceCalibration("cpu", 1, "fp32", (MatmulPoint(512, 512, 512, "fp32", s),),
    ...                              (BandwidthPoint(2**26, s),), kernel_floor_s=s / 1000)
    >>> average_rounds([cal(0.004), cal(0.006)]).matmuls[0].seconds
    0.005
    """
    if not rounds:
        raise CalibrationError("no device rounds were measured", where="calibrate rounds",
                               fix="measure the device at least once")
    first = rounds[0]
    if len(rounds) == 1:
        return first
    shapes = [[(p.m, p.k, p.n, p.dtype, p.skinny) for p in r.matmuls] for r in rounds]
    sizes = [[p.tensor_bytes for p in r.bandwidth] for r in rounds]
    attention = [[(p.batch, p.heads, p.seq, p.head_dim, p.dtype) for p in r.attention]
                 for r in rounds]
    ops = [sorted(r.op_rates) for r in rounds]
    if any(x != y[0] for y in (shapes, sizes, attention, ops) for x in y[1:]):
        raise CalibrationError("the device rounds measured different points",
                               where="calibrate rounds",
                               fix="measure every round with the same arguments")
    return DeviceCalibration(
        device_type=first.device_type,
        threads=first.threads,
        curve_dtype=first.curve_dtype,
        matmuls=tuple(replace(p, seconds=fmean(r.matmuls[i].seconds for r in rounds))
                      for i, p in enumerate(first.matmuls)),
        bandwidth=tuple(replace(p, seconds=fmean(r.bandwidth[i].seconds for r in rounds))
                        for i, p in enumerate(first.bandwidth)),
        kernel_floor_s=fmean(r.kernel_floor_s for r in rounds),
        allocation_s_per_byte=fmean(r.allocation_s_per_byte for r in rounds),
        attention=tuple(replace(p, forward_s=fmean(r.attention[i].forward_s for r in rounds),
                                forward_backward_s=fmean(r.attention[i].forward_backward_s
                                                         for r in rounds))
                        for i, p in enumerate(first.attention)),
        op_rates={op: (fmean(r.op_rates[op][0] for r in rounds),
                       fmean(r.op_rates[op][1] for r in rounds)) for op in first.op_rates},
        view_s=fmean(r.view_s for r in rounds),
    )
