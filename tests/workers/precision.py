"""Mixed-precision training under autopar against single-device ``torch.autocast``.

Run by ``tests/test_precision_runtime.py`` under torchrun, one launch for many cases::

    torchrun --nproc-per-node 2 tests/workers/precision.py \
        --case '{"model": "gpt", "dp": 2, "precision": "bf16"}'

Each case trains ``steps`` steps (AdamW on both sides) and records every loss of both runs,
the dtypes of the parameters the optimizer steps, and how many casts the rank program shows.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import build, cluster_for, serve_cases  # noqa: E402

import autopar  # noqa: E402
from autopar.calibrate.live_bytes import LiveBytes  # noqa: E402
from autopar.ops import step_copies  # noqa: E402
from autopar.runtime.parallel_module import find_loss  # noqa: E402

MODEL_KEYS = ("model", "layers", "tied", "steps", "rtol", "cluster", "memory")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def reference_losses(model, args, kwargs, steps: int, precision: str) -> list[float]:
    """Single-device training under ``torch.autocast("cpu", dtype)``."""
    ref = copy.deepcopy(model)
    opt = _optimizer(ref.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=AUTOCAST[precision]):
            loss = find_loss(ref(*args, **kwargs))
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_dot_product")


class MatmulDtypes(TorchDispatchMode):
    """Counts the matmul kernels run, by the dtype of their first input."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(MATMULS) and args and isinstance(args[0], torch.Tensor):
            key = str(args[0].dtype)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def run_case(case: dict) -> dict:
    steps = case.get("steps", 20)
    model, (a, k) = build(case["model"], case.get("layers", 2), case.get("tied"))
    ref = reference_losses(model, a, k, steps, case["precision"])
    options = {key: v for key, v in case.items() if key not in MODEL_KEYS}
    options.setdefault("recompute", ("none",))
    if isinstance(options["recompute"], str):
        options["recompute"] = (options["recompute"],)
    world = int(os.environ.get("WORLD_SIZE", 1))
    pm = autopar.parallelize(model, cluster_for(case.get("cluster"), world), (a, k), **options)
    la, lk = pm.shard_batch(*a, **k)
    opt = _optimizer(pm.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*la, **lk).item())
        opt.step()
    with MatmulDtypes() as seen:  # one more step: which dtypes the kernels compute in
        pm.train_step(*la, **lk)
    memory = _step_memory(pm, opt, la, lk) if case.get("memory") else None
    stepped = sorted({str(p.dtype) for group in opt.param_groups for p in group["params"]})
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses, ref))
    rtol = case.get("rtol", 1e-2)
    code = pm.code
    return {"case": case, "rank": dist.get_rank() if dist.is_initialized() else 0,
            "losses": losses, "reference": ref, "worst_rel": worst,
            "param_dtypes": stepped, "zero": pm.plan.training["zero"],
            "params_word": pm.plan.precision_policy["params"],
            "matmul_dtypes": seen.counts,
            "casts": code.count("cast_to(") + code.count("cast_weight("), "bf16_casts": code.count("torch.bfloat16"),
            "precision_counts": _counts(pm.plan.precision),
            "sharded": sum(1 for ax in pm.plan.params.values() if ax.get("tp", "R") != "R"),
            "memory": memory, "ok": worst <= rtol and stepped == ["torch.float32"]}


def _step_memory(pm, opt, la, lk) -> dict:
    """This rank's measured peak of one training step (every tensor it made: activations,
    weight copies, gradients, temporaries; ``autopar.calibrate.live_bytes``) and the plan's
    prediction of the same: its stage's (a pipeline's) or the rank's peak, less what was made
    before the step (the optimizer states and, unless FSDP2 gathers them each step (ZeRO
    1-3), the weights)."""
    opt.zero_grad(set_to_none=True)  # the step makes its gradients
    gc.collect()
    with LiveBytes() as live:
        pm.train_step(*la, **lk)
    if pm.plan.mesh.get("pp", 1) > 1:
        stage = pm.plan.pipeline["stages"][pm.mesh_context.coords.get("pp", 0)]
        memory, phases, in_flight = stage["memory"], stage["memory_phases"], stage["in_flight"]
    else:
        predicted = pm.plan.predicted
        memory, phases, in_flight = predicted["memory"], predicted["memory_phases"], 1
    gathered = pm.plan.training["zero"] in (1, 2)  # whole weights FSDP2 gathers in the step
    before = memory["optimizer"] + (0 if gathered else memory["params"])
    step = max(b for phase, b in phases.items() if phase != "optimizer_step")
    out = {"measured": live.peak, "predicted": step - before, "in_flight": in_flight,
           "breakdown": memory, "phases": phases}
    # the same step with a copy per use (as torch.autocast makes them), for comparison
    cls = step_copies.one_weight_copy_per_step
    enter, cls.__enter__ = cls.__enter__, lambda self: self
    try:
        opt.zero_grad(set_to_none=True)
        gc.collect()
        with LiveBytes() as live:
            pm.train_step(*la, **lk)
    finally:
        cls.__enter__ = enter
    out["per_use"] = live.peak
    return out


def _counts(words: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in words.values():
        out[w] = out.get(w, 0) + 1
    return out


if __name__ == "__main__":
    serve_cases(run_case)
