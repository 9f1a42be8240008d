"""Train every architecture of the Hugging Face zoo under one layout, single-device and under
autopar, and compare every loss and every gradient on every rank at every step.

One torchrun launch runs every architecture of a layout::

    torchrun --nproc-per-node 2 tests/workers/hf_matrix.py --layout tp2 \
        --case '{"arch": "llama"}' --case '{"arch": "t5"}'

A cell is ``equal`` (the comparison of grad_check.py passed), ``refused`` (planning raised an
AutoparError: the plan says no, with the op and the reason), ``differs`` (trained, but not
like single-device: silent wrong training) or ``error`` (failed after planning; the cells
after it are ``not run``, since its ranks may have stopped at different collectives). Rank 0 plans
and sends the plan, or its refusal, to every rank before ``parallelize``, so a refusal
never leaves the other ranks waiting in a collective. Each rank writes ``rank<r>.json`` (one
record per architecture) into ``$AUTOPAR_TEST_OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from equivalence import cluster_for  # noqa: E402
from grad_check import compare, train_parallel, train_reference  # noqa: E402

import autopar  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.solver import cpsat  # noqa: E402
from tests.hf_zoo import build  # noqa: E402

STEPS = 3
# layout tp2_random's seed; set AUTOPAR_LAYOUT_SEED to draw other layouts (or reproduce one)
RANDOM_LAYOUT_SEED = int(os.environ.get("AUTOPAR_LAYOUT_SEED", 2026))
FAST = str(HERE.parent / "clusters" / "cpu-fast-links.yaml")

# Each layout: the pins it plans with, and the cluster. Tensor parallelism needs fast links
# for the solver to shard such tiny models at all.
LAYOUTS: dict[str, dict] = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2, "cluster": FAST},
    "pp2": {"pp": 2, "microbatches": 2},
    "zero3": {"dp": 2, "zero": 3},
    # tp=2 on a random layout among those the constraints allow (cpsat.LAYOUT_NOISE_SEED,
    # one seed per architecture): redistributions and placements today's costs never pick
    "tp2_random": {"tp": 2, "cluster": FAST, "layout_seed": RANDOM_LAYOUT_SEED},
}


def plan_everywhere(model, cluster, inputs, pins: dict, layout_seed: int | None = None
                    ) -> Plan | str:
    """Rank 0's plan on every rank, or the text of its refusal (an AutoparError). Any other
    failure of planning is raised on every rank, so none waits for the others.
    ``layout_seed``: plan a random layout (see ``cpsat.LAYOUT_NOISE_SEED``)."""
    box = ["", "", ""]  # plan JSON, refusal, other failure
    if dist.get_rank() == 0:
        cpsat.LAYOUT_NOISE_SEED = layout_seed
        try:
            box[0] = autopar.plan(model, cluster, inputs, **pins).to_json()
        except AutoparError as e:
            box[1] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            box[2] = f"planning failed on rank 0: {type(e).__name__}: {e}"
        finally:
            cpsat.LAYOUT_NOISE_SEED = None
    dist.broadcast_object_list(box, src=0)
    if box[2]:
        raise RuntimeError(box[2])
    return box[1] if box[1] else Plan.from_json(box[0], source="plan from rank 0")


def run_cell(arch: str, layout: str) -> dict:
    options = dict(LAYOUTS[layout])
    cluster = cluster_for(options.pop("cluster", None), dist.get_world_size())
    seed = options.pop("layout_seed", None)
    if seed is not None:
        seed += zlib.crc32(arch.encode())
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 2)

    model, (a, k) = build(arch)
    weights = dict(model.named_parameters(remove_duplicate=False))
    reference, ref_losses, ref_grads = train_reference(model, a, k, STEPS)
    times = {"reference": lap()}
    plan = plan_everywhere(model, cluster, (a, k), {**options, "recompute": ("none",)}, seed)
    times["plan"] = lap()
    if isinstance(plan, str):
        return {"status": "refused", "reason": plan}
    pm = autopar.parallelize(model, cluster, (a, k), plan=plan)
    times["parallelize"] = lap()
    la, lk = pm.shard_batch(*a, **k)
    losses, grads = train_parallel(pm, la, lk, STEPS)
    times["train"] = lap()
    result = compare(pm, reference, losses, ref_losses, grads, ref_grads)
    return {"status": "equal" if result.ok else "differs", "mesh": plan.mesh,
            "zero": plan.training["zero"], "losses": losses, "reference": ref_losses,
            "sharded": sorted(f for f, ax in plan.params.items()
                              if ax.get("tp", "R") != "R" and f in weights),
            "unruled_ops": plan.unruled_ops, "times": times,
            "schedule": plan.pipeline.get("schedule"),
            "tp_explanation": (getattr(plan, "explanation", None) or {}).get("tp"),
            "solver": {k: v for k, v in plan.solver.items() if k != "candidates"},
            **result.to_dict()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True, choices=sorted(LAYOUTS))
    ap.add_argument("--case", action="append", required=True, help='{"arch": NAME}')
    args = ap.parse_args()
    # A rank that fails alone must not leave the other waiting forever in a collective.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    out_dir = os.environ.get("AUTOPAR_TEST_OUT")
    records, failed = [], None
    for case in map(json.loads, args.case):
        start = time.perf_counter()
        if failed:  # collectives after a failure mid-step are out of step: run no more
            record = {"status": "not run", "reason": f"after the error in {failed}"}
        else:
            try:
                record = run_cell(case["arch"], args.layout)
            except Exception as e:  # noqa: BLE001 - recorded; the test judges every cell
                record = {"status": "error", "reason": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-3000:]}
                failed = case["arch"]
        record.update(arch=case["arch"], layout=args.layout, rank=rank,
                      wall_s=round(time.perf_counter() - start, 2))
        records.append(record)
        if out_dir:
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        print(json.dumps({k: record.get(k) for k in ("arch", "status", "wall_s")}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
