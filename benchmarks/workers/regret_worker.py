"""One process of benchmarks/plan_regret.py (run under torchrun).

Builds every layout of one model on this launch's processes (the automatic plan and each
pinned layout, each its own ``autopar.parallelize`` on its own process groups), then times
them round-robin: each round runs every layout for a few training steps (forward, backward,
AdamW), starting one layout later than the round before, so machine load drifts over all
layouts alike. A pinned layout whose plan is the same program as an earlier one (often
the automatic plan) is not built twice: it shares that one's times. Rank 0 writes the layouts' plans, predictions (modelled) and per-round step
times (measured) as JSON.

    torchrun --nproc-per-node 2 benchmarks/workers/regret_worker.py --model demo \
        --cluster c.yaml --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.core.errors import AutoparError
from autopar.ops import comm_ops

Batch = tuple[tuple, dict]


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int
         ) -> Callable[[], tuple[torch.nn.Module, Batch]]:
    def build() -> tuple[torch.nn.Module, Batch]:
        from autopar.models import GPT, GPTConfig

        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=heads,
                              n_embd=hidden))
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, vocab, (batch, seq), generator=g)
        tgt = torch.randint(0, vocab, (batch, seq), generator=g)
        return model, ((idx, tgt), {})
    return build


def _demo() -> tuple[torch.nn.Module, Batch]:
    from autopar.cli.demo_data import demo_batches, demo_model

    return demo_model(), (demo_batches(1)[0], {})


def _llama() -> tuple[torch.nn.Module, Batch]:
    from autopar.models.hf import build_llama

    torch.manual_seed(0)
    model = build_llama(layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=256, seq=64)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    return model, ((), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})


MODELS: dict[str, dict[str, Any]] = {
    # name -> build and what it is (every one planned with this machine's calibrated links)
    "demo": {"build": _demo, "what": "demo GPT: 4 layers x 128, batch 8 x 64, vocab 256"},
    "llama": {"build": _llama, "what": "HF Llama: 4 layers x 128 (GQA 4/2), ffn 256, batch 8 x "
              "64"},
    "gpt-deep": {"build": _gpt(8, 64, 4, 512, 128, 8),
                 "what": "GPT: 8 layers x 64, batch 8 x 128, vocab 512"},
    "wide": {"build": _gpt(2, 384, 6, 256, 32, 4),
             "what": "wide GPT: 2 layers x 384, batch 4 x 32, vocab 256"},
}


def layouts(nproc: int, batch: int) -> list[tuple[str, dict[str, Any]]]:
    """The automatic plan, then every pinned layout of ``nproc`` processes."""
    base = {"zero": (0,), "recompute": ("none",)}
    one = {"dp": 1, "tp": 1, "pp": 1}
    out: list[tuple[str, dict[str, Any]]] = [("auto", {})]
    out += [("1 rank", {**one, **base, "devices": 1}),
            ("1 rank recompute", {**one, **base, "devices": 1, "recompute": ("full",)})]
    if nproc == 4:
        out += [("2 of 4: dp2", {**one, **base, "devices": 2, "dp": 2}),
                ("2 of 4: tp2", {**one, **base, "devices": 2, "tp": 2})]
    n = nproc
    out += [(f"dp{n}", {**one, **base, "dp": n}),
            (f"dp{n} zero1", {**one, **base, "dp": n, "zero": (1,)}),
            (f"dp{n} zero2", {**one, **base, "dp": n, "zero": (2,)}),
            (f"dp{n} zero3", {**one, **base, "dp": n, "zero": (3,)}),
            (f"dp{n} recompute", {**one, **base, "dp": n, "recompute": ("full",)}),
            (f"tp{n}", {**one, **base, "tp": n})]
    if n == 4:
        out += [("dp2 x tp2", {**one, **base, "dp": 2, "tp": 2}),
                ("pp2 x dp2 1f1b", {**one, **base, "pp": 2, "dp": 2, "schedule": "1f1b",
                                    "microbatches": min(batch // 2, 4)})]
    for schedule in ("gpipe", "1f1b", "interleaved", "zb_v"):
        extra = {"virtual_stages": 2} if schedule == "interleaved" else {}
        out.append((f"pp{n} {schedule}", {**one, **base, "pp": n, "schedule": schedule,
                                          "microbatches": min(batch, 2 * n), **extra}))
    return out


def describe(plan: autopar.Plan) -> dict[str, Any]:
    p = plan.predicted
    return {
        "mesh": plan.mesh, "devices": plan.world_size, "cluster_devices": plan.cluster["devices"],
        "zero": plan.training["zero"], "recompute": plan.training["recompute"],
        "schedule": plan.pipeline.get("schedule"),
        "virtual_stages": plan.pipeline.get("virtual_stages"),
        "microbatch": plan.batch["microbatch"], "microbatches": plan.batch["microbatches"],
        "predicted": {k: p[k] for k in ("step_time_s", "peak_memory_bytes", "compute_s",
                                        "tp_comm_s", "dp_comm_s", "dp_exposed_s", "bubble_s",
                                        "p2p_s", "optimizer_s")},
        "devices_why": plan.explanation.get("devices", {}).get("why"),
    }


def plan_key(plan: autopar.Plan) -> str:
    """What makes two plans the same program: mesh, devices, batch split, training options,
    every node's strategy, every parameter's placement and the pipeline's schedule and
    chunks (not the predictions, nor the pins that led to it)."""
    pipeline = {k: plan.pipeline.get(k) for k in ("schedule", "virtual_stages", "chunks")}
    return json.dumps([plan.mesh, plan.cluster["devices"], plan.batch, plan.training,
                       plan.strategies, plan.params, pipeline], sort_keys=True, default=str)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=list(MODELS))
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--only", default=None, help="comma-separated layout names")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    nproc = int(os.environ["WORLD_SIZE"])
    build = MODELS[args.model]["build"]
    _, ((a0, k0)) = build()
    batch = next(t for t in [*a0, *k0.values()] if isinstance(t, torch.Tensor)).shape[0]
    chosen = layouts(nproc, batch)
    if args.only:
        keep = set(args.only.split(","))
        chosen = [(n, kw) for n, kw in chosen if n in keep]

    runs, records = [], []
    built: dict[str, str] = {}  # plan_key -> the layout that built that plan first
    for name, kwargs in chosen:
        model, (a, k) = build()
        started = time.perf_counter()
        try:
            pm = autopar.parallelize(model, args.cluster, (a, k), time_limit_s=args.time_limit,
                                     **kwargs)
        except AutoparError as e:  # raised alike on every rank (rank 0 sends planning errors)
            records.append({"layout": name, "pins": _jsonable(kwargs),
                            "status": f"not runnable: {e.what}"[:400]})
            continue
        setup_s = time.perf_counter() - started
        key = plan_key(pm.plan)
        if key in built:  # the same program: timing it twice would measure only noise
            records.append({"layout": name, "pins": _jsonable(kwargs), "status": "ok",
                            "setup_s": setup_s, "plan": describe(pm.plan), "step_s": [],
                            "same_plan_as": built[key]})
            continue
        built[key] = name
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        la, lk = pm.shard_batch(*a, **k)
        ctx = pm.mesh_context
        groups = ({axis: ctx.group(axis) for axis, size in pm.plan.mesh.items() if size > 1}
                  if getattr(pm, "active", True) else {})
        runs.append((name, pm, opt, la, lk, groups))
        records.append({"layout": name, "pins": _jsonable(kwargs), "status": "ok",
                        "setup_s": setup_s, "plan": describe(pm.plan), "step_s": []})

    def steps(run: tuple, count: int) -> None:
        _, pm, opt, la, lk, groups = run
        comm_ops.bind_axis_groups(groups)  # collectives go to this layout's groups
        for _ in range(count):
            opt.zero_grad(set_to_none=True)
            pm.train_step(*la, **lk)
            opt.step()

    for run in runs:  # warm-up: two steps each
        steps(run, 2)
    by_name = {r["layout"]: r for r in records}
    for round_ in range(args.repeats):
        for i in range(len(runs)):
            run = runs[(i + round_) % len(runs)]
            dist.barrier()
            t = time.perf_counter()
            steps(run, args.steps)
            dist.barrier()
            by_name[run[0]]["step_s"].append((time.perf_counter() - t) / args.steps)
    for record in records:
        if "same_plan_as" in record:
            record["step_s"] = list(by_name[record["same_plan_as"]]["step_s"])
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "nproc": nproc, "layouts": records}, f)
    dist.destroy_process_group()


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}


if __name__ == "__main__":
    main()
