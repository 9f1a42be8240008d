"""One process of tests/test_checkpoint.py (under torchrun): train, save, load, continue.

    --case '{"model": "gpt", "dp": 2}' --dir CKPT --steps 2 [--load] [--save]

plans the case on the launched ranks, loads ``--dir`` first when ``--load`` (resharding to
this plan), trains ``--steps`` AdamW steps on the fixed batch, saves to ``--dir`` when
``--save``, and writes ``{"step": first step, "losses": [...]}`` to
``$AUTOPAR_TEST_OUT/rank{r}.json``.
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
from autopar.runtime.teardown import leave

MODEL_KEYS = ("model", "layers", "tied", "cluster")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    case = json.loads(args.case)
    model, (a, k) = build(case["model"], case.get("layers", 2), case.get("tied"))
    options = {key: v for key, v in case.items() if key not in MODEL_KEYS}
    options.setdefault("recompute", ("none",))
    world = int(os.environ.get("WORLD_SIZE", 1))
    pm = autopar.parallelize(model, cluster_for(case.get("cluster"), world), (a, k), **options)
    opt = make_optimizer(pm.parameters(), "adamw")
    step = autopar.load_checkpoint(args.dir, pm, opt) if args.load else 0
    first = step
    la, lk = pm.shard_batch(*a, **k)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        losses.append(pm.train_step(*la, **lk).item())
        opt.step()
        step += 1
    if args.save:
        autopar.save_checkpoint(args.dir, pm, opt, step=step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    record = {"step": first, "losses": losses, "mesh": pm.plan.mesh,
              "zero": pm.plan.training["zero"]}
    Path(os.environ["AUTOPAR_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    leave(main(), barrier=True)  # every rank done before any tears its groups down
