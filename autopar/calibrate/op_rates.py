"""Measure what elementwise and normalization ops cost per element where their arithmetic,
not their memory traffic, bounds them: the device's ``op_s_per_element``.

The roofline prices an op without FLOPs (``FlopCounterMode`` counts none for GELU, softmax
or a norm) by its bytes alone. On a GPU that holds: warps hide an erf under the memory
system. On a CPU core it does not: GELU's erf, softmax's exponentials, a norm's reductions
and their backwards run longer per element than an add, which is what the bandwidth is
measured on. And they run slower inside a training step than alone: on the 2-core VM GELU
took 3.0-3.3 ns an element inside the demo GPT's step and 1.4-1.6 ns timed alone on the same
tensors, at every batch from 2 to 8 (measured, ``torch.profiler``), with matmuls between
them as in a model.

So calibration measures them where a model runs them: a training step of a chain of
``Linear -> op`` blocks on a ``rows x WIDTH`` activation, each op's forward in a profiler
range and its backward found by autograd's sequence numbers (the backward nodes its forward
recorded), medians over steps. Seconds per output element, net of the kernel floor the cost
model charges once per pass (:func:`autopar.cost_models.compute.arithmetic_times`)::

    forward  = (t_forward - floor) / elements
    backward = (t_backward - floor) / elements

An op's cost is then the larger of these and the roofline's, so an op whose traffic
dominates (a large tensor out of cache) keeps its memory time. Ops are keyed by aten name,
as traced graphs call them (``aten.gelu.default`` -> ``gelu``). Measured on CPU only: a
GPU's host launches the next kernel while this one runs, and its profile leaves the table
empty.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from autopar.calibrate.timing import time_call

WIDTH = 1024
"""The last dim the ops run over (a hidden size): softmax and the norms reduce along it."""

_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # aten name -> the call a model makes (``weight`` is a (WIDTH,) affine weight)
    # a bias broadcast into a fresh output, as a Linear's addmm writes one before its GEMM
    # accumulates (forward), and summed over rows into the bias's gradient (backward)
    "add": lambda x, w: x + w,
    "gelu": lambda x, w: F.gelu(x),
    "silu": lambda x, w: F.silu(x),
    "tanh": lambda x, w: torch.tanh(x),
    "sigmoid": lambda x, w: torch.sigmoid(x),
    "softmax": lambda x, w: torch.softmax(x, -1),
    "log_softmax": lambda x, w: torch.log_softmax(x, -1),
    "layer_norm": lambda x, w: F.layer_norm(x, (WIDTH,), w, w),
    "rms_norm": lambda x, w: F.rms_norm(x, (WIDTH,), w),
}
OPS = tuple(_OPS)


def measure_op_rates(
    device: torch.device, floor: float, *, steps: int = 7, rows: int = 256,
) -> dict[str, tuple[float, float]]:
    """Op name -> (forward, backward) seconds per output element on ``device``, measured in
    a training step (module docstring); each at least 0."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    linears = [torch.nn.Linear(WIDTH, WIDTH).to(device) for _ in _OPS]
    weight = torch.ones(WIDTH, device=device, requires_grad=True)
    x = torch.randn(rows, WIDTH, generator=gen).to(device)

    def step() -> None:
        h = x
        for (name, op), linear in zip(_OPS.items(), linears):
            h = linear(h)
            with record_function(f"op::{name}"):
                h = op(h, weight)
        h.sum().backward()
        for linear in linears:
            linear.zero_grad(set_to_none=True)
        weight.grad = None

    for _ in range(2):
        step()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in _OPS}
    for _ in range(steps):
        with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        for name, times in profiled_passes(prof.events(), "op::")[0].items():
            samples[name].append(tuple(times))
    elements = rows * WIDTH
    return {name: tuple(max(statistics.median(t[i] for t in got) - floor, 0.0) / elements
                        for i in (0, 1))
            for name, got in samples.items() if got}


@contextmanager
def _kineto_quiet() -> Iterator[None]:
    """The profiler's own log lines (``USDT: ... profiler_start`` / ``profiler_stop``, on
    stderr at every start and stop: 42 lines in a first ``autopar demo``) off while
    calibration profiles, unless the user set ``KINETO_LOG_LEVEL``: 6 is past kineto's
    highest level (with torch 2.13, 5 still prints the USDT lines and 6 nothing)."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        del os.environ["KINETO_LOG_LEVEL"]


def measure_view_seconds(device: torch.device, *, repeats: int, ops: int = 64) -> float:
    """Seconds per pass of an op that runs no kernel: a chain of ``ops`` views and
    transposes of a small tensor, forward and backward under autograd, over the passes
    (each op's forward and its backward node), as ``_training_floor`` times tiny kernels."""
    x = torch.ones(4, 8, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for i in range(ops // 2):
            y = y.view(8, 4) if i % 2 == 0 else y.view(4, 8)
            y = y.t()
        y.sum().backward()

    return time_call(step, device, repeats=repeats) / (2 * ops)


def profiled_passes(events, prefix: str) -> tuple[dict[str, list[float]], float]:
    """Charge one profiled step's time to ranges named ``prefix + name``: each range's own
    time as its forward, and as its backward the autograd nodes recorded under it (by the
    sequence numbers of the ops it ran). Returns ``{name: [forward_s, backward_s]}`` and the
    backward seconds no range owns (the engine's own nodes, gradient accumulation)."""
    owner: dict[int, str] = {}
    out: dict[str, list[float]] = {}
    for event in events:
        if not event.name.startswith(prefix):
            continue
        name = event.name[len(prefix):]
        out.setdefault(name, [0.0, 0.0])[0] += event.cpu_time_total / 1e6
        stack = list(event.cpu_children)
        while stack:
            child = stack.pop()
            if getattr(child, "sequence_nr", -1) >= 0:
                owner.setdefault(child.sequence_nr, name)
            stack.extend(child.cpu_children)
    unowned = 0.0
    for event in events:
        if event.name.startswith("autograd::engine::evaluate_function") and (
                event.cpu_parent is None):
            name = owner.get(event.sequence_nr)
            if name is None:
                unowned += event.cpu_time_total / 1e6
            else:
                out[name][1] += event.cpu_time_total / 1e6
    return out, unowned
