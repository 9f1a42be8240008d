"""Plans that use fewer devices than were launched: train them and compare with one device.

    torchrun --nproc-per-node 2 tests/workers/fewer_devices.py \
        --case '{"model": "gpt", "cluster": "tests/clusters/cpu-slow-links.yaml"}'

A case is ``build`` arguments plus ``autopar.parallelize`` keywords; ``cluster`` is a file
used as is (not resized). Ranks the plan uses are checked like the equivalence tests (every
loss, every gradient); idle ranks must return the same losses and leave every parameter
without a gradient and unchanged. Each rank writes ``rank<r>.json`` into ``$AUTOPAR_TEST_OUT``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import build, serve_cases  # noqa: E402
from grad_check import compare, make_optimizer, train_parallel, train_reference  # noqa: E402

import autopar  # noqa: E402

STEPS = 3


def run_case(case: dict) -> dict:
    model, (a, k) = build(case["model"], case.get("layers", 2), case.get("tied"))
    reference, ref_losses, ref_grads = train_reference(model, a, k, STEPS)
    options = {key: v for key, v in case.items() if key not in ("model", "layers", "tied",
                                                                  "cluster")}
    options.setdefault("recompute", ("none",))
    cluster = case.get("cluster") or f"{os.environ['WORLD_SIZE']}xcpu"
    pm = autopar.parallelize(model, cluster, (a, k), **options)
    rank = dist.get_rank()
    record = {"case": case, "rank": rank, "mesh": pm.plan.mesh,
              "used": pm.plan.world_size, "explanation": pm.plan.explanation.get("devices"),
              "active": getattr(pm, "active", True), "reference": ref_losses}
    la, lk = pm.shard_batch(*a, **k)
    if record["active"]:
        losses, grads = train_parallel(pm, la, lk, STEPS)
        result = compare(pm, reference, losses, ref_losses, grads, ref_grads, rtol=1e-5)
        return {**record, "losses": losses, **result.to_dict()}
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt = make_optimizer(pm.parameters())
    losses, problems = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pm.train_step(*la, **lk).item())
        problems += [f"{n} has a gradient" for n, p in pm.named_parameters()
                     if p.grad is not None]
        opt.step()
    problems += [f"{n} changed" for n, p in pm.named_parameters()
                 if not torch.equal(p, before[n])]
    losses_ok = all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, ref_losses))
    if not losses_ok:
        problems.append(f"losses {losses} != reference {ref_losses}")
    return {**record, "losses": losses, "ok": not problems and bool(before),
            "problems": problems}


def main() -> int:
    return serve_cases(run_case)


if __name__ == "__main__":
    sys.exit(main())
