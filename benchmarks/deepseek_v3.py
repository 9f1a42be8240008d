"""DeepSeek-V3's published training layout, priced by autopar's cost model, beside the GPU
hours its technical report gives.

Published (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437):

- section 3.1: 2048 H800 GPUs, 8 per node; 16-way pipeline parallelism (DualPipe),
  64-way expert parallelism across 8 nodes, ZeRO-1 data parallelism; no tensor
  parallelism; FP8 mixed precision (section 3.3); recomputation of RMSNorm and the MLA
  up-projections (section 3.2.3);
- table 1: 2,664K H800 GPU hours of pre-training on 14.8T tokens, i.e. 180K GPU hours per
  trillion tokens;
- section 4.2: a batch of 15,360 sequences of 4,096 tokens (after its ramp-up).

autopar has no DualPipe: its closest schedule is ZB-V (a zero-bubble V schedule, two chunks
per rank), and "op" recomputation (torchtitan's per-op policy) stands for the selective
recomputation. The H800's NVLink is modelled by ``benchmarks/data/clusters/deepseek-v3-h800.yaml``.
Every autopar figure here is **modelled**, and outside the ground the cost model was
validated on (no MoE run at this scale was measured): read the ratio as the cost model's
error on this layout, not as a claim about DeepSeek's efficiency.

    python benchmarks/deepseek_v3.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "benchmarks" / "data" / "clusters" / "deepseek-v3-h800.yaml"
PUBLISHED_GPU_HOURS = 2_664_000  # table 1, pre-training
PUBLISHED_TOKENS = 14.8e12
LAYOUT = ["--pp", "16", "--ep", "64", "--dp", "128", "--tp", "1", "--zero", "1",
          "--precision", "fp8", "--schedule", "zb_v", "--recompute", "op",
          "--microbatch", "1"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "estimate.json"
        cmd = [sys.executable, "-m", "autopar.cli.main", "estimate", "deepseek-v3",
               "--cluster", str(CLUSTER), *LAYOUT, "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if not out.exists():
            print(proc.stdout, proc.stderr, sep="\n")
            return 1
        report = json.loads(out.read_text())
    predicted, assumed = report["predicted"], report["assumptions"]
    step_s = predicted["step_time_s"]
    devices = assumed["devices"]
    tokens_per_step = assumed["global_batch"] * assumed["seq"]
    time = predicted["time"]
    gpu_hours_per_t = step_s * devices / 3600 * 1e12 / tokens_per_step
    published_per_t = PUBLISHED_GPU_HOURS / (PUBLISHED_TOKENS / 1e12)
    memory = predicted["peak_memory_bytes"] / 2**30
    print("DeepSeek-V3 on 2048 H800 (pp16 x dp128 with ep64, ZeRO-1, fp8, zb_v for DualPipe)")
    print(f"  step time                  {step_s:10.2f} s      (modelled)")
    for key, what in (("compute_s", "compute"),
                      ("tp_comm_s", "token all-to-alls (not overlapped)"),
                      ("p2p_s", "pipeline sends"), ("bubble_s", "pipeline bubble"),
                      ("dp_exposed_s", "exposed data-parallel comm")):
        print(f"    {what:36} {time[key]:8.2f} s")
    print(f"  tokens per step            {tokens_per_step:10.3e}")
    print(f"  peak memory per GPU        {memory:10.1f} GiB    (modelled; fits: "
          f"{predicted['fits']})")
    print(f"  GPU hours per 1T tokens    {gpu_hours_per_t:10,.0f}        (modelled)")
    print(f"  published                  {published_per_t:10,.0f}        "
          "(arXiv:2412.19437, table 1)")
    print(f"  modelled / published       {gpu_hours_per_t / published_per_t:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
