"""Plans that use fewer devices than were launched: train them and compare with one device.

    torchrun --nproc-per-node 2 tests/workers/fewer_devices.py \
        --case '{"model": "gpt", "cluster": "tests/clusters/cpu-slow-links.yaml"}'

A case is ``build`` arguments plus ``autopar.parallelize`` keywords; ``cluster`` is a file
used as is (not resized). Ranks the plan uses are checked like the equivalence tests (every
loss, every gradient); idle ranks must return the same losses and leave every parameter
without a gradient and unchanged. Every rank records its steps (``pm.record_run``): the run
read back must be one of the plan's ranks only (an idle rank records nothing). Each rank
writes ``rank<r>.json`` into ``$AUTOPAR_TEST_OUT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import build, serve_cases  # noqa: E402
from grad_check import compare, make_optimizer, train_parallel, train_reference  # noqa: E402

import autopar  # noqa: E402
from autopar.calibrate.run_files import read_run  # noqa: E402

STEPS = 3


def _norm_problems(norms: list[float], ref_norms: list[float]) -> list[str]:
    """Each step's clipped-by norm against one device's (none when the case does not clip)."""
    if len(norms) != len(ref_norms):
        return [f"{len(norms)} gradient norms for {len(ref_norms)} steps"]
    return [f"step {i + 1}: gradient norm {x} != {y}" for i, (x, y) in
            enumerate(zip(norms, ref_norms)) if abs(x - y) > 1e-5 * abs(y)]


def run_case(case: dict) -> dict:
    model, (a, k) = build(case["model"], case.get("layers", 2), case.get("tied"))
    clip, ref_norms, norms = case.get("clip"), [], []  # gradients clipped to this norm
    reference, ref_losses, ref_grads = train_reference(model, a, k, STEPS, clip=clip,
                                                       norms=ref_norms)
    options = {key: v for key, v in case.items() if key not in ("model", "layers", "tied",
                                                                  "cluster", "clip")}
    options.setdefault("recompute", ("none",))
    cluster = case.get("cluster") or f"{os.environ['WORLD_SIZE']}xcpu"
    pm = autopar.parallelize(model, cluster, (a, k), **options)
    rank = dist.get_rank()
    record = {"case": case, "rank": rank, "mesh": pm.plan.mesh,
              "used": pm.plan.world_size, "explanation": pm.plan.explanation.get("devices"),
              "active": getattr(pm, "active", True), "reference": ref_losses}
    la, lk = pm.shard_batch(*a, **k)
    name = hashlib.sha1(json.dumps(case, sort_keys=True).encode()).hexdigest()[:10]
    run_dir = Path(os.environ["AUTOPAR_TEST_OUT"]) / f"run-{name}"
    if record["active"]:
        with pm.record_run(run_dir):
            losses, grads = train_parallel(pm, la, lk, STEPS, clip=clip, norms=norms)
        result = compare(pm, reference, losses, ref_losses, grads, ref_grads, rtol=1e-5)
        result.problems += _norm_problems(norms, ref_norms)
        dist.barrier()  # every rank's file written
        if rank == 0:
            run = read_run(run_dir)
            record["run_ranks"] = [r.rank for r in run.ranks]
            record["run_world"] = run.world_size
        return {**record, "losses": losses, **result.to_dict()}
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt = make_optimizer(pm.parameters())
    losses, problems = [], []
    with pm.record_run(run_dir):  # nothing to record here
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(pm.train_step(*la, **lk).item())
            problems += [f"{n} has a gradient" for n, p in pm.named_parameters()
                         if p.grad is not None]
            if clip is not None:  # takes part in the training ranks' norm, and reads it
                norms.append(pm.clip_grad_norm_(clip).item())
            opt.step()
    dist.barrier()
    problems += [f"{n} changed" for n, p in pm.named_parameters()
                 if not torch.equal(p, before[n])]
    problems += _norm_problems(norms, ref_norms)
    losses_ok = all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, ref_losses))
    if not losses_ok:
        problems.append(f"losses {losses} != reference {ref_losses}")
    return {**record, "losses": losses, "ok": not problems and bool(before),
            "problems": problems}


if __name__ == "__main__":
    serve_cases(run_case)
