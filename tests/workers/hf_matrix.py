"""Train every architecture of a zoo under every layout, single-device and under autopar,
and compare every loss and every gradient on every rank at every step.

One torchrun launch runs a group of architectures, each under every layout it is given::

    torchrun --nproc-per-node 2 tests/workers/hf_matrix.py --layouts trace,dp2,pp2 \
        --case '{"arch": "llama"}' --case '{"arch": "t5"}'

Architectures come from ``tests/hf_zoo.py`` (Hugging Face models),
``tests/hand_models.py`` (``hand:<name>``) or any file with a ``build(name)``
(``<file>.py:<name>``, as ``benchmarks/unseen_models.py`` runs them). Each architecture is
built, trained on one device and traced once; every layout reuses them (``trace`` checks
that the traced graph itself trains like the model). A cell is ``equal`` (the comparison
of grad_check.py passed), ``refused`` (planning raised an AutoparError: the plan says no, with the op and the reason),
``differs`` (trained, but not like single-device: silent wrong training) or ``error`` (failed
after planning; the cells after it are ``not run``, since its ranks may have stopped at
different collectives). Rank 0 plans and sends the plan, or its refusal, to every rank before
``parallelize``, so a refusal never leaves the other ranks waiting in a collective. Each rank
writes ``rank<r>.json`` (one record per cell) into ``$AUTOPAR_TEST_OUT``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from equivalence import cluster_for  # noqa: E402
from grad_check import compare, train_parallel, train_reference  # noqa: E402
from reuse import Traces  # noqa: E402

import autopar  # noqa: E402
import autopar.api.parallelize as parallelize_module  # noqa: E402
from autopar.core.errors import AutoparError  # noqa: E402
from autopar.core.plan import Plan  # noqa: E402
from autopar.runtime.idle import IdleRank  # noqa: E402
from autopar.runtime.teardown import leave  # noqa: E402
from autopar.solver.model import cpsat  # noqa: E402
from tests import hand_models, hf_zoo  # noqa: E402

STEPS = 3
# layout tp2_random's seed; set AUTOPAR_LAYOUT_SEED to draw other layouts (or reproduce one)
RANDOM_LAYOUT_SEED = int(os.environ.get("AUTOPAR_LAYOUT_SEED", 2026))
FAST = str(HERE.parent / "clusters" / "cpu-fast-links.yaml")

# Each layout: the pins it plans with, and the cluster. Tensor parallelism needs fast links
# for the solver to shard such tiny models at all.
LAYOUTS: dict[str, dict] = {
    "auto": {},  # the solver's own plan for 2 CPU processes
    "dp2": {"dp": 2},
    "tp2": {"tp": 2, "cluster": FAST},
    "pp2": {"pp": 2},  # microbatches as the solver likes (one where the batch is coupled)
    "zero3": {"dp": 2, "zero": 3},
    "cp2": {"cp": 2},
    # tp=2 on a random layout among those the constraints allow (cpsat.LAYOUT_NOISE_SEED,
    # one seed per architecture): redistributions and placements today's costs never pick
    "tp2_random": {"tp": 2, "cluster": FAST, "layout_seed": RANDOM_LAYOUT_SEED},
}
TRACE = "trace"  # not a layout: the traced graph trains like the model, and plans


def build(arch: str):
    if arch.startswith("hand:"):
        return hand_models.MODELS[arch.removeprefix("hand:")]()
    if ".py:" in arch:  # FILE.py:NAME, FILE's build(NAME) (benchmarks/unseen_models.py)
        path, _, name = arch.rpartition(":")
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.build(name)
    return hf_zoo.build(arch)


def plan_everywhere(gm, model, cluster, pins: dict, layout_seed: int | None = None
                    ) -> Plan | str:
    """Rank 0's plan on every rank, or the text of its refusal (an AutoparError). Any other
    failure of planning is raised on every rank, so none waits for the others.
    ``layout_seed``: plan a random layout (see ``cpsat.LAYOUT_NOISE_SEED``)."""
    box = ["", "", ""]  # plan JSON, refusal, other failure
    if dist.get_rank() == 0:
        cpsat.LAYOUT_NOISE_SEED = layout_seed
        try:
            box[0] = autopar.plan(gm, cluster, model_name=type(model).__name__,
                                  **pins).to_json()
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


class Arch:
    """One architecture: built, trained on one device and traced once for all layouts."""

    def __init__(self, arch: str, traces: Traces):
        self.arch = arch
        self.model, (self.args, self.kwargs) = build(arch)
        self.weights = dict(self.model.named_parameters(remove_duplicate=False))
        # training under a layout updates the weights the traced graph shares with the
        # model: every layout starts again from these
        self.initial = copy.deepcopy(self.model.state_dict())
        start = time.perf_counter()
        _, self.ref_losses, self.ref_grads = train_reference(self.model, self.args, self.kwargs,
                                                             STEPS)
        self.reference_s = time.perf_counter() - start
        self.traces = traces
        self.gm: fx.GraphModule | None = None
        self.refusal = ""
        try:
            self.gm = traces.first(self.model, (self.args, self.kwargs),
                                   agree=parallelize_module.same_graph_as_rank0)
        except AutoparError as e:  # the same on every rank: nothing to plan
            self.refusal = f"{type(e).__name__}: {e}"

    def trace_cell(self) -> dict:
        """The traced graph trains like the model itself (every rank, one device)."""
        if self.gm is None:
            return {"status": "refused", "reason": self.refusal}
        _, losses, grads = train_reference(self.gm, self.args, self.kwargs, STEPS)  # a copy
        problems = [f"losses {losses} != {self.ref_losses}"] if not all(
            abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, self.ref_losses)) else []
        for step, (mine, theirs) in enumerate(zip(grads, self.ref_grads)):
            problems += [f"step {step + 1}: {n}" for n in theirs.keys() | mine.keys()
                         if n not in mine or n not in theirs
                         or not mine[n].allclose(theirs[n], rtol=1e-5, atol=1e-6)]
        return {"status": "equal" if not problems else "differs", "problems": problems[:10]}

    def cell(self, layout: str) -> dict:
        try:
            return self._cell(layout)
        finally:
            self.model.load_state_dict(self.initial)

    def _cell(self, layout: str) -> dict:
        if layout == TRACE:
            return self.trace_cell()
        if self.gm is None:
            return {"status": "refused", "reason": self.refusal}
        options = dict(LAYOUTS[layout])
        cluster = cluster_for(options.pop("cluster", None), dist.get_world_size())
        seed = options.pop("layout_seed", None)
        if seed is not None:
            seed += zlib.crc32(self.arch.encode())
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 2)

        plan = plan_everywhere(self.gm, self.model, cluster, {**options, "recompute": ("none",)},
                               seed)
        times = {"plan": lap()}
        if isinstance(plan, str):
            return {"status": "refused", "reason": plan, "times": times}
        a, k = self.args, self.kwargs
        pm = autopar.parallelize(self.model, cluster, (a, k), plan=plan)
        times["parallelize"] = lap()
        la, lk = pm.shard_batch(*a, **k)
        losses, grads = train_parallel(pm, la, lk, STEPS)
        times["train"] = lap()
        result = compare(pm, self.model, losses, self.ref_losses, grads, self.ref_grads)
        idle = isinstance(pm, IdleRank)  # a plan on fewer devices: this rank holds nothing
        ok = result.losses_ok and not result.problems if idle else result.ok
        return {"status": "equal" if ok else "differs", "mesh": plan.mesh, "idle": idle,
                "zero": plan.training["zero"], "losses": losses, "reference": self.ref_losses,
                "microbatches": plan.batch["microbatches"],
                "sharded": sorted(f for f, ax in plan.params.items()
                                  if ax.get("tp", "R") != "R" and f in self.weights),
                "unruled_ops": plan.unruled_ops, "times": times,
                "schedule": plan.pipeline.get("schedule"),
                "cp_algorithm": plan.context.get("algorithm"),
                "tp_explanation": (getattr(plan, "explanation", None) or {}).get("tp"),
                **result.to_dict()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True,
                    help=f"comma-separated, of {TRACE}, {', '.join(LAYOUTS)}")
    ap.add_argument("--case", action="append", required=True, help='{"arch": NAME}')
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    unknown = [x for x in layouts if x != TRACE and x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}")
    # A rank that fails alone must not leave the other waiting forever in a collective.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    out_dir = os.environ.get("AUTOPAR_TEST_OUT")
    traces = Traces()
    records, failed = [], None
    for case in map(json.loads, args.case):
        arch, built, why = case["arch"], None, None
        if failed is None:
            try:
                start = time.perf_counter()
                built = Arch(arch, traces)
                setup_s = round(time.perf_counter() - start, 2)
            except Exception as e:  # noqa: BLE001 - recorded; the test judges every cell
                why, failed = f"building or tracing: {type(e).__name__}: {e}", arch
        for layout in layouts:
            start = time.perf_counter()
            if why is not None:
                record = {"status": "error", "reason": why}
            elif failed is not None and failed != arch or built is None:
                # collectives after a failure mid-step are out of step: run no more
                record = {"status": "not run", "reason": f"after the error in {failed}"}
            else:
                try:
                    record = built.cell(layout)
                except Exception as e:  # noqa: BLE001 - recorded; the test judges every cell
                    record = {"status": "error", "reason": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-3000:]}
                    failed, built = arch, None
            record.update(arch=arch, layout=layout, rank=rank,
                          wall_s=round(time.perf_counter() - start, 2))
            if layout == layouts[0] and why is None and failed is None:
                record["setup_s"] = setup_s
            records.append(record)
            if out_dir:
                Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
            print(json.dumps({k: record.get(k) for k in ("arch", "layout", "status", "wall_s")}),
                  flush=True)
        traces.clear()
    return 0


if __name__ == "__main__":
    leave(main())
