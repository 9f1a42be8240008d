"""One process of tests/test_checkpoint.py (under torchrun): train, save, load, continue.

    --phase '{"case": {"model": "gpt", "dp": 2}, "dir": CKPT, "save": true}' \
    --phase '{"case": {"model": "gpt", "tp": 2}, "dir": CKPT, "load": true}'

Each phase, in order, in the same processes (one launch's imports for all of them): plans
its case on the launched ranks, loads ``dir`` first when ``load`` (resharding to this
plan), trains ``steps`` (2) AdamW steps on the fixed batch, and saves to ``dir`` (or
``save_dir``) when ``save``. ``$AUTOPAR_TEST_OUT/rank{r}.json`` gets one record a phase:
``{"step": first step, "losses": [...], "mesh", "zero"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equivalence import build, cluster_for  # noqa: E402
from grad_check import make_optimizer  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.teardown import leave  # noqa: E402

MODEL_KEYS = ("model", "layers", "tied", "cluster")


def run_phase(phase: dict) -> dict:
    case = phase["case"]
    model, (a, k) = build(case["model"], case.get("layers", 2), case.get("tied"))
    options = {key: v for key, v in case.items() if key not in MODEL_KEYS}
    options.setdefault("recompute", ("none",))
    world = int(os.environ.get("WORLD_SIZE", 1))
    pm = autopar.parallelize(model, cluster_for(case.get("cluster"), world), (a, k), **options)
    opt = make_optimizer(pm.parameters(), "adamw")
    step = autopar.load_checkpoint(phase["dir"], pm, opt) if phase.get("load") else 0
    first = step
    la, lk = pm.shard_batch(*a, **k)
    losses = []
    for _ in range(phase.get("steps", 2)):
        opt.zero_grad()
        losses.append(pm.train_step(*la, **lk).item())
        opt.step()
        step += 1
    if phase.get("save"):
        autopar.save_checkpoint(phase.get("save_dir", phase["dir"]), pm, opt, step=step)
    if dist.is_initialized():
        dist.barrier()  # the next phase may read what this one wrote
    return {"step": first, "losses": losses, "mesh": pm.plan.mesh,
            "zero": pm.plan.training["zero"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", action="append", required=True, type=json.loads)
    records = [run_phase(phase) for phase in ap.parse_args().phase]
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(os.environ["AUTOPAR_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    leave(main(), barrier=True)  # every rank done before any tears its groups down
