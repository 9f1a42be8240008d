"""One GPU, one rank of a 2-device plan: modelled vs measured compute and memory per rank.

Issue 11 asks for dp, ZeRO-3 and tp=2 timed against their predictions on one GPU.
Collectives need two GPUs; what one rank *computes* and *holds* does not. So this script
joins torch's fake process group (``backend="fake"``: every collective returns at once,
moving nothing) as rank 0 of 2, lets ``autopar.parallelize`` build that rank's real program
-- FSDP2 sharding and its gather buffers, tensor-parallel weight halves, the rank's half of
the batch -- and trains it on the GPU. The step then costs what the rank computes plus the
host's work around the collectives, with the wire time taken out; it is compared with the
plan's modelled compute + optimizer time (``predicted.compute_s + optimizer_s``, no
communication), and with the whole modelled step for reference. Memory is real: measured
peak and held states against the plan's modelled ones.

Rows (each planned for ``2x<device>`` unless noted, the same global batch):

- ``1``: the whole batch on one device (``1x<device>``), the baseline;
- ``dp2``: data parallel, ZeRO-0 -- each rank computes half the batch, holds all states;
- ``zero3``: data parallel with ZeRO-3 (FSDP2) -- half the batch, a half of every state,
  whole weights gathered a layer at a time;
- ``tp2``: tensor parallel -- the whole batch, half of every weight matrix;
- ``1-fp8``: the baseline with the linear layers' matmuls in fp8 (asked for by name).

The loss is not meaningful (the fake group's gathers return unwritten memory); the time and
the memory are.

    python benchmarks/gpu_rank_programs.py                 # needs CUDA; ~2 minutes
    python benchmarks/gpu_rank_programs.py --device cpu --model "gpt:layers=2,hidden=64,..." \\
        --cluster-device cpu --steps 2                     # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

import autopar
from autopar.core.cluster import load_cluster
from autopar.models import resolve_model

LLAMA3_8B_LAYERS = ("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,"
                    "vocab=128256,seq={seq},batch={batch},rope_theta=500000")

VARIANTS = {  # name: (devices, parallelize keywords)
    "1": (1, {}),
    "dp2": (2, {"dp": 2, "tp": 1, "pp": 1, "zero": 0}),
    "zero3": (2, {"dp": 2, "tp": 1, "pp": 1, "zero": 3}),
    "tp2": (2, {"dp": 1, "tp": 2, "pp": 1}),
    "1-fp8": (1, {"precision": "fp8"}),  # the baseline with fp8 linear layers
}


def join_fake_group(world_size: int) -> None:
    """Rank 0 of ``world_size`` in torch's fake process group (collectives move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        dist.destroy_process_group()
    if world_size > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _fake_all_reduce(group, bucket):  # no annotations: DDP checks them, and they are strings
    """DDP's all-reduce through the fake group, completed by hand: the fake group's future
    carries no tensor, which DDP's reducer refuses."""
    dist.all_reduce(bucket.buffer(), group=group)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _memory(device: torch.device, peak: bool = False) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def measure(name: str, args: argparse.Namespace) -> dict:
    devices, keywords = VARIANTS[name]
    join_fake_group(devices)
    spec = resolve_model(args.model.format(seq=args.seq, batch=args.batch))
    torch.manual_seed(0)
    model = spec.build()
    a, k = spec.example_inputs(args.batch, args.seq, "cpu")
    # one chip runs every rank's program in turn: no slower chip for a step to wait for
    cluster = load_cluster({"nodes": 1, "devices_per_node": devices, "name": f"{devices}x"
                            f"{args.cluster_device}", "device": {"preset": args.cluster_device,
                                                                  "speed_spread": 0.0}})
    started = time.perf_counter()
    fused = args.device.startswith("cuda")  # the AdamW built below, priced as it runs
    pm = autopar.parallelize(model, cluster, (a, k), **{
        "precision": args.precision, "recompute": (args.recompute,),
        "optimizer": "adamw_fused" if fused else "adamw", **keywords})
    plan_s = time.perf_counter() - started
    del model
    device = torch.device(args.device)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-5, **({"fused": True} if fused else {}))
    la, lk = pm.shard_batch(*a, **k)
    if hasattr(pm.wrapped, "register_comm_hook"):
        pm.wrapped.register_comm_hook(pm.wrapped.process_group, _fake_all_reduce)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pm.train_step(*la, **lk)
        opt.step()

    for _ in range(args.warmup):
        step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    gc.collect()
    held = _memory(device)  # weights and optimizer states between steps, no gradients
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    if args.profile:
        row_profile = profile_steps(step, args.profile, device)
    p = pm.plan.predicted
    mem = p["memory"]
    row = {
        "variant": name, "cluster": cluster.name, "precision": pm.plan.precision_policy, "mesh": dict(pm.plan.mesh),
        "zero": pm.plan.training.get("zero", 0), "recompute": pm.plan.training["recompute"],
        "microbatches": pm.plan.batch["microbatches"], "plan_s": plan_s,
        "predicted_step_s": p["step_time_s"],
        "predicted_compute_s": p["compute_s"] + p.get("optimizer_s", 0.0),
        "predicted_comm_s": p.get("tp_comm_s", 0.0) + p.get("dp_exposed_s", 0.0),
        "measured_step_s": statistics.median(times),
        "predicted_states_bytes": mem["params"] + mem["optimizer"],
        "measured_states_bytes": held,
        "predicted_peak_bytes": p["peak_memory_bytes"],
        "measured_peak_bytes": _memory(device, peak=True),
    }
    if args.profile:
        row.update(row_profile)
    return row  # the module and optimizer go with this frame (the caller empties the cache)


