"""Datasheet numbers for the devices autopar knows by name.

Each preset is a partial cluster description in base units (bytes, FLOP/s, bytes/s,
seconds): the device and the two links of a typical node built from it. ``load_cluster``
layers a user's file or shorthand over it, so a preset only has to be right on average and
any number can be overridden.

Conventions, so the presets can be compared with each other:

- Peak FLOP/s are dense (no 2:4 sparsity). ``fp32`` is the non-tensor-core figure; ``tf32``,
  ``bf16``, ``fp16`` and ``fp8`` are tensor-core figures, present only where supported.
- Memory is the datasheet capacity read as GiB (HBM stacks are binary-sized); the CUDA/ROCm
  context takes 0.5-2 GiB of it, which the memory model must reserve, not this table.
- Link bandwidth is per device and per direction, the "bus bandwidth" nccl-tests reports.
  Intra-node is the datasheet NVLink figure (half the bidirectional number); inter-node is
  the device's share of the node's NICs (8 x 400 Gb/s NDR -> 50 GB/s per GPU).
- ``matmul_efficiency`` is the fraction of bf16 (fp16 on V100) peak that a large GEMM
  reaches in cuBLAS/hipBLASLt: an estimate to be replaced by calibration, not a datasheet.
- Latencies are per-message software+wire latencies of a collective step, rough figures.
- MI300X is the exception to datasheet links: its 448 GB/s is seven 64 GB/s point-to-point
  xGMI links, of which ~48 GB/s each is usable after CRC and protocol overhead (AMD ROCm
  blog "Understanding RCCL Bandwidth and xGMI Performance on MI300X", 2025), so 336 GB/s.
- ``kernel_floor_s`` is the time no op beats, however small. On GPUs it is a rule of thumb
  of ~5 µs: a CUDA/HIP launch costs ~2-4 µs of host and driver time (CUDA graphs exist to
  remove it), and the tail of a tiny grid adds ~1-2 µs. On ``cpu`` it is the ~2 µs eager
  PyTorch spends dispatching and allocating for a one-element op.
- ``memory_efficiency`` is the fraction of the HBM datasheet bandwidth that streaming
  elementwise kernels reach: STREAM/BabelStream-style copies and triads get ~80-90% on
  A100/H100, so 0.8 for every GPU; ``cpu`` gets 0.5 (caches, allocation and page faults make
  eager CPU elementwise ops far from a STREAM figure). Calibration measures the achieved
  bandwidth directly and then writes 1.0.
- ``attention_efficiency`` is the share of the device's matmul rate that fused attention
  (FlashAttention-style: two matmuls around an online softmax) reaches on the score tiles
  it runs. It is a property of the kernel as much as of the device, so a cluster file sets
  it for the kernel its runs use, and ``autopar calibrate`` measures it. The default, 0.4,
  is PyTorch SDPA's flash backend (FlashAttention-2) measured on an H100
  (``benchmarks/results/h100_2026-11-26.md``, causal, head dim 128, forward and backward
  together by FLOPs: 251 TFLOP/s at 4,096 tokens and 303 at 16,384, 0.36 and 0.44 of the
  preset's matmul rate, 0.7 x 989 TFLOP/s). A100 presets scale it by how much more of the
  chip FlashAttention-2 reaches there: up to 73% of A100 peak against 35% of H100 peak
  (Dao, 2023; Shah et al., 2024), per matmul rate (0.75 and 0.7 of peak) a factor of 2.0,
  capped at 1. A Hopper-native kernel (FlashAttention-3, cuDNN, which Transformer Engine
  runs) is 1.5-2.0x FlashAttention-2 on H100 (Shah et al., 2024):
  ``HOPPER_NATIVE_ATTENTION_EFFICIENCY``. ``cpu`` has PyTorch's
  CPU flash kernel as ``autopar calibrate --quick`` measured it on the CI VM (0.69 with one
  process computing, 0.96-1.0 with two: matmuls slow down more than it does when both
  cores are busy, as in a 2-process run), rounded to 0.9.
- GPU presets have no ``matmul_efficiency_curve``: the compute model's parametric size curve
  (tiles and waves of SMs) applies until a calibrated profile supplies a measured one.
- ``cpu`` models local torch.distributed gloo processes on one machine, one thread each:
  8 GiB, ~100 GFLOP/s fp32, ~28 GB/s, a measured size curve (operands cold in cache, as in
  a training step: mid-sized matmuls run ~20% slower than hot), ~2.3 GB/s bus bandwidth with
  ~440 µs latency through gloo's loopback all-reduce, and ~1 ms more for an asynchronous
  message while every process computes (``busy_latency_s``, :mod:`autopar.calibrate.busy`) —
  what ``autopar calibrate`` measured on the project's 2-core CI VM. It leaves
  ``memory_overlap`` 0: a core packs a matmul's operands and then computes, so their
  traffic adds to the arithmetic rather than hiding under it (fitted by ``autopar calibrate``
  from its skinny matmuls on the project's 2-core EPYC VM, 2026-11-28: a 32 x 1024 x 1024
  matmul took 1.67 ms where the roofline gives 0.88). It leaves
  ``corun_slowdown`` (how much slower a training step runs beside others) at 0: measured on
  training steps it was 1.03-1.07x with two processes on one of the project's 2-core VMs and
  1.45x on another, so a preset cannot stand for it; calibrate. A GPU's tile/wave curve
  would be wrong for a CPU core. FSDP2's host work per parameter tensor (430 µs a step beyond
  its collectives and copies) and AdamW's over DTensor shards (600 µs a tensor) are what
  ``autopar calibrate`` measured on the EPYC VM on 2026-11-28 (:mod:`autopar.calibrate.sharded`;
  ZeRO-1/2/3 measured 90-100 ms slower than DDP on the demo GPT there); GPU presets leave
  both 0, their host running ahead of their kernels. bf16/fp16 keep fp32's rate: eager CPU kernels for them are
  as likely to be slower (fp16 without AVX512-FP16 runs ~8 GFLOP/s) as faster (AVX512-BF16).
"""

