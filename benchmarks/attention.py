"""The generated attention kernels: speed against torch SDPA on CUDA, error on CPU.

On CUDA (compiled Triton): forward and backward TFLOP/s of ``autopar.kernels.attention``
next to ``scaled_dot_product_attention`` with the flash backend, for sequence lengths
512-16k, head dims 64 and 128, causal and not (bf16, batch x heads fixed at 16k tokens x 16
heads' worth of work per row), all **measured** with CUDA events; first the error table below, compiled.

On CPU (no GPU): the kernels run in Triton's interpreter at small sizes, and the table gives
their largest error against the fp64 reference (output, log-sum-exp and the three input
gradients), next to PyTorch's own eager error in the same dtype — the criterion the tests
apply (fp32 within 1e-4; fp16/bf16 within twice PyTorch's error). Either way, the time to
generate and load a kernel set for a new spec (compilation excluded) is measured.

    python benchmarks/attention.py
    python benchmarks/attention.py --seqs 1024,4096,16384     # fewer CUDA rows
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are built

from autopar.kernels import (  # noqa: E402
    AttentionSpec,
    attention,
    backend_for,
    build_kernels,
    reference_attention,
)


def attention_flops(b: int, h: int, m: int, n: int, d: int, causal: bool) -> tuple[float, float]:
    """Forward and backward FLOPs (FlashAttention's count: 4bhmnd forward, 2.5x backward;
    halved when causal)."""
    fwd = 4 * b * h * m * n * d * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def generation_seconds() -> list[tuple[str, float]]:
    """Wall time to render and load the kernels of specs not seen before (measured)."""
    specs = [AttentionSpec(head_dim=48, scale=0.2), AttentionSpec(head_dim=80, causal=True, group_size=4),
             AttentionSpec(head_dim=128, dtype="bfloat16", causal=True, dropout_p=0.1),
             AttentionSpec(head_dim=96, window=(256, 0), bias=True, bias_grad=True),
             AttentionSpec(head_dim=112, alibi=True, dtype="float16")]
    out = []
    for spec in specs:
        started = time.perf_counter()
        build_kernels(spec, backend_for(torch.empty(0, device="cuda" if CUDA else "cpu"))
                      == "interpreter")
        out.append((spec.describe(), time.perf_counter() - started))
    return out


def cuda_seconds(fn, repeats: int = 10) -> float:
    """Median wall time of ``fn`` on the GPU (CUDA events; measured)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _cuda_row(seq: int, d: int, causal: bool) -> list[tuple[float, float]]:
    """[(fwd, bwd) TFLOP/s] of autopar's kernels and of SDPA flash, for one shape."""
    b, h = max(1, 16384 // seq), 2048 // d
    q, k, v = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    fwd_flops, bwd_flops = attention_flops(b, h, seq, seq, d, causal)
    row = []
    for fn in (lambda: attention(q, k, v, causal=causal), lambda: _sdpa_flash(q, k, v, causal)):
        fwd = cuda_seconds(fn)
        out = fn()
        bwd = cuda_seconds(lambda out=out: torch.autograd.grad(out, (q, k, v), do,
                                                                 retain_graph=True))
        row.append((fwd_flops / fwd / 1e12, bwd_flops / bwd / 1e12))
    return row


def cuda_table(seqs: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)) -> None:
    print("CUDA, bf16, measured TFLOP/s (forward | backward); ratio = autopar / SDPA flash")
    print(f"{'seq':>6} {'d':>4} {'causal':>6} | {'autopar fwd':>11} {'sdpa fwd':>9} {'ratio':>6} | "
          f"{'autopar bwd':>11} {'sdpa bwd':>9} {'ratio':>6}")
    for d in (64, 128):
        for causal in (False, True):
            for seq in seqs:
                (af, ab), (sf, sb) = _cuda_row(seq, d, causal)
                print(f"{seq:>6} {d:>4} {str(causal):>6} | {af:>11.1f} {sf:>9.1f} {af / sf:>6.2f} | "
                      f"{ab:>11.1f} {sb:>9.1f} {ab / sb:>6.2f}", flush=True)


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def error_table(device: str = "cpu") -> None:
    """Largest error against the fp64 reference (on the CPU), per case and dtype (measured)."""
    where = "CUDA, compiled Triton" if device == "cuda" else "CPU, Triton interpreter"
    print(f"{where} (measured error against the fp64 reference; "
          "'eager' = PyTorch's own math in that dtype)")
    print(f"{'case':<34} {'dtype':>9} | {'out':>9} {'lse':>9} {'dq':>9} {'dk':>9} {'dv':>9} | "
          f"{'eager worst':>11} {'ours/eager':>10}")
    cases = [("plain d64", dict(h=2, kvh=2, m=96, n=96, d=64), {}),
             ("causal ragged d80 GQA2", dict(h=4, kvh=2, m=77, n=77, d=80), {"causal": True}),
             ("window (16,4) d112", dict(h=2, kvh=2, m=70, n=90, d=112), {"window": (16, 4)}),
             ("causal MQA d128", dict(h=4, kvh=1, m=64, n=64, d=128), {"causal": True})]
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if device == "cuda":  # each spec autotunes 3 configs x 3 kernels: keep compilation short
        cases, dtypes = cases[1:3], (torch.float32, torch.bfloat16)
    for name, shape, opts in cases:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, shape["h"], shape["m"], shape["d"], generator=g, dtype=torch.float64)
        k = torch.randn(1, shape["kvh"], shape["n"], shape["d"], generator=g, dtype=torch.float64)
        v = torch.randn(1, shape["kvh"], shape["n"], shape["d"], generator=g, dtype=torch.float64)
        do = torch.randn_like(q)
        ref = _run(reference_attention, q, k, v, do, torch.float64, opts)
        for dtype in dtypes:
            ours = _run(attention, q, k, v, do, dtype, opts, device)
            errors = [_err(a, b) for a, b in zip(ours, ref)]
            line = f"{name:<34} {str(dtype).removeprefix('torch.'):>9} | " + " ".join(
                f"{e:>9.2e}" for e in errors)
            if dtype == torch.float32:
                line += f" | {'(fp32: <= 1e-4)':>22}"
            else:
                eager = [_err(a, b) for a, b in zip(
                    _run(reference_attention, q, k, v, do, dtype, opts), ref)]
                line += f" | {max(eager):>11.2e} {max(errors) / max(eager):>10.2f}"
            print(line, flush=True)


def _run(fn, q, k, v, do, dtype, opts, device="cpu"):
    xs = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*xs, return_lse=True, **opts)
    grads = torch.autograd.grad(out, xs, do.to(device=device, dtype=dtype))
    return [t.double().cpu() for t in (out, lse, *grads)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    return (a[finite] - b[finite]).abs().max().item()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384",
                    help="sequence lengths of the CUDA speed table, comma-separated")
    args = ap.parse_args()
    print(f"backend: {backend_for(torch.empty(0, device='cuda' if CUDA else 'cpu'))}")
    if CUDA:
        print(f"torch {torch.__version__}, triton {_triton_version()}, "
              f"{torch.cuda.get_device_name()}\n", flush=True)
        error_table("cuda")
        print()
        cuda_table(tuple(int(s) for s in args.seqs.split(",")))
    else:
        error_table()
    print("\nkernel generation for a new spec (render + load, compilation excluded; measured)")
    for what, seconds in generation_seconds():
        print(f"  {what:<60} {seconds * 1e3:8.1f} ms")


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
