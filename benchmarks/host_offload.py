"""What offloading to host memory costs on this machine: the link and the host optimizer.

Offloaded optimizer states (ZeRO-Offload, FSDP2's ``CPUOffloadPolicy``) move each step's
gradients to the host and the updated parameters back, and run the optimizer on the CPU. So
an offload plan's step is bounded by two numbers this script **measures**:

- host <-> device copy bandwidth, pinned and pageable, both directions (CUDA only);
- the host AdamW step rate (parameters per second, fp32, torch's foreach implementation)
  with all of this machine's threads.

    python benchmarks/host_offload.py
    python benchmarks/host_offload.py --params 50_000_000 --json offload.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _median_s(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(nbytes: int) -> dict[str, float]:
    """Bytes per second of host->device and device->host copies (measured)."""
    out = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

        def h2d(host=host, pinned=pinned):
            dev.copy_(host, non_blocking=pinned)
            torch.cuda.synchronize()

        def d2h(host=host, pinned=pinned):
            host.copy_(dev, non_blocking=pinned)
            torch.cuda.synchronize()

        kind = "pinned" if pinned else "pageable"
        out[f"h2d_{kind}"] = nbytes / _median_s(h2d)
        out[f"d2h_{kind}"] = nbytes / _median_s(d2h)
    return out


def host_adamw_rate(params: int) -> float:
    """Parameters per second of one fp32 AdamW step on the CPU (measured)."""
    chunks = [torch.nn.Parameter(torch.randn(params // 8)) for _ in range(8)]
    for p in chunks:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(chunks, lr=1e-4, foreach=True)
    return params / _median_s(opt.step, repeats=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--copy-bytes", type=int, default=1 << 30)
    ap.add_argument("--json")
    args = ap.parse_args()
    result: dict[str, object] = {"threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()
        result.update({k: v for k, v in copy_bandwidth(args.copy_bytes).items()})
        for key in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
            print(f"{key:<14} {result[key] / 1e9:7.1f} GB/s (measured, {args.copy_bytes >> 20} MiB)")
    result["host_adamw_params_per_s"] = host_adamw_rate(args.params)
    print(f"host AdamW     {result['host_adamw_params_per_s'] / 1e9:7.2f} G params/s (measured, fp32, "
          f"{args.params / 1e6:.0f}M params, {result['threads']} threads)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