from __future__ import annotations

from typing import Any

GIB = 2**30
GB = 1e9
TFLOPS = 1e12

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Dtype keys of ``peak_flops``, in display order."""

DEFAULT_KERNEL_FLOOR_S = 5e-6
"""Kernel floor of a device described without a preset: the GPU rule of thumb (see above)."""

DEFAULT_MEMORY_EFFICIENCY = 0.8
"""Memory efficiency of a device described without a preset: the GPU figure (see above)."""

DEFAULT_ATTENTION_EFFICIENCY = 0.4
"""Fused attention's share of the matmul rate, where nothing says otherwise: FlashAttention-2
(PyTorch SDPA's flash backend) measured on an H100 (see above)."""

AMPERE_ATTENTION_EFFICIENCY = min(1.0, 2.0 * DEFAULT_ATTENTION_EFFICIENCY)
"""FlashAttention-2 on an A100 reaches twice its H100 share of the matmul rate (see above)."""

HOPPER_NATIVE_ATTENTION_EFFICIENCY = min(1.0, 1.6 * DEFAULT_ATTENTION_EFFICIENCY)
"""A Hopper-native attention kernel (FlashAttention-3; cuDNN's fused attention, which
Transformer Engine runs on H100) on an H100: Shah et al. (2024, §4.1) measure FlashAttention-3
1.5-2.0x FlashAttention-2 forward and 1.5-1.75x backward; by FLOPs the backward (2.5x the
forward's) dominates, so 1.6x. cuDNN's own benchmark agrees for cuDNN 9.1 against PyTorch's
FlashAttention-2 on an H200 (``NVIDIA/cudnn-frontend`` ``benchmark/benchmark_results.csv``
@b740542, May 2024; bf16, causal, head dim 128, forward and backward together): 1.77x at 4,096
tokens, 1.69x at 8,192, 1.68x at 16,384, 1.60x at 32,768, 1.58x at 65,536. A cluster file
says which kernel its runs use."""

HOPPER_FLASH_ATTENTION_2_CURVE = (
    (6.8719476736e10, 0.289), (2.74877906944e11, 0.381), (1.099511627776e12, 0.447),
    (4.398046511104e12, 0.468), (1.7592186044416e13, 0.473))
"""FlashAttention-2's ``attention_efficiency_curve`` on an H100: the share of the preset's
matmul rate PyTorch SDPA's flash backend reaches, by FLOPs of the score matmul per call.
The first three points are measured at 1,024, 4,096 and 16,384 tokens (causal, head dim 128,
bf16, 16 heads, 16,384 tokens a call; forward and backward together: 166, 252 and 306
TFLOP/s, ``benchmarks/results/h100_2026-11-26.md``), each the measured time over the time the
cost model gives the same call at efficiency 1 on the ``H100-80GB`` preset
(``tests/test_attention_curve.py`` derives them again). The last two carry the 16,384-token
point on by the growth PyTorch's FlashAttention-2 showed at 32,768 and 65,536 tokens (one
sequence, 16 heads) in cuDNN's benchmark on an H200 (``NVIDIA/cudnn-frontend``
``benchmark/benchmark_results.csv``@b740542: 310.5, 324.8 and 328.5 TFLOP/s at 16K, 32K and
64K, x1.046 and x1.058). The kernel's share grows with the keys each query tile sweeps,
which the preset's one figure (:data:`DEFAULT_ATTENTION_EFFICIENCY`, the middle of the
measured three) leaves out. The curve is keyed by the call's FLOPs, as calibration's is: a
call with fewer heads (tensor parallelism) than the measured 16 reads the point of a shorter
sequence, a pessimistic approximation there. Not in the presets: it prices another framework's FlashAttention-2
runs in ``benchmarks/fidelity_sources.py``; autopar's own GPU programs run its generated
kernels, priced against the one figure."""


HOPPER_FP8_MATMUL_EFFICIENCY = 0.9
"""fp8 GEMMs on Hopper reach 0.9 of the efficiency bf16 GEMMs reach at the same shape:
``torch._scaled_mm`` (e4m3, tensorwise scales, cuBLASLt -- the library Transformer Engine and
torchao call) against bf16 ``mm`` on the 24 forward and backward products of Llama 3 8B's
and 70B's linear layers at 8,192 tokens ran 1.79x faster (median; 1.49-1.96x) where the
datasheet peaks differ by 2x: 1.79 / 2 = 0.9 (measured on an H200, torch 2.11,
``benchmarks/results/h200_2026-11-29.md``, ``benchmarks/gpu_fp8_gemm.py``). An H100 has the
H200's tensor cores and clocks; its figure is this one, not measured apart. Other devices
keep 1 (unmeasured)."""


HOPPER_GENERATED_ATTENTION = (0.86, 0.58)
"""autopar's generated attention kernels (Triton) on Hopper, forward and backward, as a share
of SDPA's flash backend's speed (the kernel ``attention_efficiency`` describes): causal, head
dim 128, bf16, the medians over 1,024, 4,096 and 16,384 tokens of ``benchmarks/attention.py``
on an H100 (forward 0.59 / 0.86 / 0.90, backward 0.62 / 0.58 / 0.53;
``benchmarks/results/h100_2026-11-26.md``). A training step on an H200 agreed: its attention
kernels took 45-48 ms where SDPA's efficiency priced 28.5 (1.6-1.7x; these give 1.56x,
``benchmarks/results/h200_2026-11-29.md``). At head dim 64 the backward is closer to SDPA's
(0.68-0.82), non-causal at 128 alike (0.60-0.66): one pair for the case LLMs run. The H200
and H100-96GB have the H100's SMs; other GPUs keep 1 (unmeasured)."""


H100_TFLOPS = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
"""H100 SXM5 dense peaks (Hopper whitepaper), at its 700 W board power."""

H100_500W_SHARE = (835.5 + (500 - 400) / (700 - 400) * (989.4 - 835.5)) / 989.4
"""An H100's share of its SXM5 peak when its board power is capped at 500 W (torchtitan's
Grand Teton H100s): interpolated by power between the two datasheet points of the same
132-SM chip, the NVL (835.5 dense bf16 TFLOP/s at 400 W) and the SXM5 (989.4 at 700 W):
886.8, 0.896 of the SXM5's. Clocks fall with the power limit, not with the name: a
power-law fit (power ~ clock^3) through the SXM5 point puts the NVL at 0.83 of it where the
datasheet says 0.844, so a straight line between the two is within a percent or two of
either rule at 500 W. torchtitan's eager FSDP runs of Llama 3 8B on A100s are priced
within 4% (``torchtitan_performance_md_2024``); on these H100s they were 9-13% optimistic
with the earlier midpoint of the two peaks (0.922), a placing by name, not by power."""


GPU_SPEED_SPREAD = 0.08 / (4 * 1.349)
"""Chip-to-chip speed spread of a GPU fleet, as a coefficient of variation: 1.5%. Sinha et
al. ("Not All GPUs Are Created Equal", SC'22) ran the same kernels and training iterations
on over 90% of the GPUs of five clusters (V100s on Summit, Longhorn and Vortex, Quadro RTX
5000s on Frontera, MI60s on Corona) and found an average performance variation of 8% (max
22%) between chips of one SKU, whatever the application, vendor or cooling. Their variation
is the box plot's whisker span over the median, (Q3 + 1.5 IQR) - (Q1 - 1.5 IQR) = 4 IQR
(``plot_script/plot_aggregated.py`` of their artifact, hal-uw/gpu_variability_sc22_artifact);
for normally spread speeds IQR = 1.349 sigma, so sigma = 8% / 5.4. Measured on those
fleets, not on A100s or H100s: every GPU preset carries it unmeasured. CPU processes on one
machine share one chip: 0."""


def _preset(
    name: str,
    *,
    memory_gib: float,
    tflops: dict[str, float],
    hbm_gb_per_s: float,
    matmul_efficiency: float,
    intra: tuple[float, float],
    inter: tuple[float, float],
    backend: str = "nccl",
    kernel_floor_s: float = DEFAULT_KERNEL_FLOOR_S,
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY,
    attention_efficiency: float = DEFAULT_ATTENTION_EFFICIENCY,
    curve: tuple[tuple[float, float], ...] = (),
    allocation_ns_per_byte: float = 0.0,
    busy_latency_us: float = 0.0,
    corun_slowdown: float = 0.0,
    memory_overlap: float = 1.0,
    sharded_host_us_per_tensor: float = 0.0,
    sharded_optimizer_us_per_tensor: float = 0.0,
    fp8_matmul_efficiency: float = 1.0,
    generated_attention: tuple[float, float] = (1.0, 1.0),
    speed_spread: float = GPU_SPEED_SPREAD,
) -> dict[str, Any]:
    """One preset as a cluster dict in base units; links are (GB/s, µs)."""
    return {
        "backend": backend,
        "device": {
            "name": name,
            "memory_bytes": round(memory_gib * GIB),
            "peak_flops": {k: v * TFLOPS for k, v in tflops.items()},
            "memory_bandwidth_bytes_per_s": hbm_gb_per_s * GB,
            "matmul_efficiency": matmul_efficiency,
            "kernel_floor_s": kernel_floor_s,
            "memory_efficiency": memory_efficiency,
            "attention_efficiency": attention_efficiency,
            "matmul_efficiency_curve": [list(point) for point in curve],
            "allocation_s_per_byte": allocation_ns_per_byte / 1e9,
            "corun_slowdown": corun_slowdown,
            "memory_overlap": memory_overlap,
            "fp8_matmul_efficiency": fp8_matmul_efficiency,
            "generated_attention_forward": generated_attention[0],
            "generated_attention_backward": generated_attention[1],
            "sharded_host_s_per_tensor": sharded_host_us_per_tensor / 1e6,
            "sharded_optimizer_s_per_tensor": sharded_optimizer_us_per_tensor / 1e6,
            "speed_spread": speed_spread,
        },
        "intra_node_link": {"bandwidth_bytes_per_s": intra[0] * GB, "latency_s": intra[1] / 1e6,
                            "busy_latency_s": busy_latency_us / 1e6},
        "inter_node_link": {"bandwidth_bytes_per_s": inter[0] * GB, "latency_s": inter[1] / 1e6},
    }


# fmt: off
_TABLE = [
    # V100 SXM2 32GB datasheet; NVLink2 6 x 25 GB/s per direction; DGX-1: 4 x EDR 100 Gb/s / 8 GPUs.
    _preset("V100-32GB", memory_gib=32, tflops={"fp32": 15.7, "fp16": 125.0},
            hbm_gb_per_s=900, matmul_efficiency=0.75, intra=(150, 5), inter=(6.25, 10)),
    # A100 SXM4 40GB datasheet (HBM2 1555 GB/s); NVLink3 600 GB/s bidir; DGX A100: 8 x HDR 200G.
    _preset("A100-40GB", memory_gib=40,
            tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
            hbm_gb_per_s=1555, matmul_efficiency=0.75, intra=(300, 3), inter=(25, 10), attention_efficiency=AMPERE_ATTENTION_EFFICIENCY),
    # A100 SXM4 80GB datasheet (HBM2e 2039 GB/s); NVLink3 600 GB/s bidir; DGX A100: 8 x HDR.
    _preset("A100-80GB", memory_gib=80,
            tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
            hbm_gb_per_s=2039, matmul_efficiency=0.75, intra=(300, 3), inter=(25, 10), attention_efficiency=AMPERE_ATTENTION_EFFICIENCY),
    # H100 SXM5 (Hopper whitepaper, dense); NVLink4 900 GB/s bidir; DGX H100: 8 x NDR 400 Gb/s.
    _preset("H100-80GB", memory_gib=80, tflops=H100_TFLOPS,
            hbm_gb_per_s=3350, matmul_efficiency=0.7, intra=(450, 3), inter=(50, 8),
            fp8_matmul_efficiency=HOPPER_FP8_MATMUL_EFFICIENCY,
            generated_attention=HOPPER_GENERATED_ATTENTION),
    # H100 with 96 GB HBM2e at 2.4 TB/s, as in Meta's Grand Teton hosts (torchtitan's
    # benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"): run at a 500 W limit, its
    # peak "is between SXM and NVL" (ibid., footnote 2): placed there by its power limit
    # (H100_500W_SHARE, below), every dtype scaled alike; NVLink4; 400 Gb/s RDMA per GPU.
    _preset("H100-96GB", memory_gib=96,
            tflops={k: round(v * H100_500W_SHARE, 1) for k, v in H100_TFLOPS.items()},
            hbm_gb_per_s=2400, matmul_efficiency=0.7, intra=(450, 3), inter=(50, 8),
            fp8_matmul_efficiency=HOPPER_FP8_MATMUL_EFFICIENCY,
            generated_attention=HOPPER_GENERATED_ATTENTION),
    # H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s; NVLink4; DGX H200: 8 x NDR.
    # matmul_efficiency measured: cuBLAS bf16 mm at Llama 3 8B/70B layer shapes, 8,192
    # tokens, 741 TFLOP/s median (686-790) of 989.4 (benchmarks/gpu_fp8_gemm.py,
    # benchmarks/results/h200_2026-11-29.md), where 0.7 priced them at 674-691.
    _preset("H200", memory_gib=141,
            tflops={"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            hbm_gb_per_s=4800, matmul_efficiency=0.75, intra=(450, 3), inter=(50, 8),
            fp8_matmul_efficiency=HOPPER_FP8_MATMUL_EFFICIENCY,
            generated_attention=HOPPER_GENERATED_ATTENTION),
    # HGX B200 datasheet per GPU (sparse/2): 180 GB, 7.7 TB/s; NVLink5 1.8 TB/s bidir; 8 x NDR.
    _preset("B200", memory_gib=180,
            tflops={"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
            hbm_gb_per_s=7700, matmul_efficiency=0.7, intra=(900, 3), inter=(50, 8)),
    # MI300X datasheet; xGMI 7 links x ~48 GB/s usable (see above) = 336 GB/s; 8 x 400 Gb/s NICs.
    _preset("MI300X", memory_gib=192,
            tflops={"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
            hbm_gb_per_s=5300, matmul_efficiency=0.6, intra=(336, 5), inter=(50, 10)),
    # gloo processes on one machine, one thread each: `autopar calibrate --quick` on the
    # project's 2-core x86 CI VM (AMD EPYC, 2026-11-24), rounded; 10 GbE between hosts.
    # Calibrate your own machine: CPUs differ by several times.
    _preset("cpu", memory_gib=8, tflops={"fp32": 0.10, "bf16": 0.10, "fp16": 0.10},
            hbm_gb_per_s=28, matmul_efficiency=1.0, intra=(2.3, 440), inter=(1.25, 100),
            backend="gloo", kernel_floor_s=3e-6, memory_efficiency=0.5, attention_efficiency=0.9,
            curve=((2.5e5, 0.59), (4e6, 0.74), (1.7e7, 0.81), (3.4e7, 0.89), (2.7e8, 0.97),
                   (2e9, 1.0)),
            allocation_ns_per_byte=0.3, busy_latency_us=1000, memory_overlap=0.0,
            sharded_host_us_per_tensor=430, sharded_optimizer_us_per_tensor=600,
            speed_spread=0.0),
]
# fmt: on

PRESETS: dict[str, dict[str, Any]] = {p["device"]["name"]: p for p in _TABLE}
"""Preset name -> partial cluster dict (base units), in the schema ``load_cluster`` reads."""