KERNEL_CLASSES = (  # (class, name fragments), first match wins; lower-case
    ("optimizer", ("adam", "multi_tensor")),
    ("compiled", ("triton_",)),
    ("attention", ("_attn_", "flash", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "scaled_mm")),
    ("loss", ("cross_entropy", "log_softmax", "logsumexp", "nll_loss", "softmax")),
    ("copy/cast", ("copy", "cat", "fill", "memset", "memcpy")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, fragments in KERNEL_CLASSES:
        if any(f in low for f in fragments):
            return cls
    return "other"


def profile_steps(step, steps: int, device: torch.device) -> dict:
    """GPU kernel time per step by class, and the kernels that took most, over ``steps``
    profiled steps (torch.profiler, CUDA activity only; on a CPU its ops' self time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else
                 [ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    per_op: dict[str, list[float]] = {}  # aten op -> [GPU ms its own kernels took, calls]
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if cuda and us > 0 and e.key.startswith("aten::"):
            per_op[e.key] = [us / 1e3 / steps, e.count / steps]
    per_kernel: dict[str, float] = {}
    for e in prof.key_averages():
        if cuda and (e.device_type != torch.autograd.DeviceType.CUDA
                     or e.key.startswith("Optimizer.")):
            continue  # CPU ops and the optimizer's range: their kernels are counted as kernels
        us = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
              if cuda else e.self_cpu_time_total)
        if us > 0 and e.key:
            per_kernel[e.key] = per_kernel.get(e.key, 0.0) + us / 1e3 / steps
    classes: dict[str, float] = {}
    for name, ms in per_kernel.items():
        cls = kernel_class(name)
        classes[cls] = classes.get(cls, 0.0) + ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]
    return {"kernel_ms_by_class": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            "kernel_ms_total": sum(per_kernel.values()),
            "top_kernels_ms": [[name[:120], ms] for name, ms in top],
            "aten_ops_gpu_ms": dict(sorted(per_op.items(), key=lambda kv: -kv[1][0]))}


def _ratio(row: dict, what: str) -> float:
    pred = row["predicted_" + what]
    return row["measured_" + what] / pred if pred else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=LLAMA3_8B_LAYERS,
                    help="a model spec with {seq} and {batch} to fill in")
    ap.add_argument("--cluster-device", default="H200",
                    help="the device preset the clusters are made of (1x..., 2x...)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="1,dp2,zero3,tp2")
    ap.add_argument("--batch", type=int, default=2, help="the global batch (sequences)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0,
                    help="also profile this many steps: GPU kernel time per step by class")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_rank_programs.py measures a GPU; none is available here", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; global batch {args.batch} x seq {args.seq}; "
          f"{args.precision}, recompute {args.recompute}; 'pred' modelled, 'meas' measured "
          "(rank 0 of a fake 2-rank group: collectives move nothing)\n")
    print(f"{'variant':>7} {'plan':>22} | {'pred step':>9} {'pred comp':>9} {'meas':>8} "
          f"{'meas/comp':>9} | {'states GiB p/m':>15} {'ratio':>6} | {'peak GiB p/m':>14} "
          f"{'ratio':>6}", flush=True)
    gib = 2**30
    rows: list[dict] = []
    for name in args.variants.split(","):
        try:
            r = measure(name, args)
        except Exception as exc:  # one failing row must not hide the others
            traceback.print_exc()
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{name:>7} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows.append(r)
        plan = " ".join(f"{a}{n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
        plan += f" Z{r['zero']} m{r['microbatches']}"
        print(f"{name:>7} {plan:>22} | {r['predicted_step_s'] * 1e3:>9.1f} "
              f"{r['predicted_compute_s'] * 1e3:>9.1f} {r['measured_step_s'] * 1e3:>8.1f} "
              f"{r['measured_step_s'] / r['predicted_compute_s']:>9.2f} | "
              f"{r['predicted_states_bytes'] / gib:>7.2f}/{r['measured_states_bytes'] / gib:<7.2f}"
              f" {_ratio(r, 'states_bytes'):>6.2f} | "
              f"{r['predicted_peak_bytes'] / gib:>6.2f}/{r['measured_peak_bytes'] / gib:<7.2f}"
              f" {_ratio(r, 'peak_bytes'):>6.2f}", flush=True)
        if "kernel_ms_by_class" in r:
            print(f"{'':>7} GPU kernels {r['kernel_ms_total']:.1f} ms/step: " + ", ".join(
                f"{c} {ms:.1f}" for c, ms in r["kernel_ms_by_class"].items()), flush=True)
            for kernel, ms in r["top_kernels_ms"][:12]:
                print(f"{'':>11}{ms:>7.2f} ms  {kernel[:100]}")
            if r["aten_ops_gpu_ms"]:
                print(f"{'':>7} GPU time of each aten op's own kernels (ms/step, calls/step):")
                for op, (ms, calls) in list(r["aten_ops_gpu_ms"].items())[:25]:
                    print(f"{'':>11}{ms:>7.2f} ms {calls:>6.0f}  {op}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "batch": args.batch,
                       "seq": args.seq, "rows": rows}, f, indent=1)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
