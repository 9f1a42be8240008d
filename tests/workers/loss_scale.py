"""fp16 dynamic loss scaling under autopar, with an overflow forced on one rank.

Run by ``tests/test_loss_scale_runtime.py`` under torchrun::

    torchrun --nproc-per-node 2 tests/workers/loss_scale.py --case '{"tp": 2}'

Both sides train GPT with fp16 autocast semantics (autopar: ``precision="fp16"``; the
reference: one process, ``torch.autocast("cpu", torch.float16)`` and
``torch.amp.GradScaler``). At step ``overflow`` the last rank's gradient of one parameter is
made inf (on the reference: the same parameter's). Each rank records, per step, the loss,
whether the step was skipped, the scale, and digests of its parameters and optimizer state.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import build, serve_cases  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.parallel_module import find_loss  # noqa: E402

STEPS = 6
CONFIG = {"init_scale": 2.0 ** 10, "growth_interval": 3}


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _state(opt: torch.optim.Optimizer) -> list:
    return [v for state in opt.state.values() for _, v in sorted(state.items())]


def _poison(param: torch.nn.Parameter):
    return param.register_hook(lambda g: torch.full_like(g, float("inf")))


def _poison_layer(pm):
    """FSDP2 computes gradients on gathered parameters, past hooks on the sharded ones: make
    the gradient flowing into the last layer inf on this rank instead."""
    layer = pm._program.get_submodule("transformer.h.1")
    return layer.register_full_backward_pre_hook(
        lambda module, grads: tuple(torch.full_like(g, float("inf")) for g in grads))


def reference(model, args, kwargs, overflow: int) -> tuple[list[float], list[float], list[bool]]:
    ref = copy.deepcopy(model)
    opt = _optimizer(ref.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=CONFIG["init_scale"],
                                  growth_interval=CONFIG["growth_interval"])
    losses, scales, skipped = [], [], []
    target = dict(ref.named_parameters())["transformer.h.0.mlp.c_fc.weight"]
    for step in range(STEPS):
        opt.zero_grad()
        hook = _poison(target) if step == overflow else None
        with torch.autocast("cpu", dtype=torch.float16):
            loss = find_loss(ref(*args, **kwargs))
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if hook is not None:
            hook.remove()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        skipped.append(scaler.get_scale() < before)
    return losses, scales, skipped


def run_case(case: dict) -> dict:
    overflow = case.get("overflow", 2)
    model, (a, k) = build("gpt", 2)
    ref_losses, ref_scales, ref_skipped = reference(model, a, k, overflow)
    world = int(os.environ.get("WORLD_SIZE", 1))
    pm = autopar.parallelize(model, f"{world}xcpu", (a, k), precision="fp16",
                             recompute=("none",), loss_scale=autopar.LossScaleConfig(**CONFIG),
                             **{key: v for key, v in case.items()
                                if key not in ("overflow", "direct")})
    la, lk = pm.shard_batch(*a, **k)
    opt = _optimizer(pm.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    target = next(p for n, p in pm.named_parameters() if "mlp.c_fc.weight" in n)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        before = (_digest(pm.parameters()), _digest(_state(opt)))
        hook = None
        if step == overflow and rank == world - 1:
            hook = _poison_layer(pm) if case.get("zero") == 3 else _poison(target)
        loss = pm.train_step(*la, **lk).item()
        if hook is not None:
            hook.remove()
        if case.get("direct"):  # the user's own optimizer.step(): dropped gradients
            opt.step()         # make it a no-op on an overflowed step
            ran = None
        else:
            ran = pm.step(opt)
        after = (_digest(pm.parameters()), _digest(_state(opt)))
        steps.append({"loss": loss, "scale": pm.loss_scale, "skipped": pm.last_step_skipped,
                      "ran": ran, "unchanged": before == after})
    return {"case": case, "rank": rank, "steps": steps, "skipped_steps": pm.skipped_steps,
            "reference": {"losses": ref_losses, "scales": ref_scales, "skipped": ref_skipped},
            "ok": True}


if __name__ == "__main__":
    serve_cases(run_case)
