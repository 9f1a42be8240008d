"""Block sizes for the generated kernels, from a small table keyed by head dim, dtype, device.

Tile shapes are the one tuning knob that changes with hardware but not with the spec, so
they stay out of the generated source (they are `tl.constexpr` launch arguments) and live
here. On CUDA the entry is the first autotune candidate; elsewhere it is used as is. The
interpreter entry is small so tests with lengths of a few dozen still cross block edges.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import AttentionSpec

COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""Multiply-adds contracted into FMAs, as nvcc compiles FlashAttention. Said explicitly:
Triton 3.9 warns that its default turns the other way in 3.10, which would change the
kernels' speed and last bits without any change here. (The interpreter ignores it.)"""


@dataclass(frozen=True)
class Blocks:
    """Tiles for the three kernels: (queries, keys) per program, plus launch hints."""

    fwd: tuple[int, int]
    dkdv: tuple[int, int]
    dq: tuple[int, int]
    num_warps: int = 4
    num_stages: int = 2


# (device, head-dim bucket, dtype class) -> Blocks. Devices: "interpreter"; "sm90" (H100,
# and Blackwell datacenter parts, 227 KB shared memory); "sm80" (A100, 163 KB); "cuda" for
# every other capability (consumer and older parts: sized for 99 KB). Head-dim buckets are the padded dims 64, 128, 256;
# dtype class "16" is fp16/bf16 and "32" is fp32 (twice the shared memory per tile).
BLOCK_TABLE: dict[tuple[str, int, str], Blocks] = {
    ("interpreter", 64, "16"): Blocks((32, 32), (32, 32), (32, 32), 1, 1),
    ("interpreter", 64, "32"): Blocks((32, 32), (32, 32), (32, 32), 1, 1),
    ("interpreter", 128, "16"): Blocks((32, 32), (32, 32), (32, 32), 1, 1),
    ("interpreter", 128, "32"): Blocks((32, 32), (32, 32), (32, 32), 1, 1),
    ("interpreter", 256, "16"): Blocks((16, 16), (16, 16), (16, 16), 1, 1),
    ("interpreter", 256, "32"): Blocks((16, 16), (16, 16), (16, 16), 1, 1),
    ("sm90", 64, "16"): Blocks((128, 64), (64, 128), (128, 64), 4, 3),
    ("sm90", 64, "32"): Blocks((64, 64), (32, 64), (64, 32), 4, 2),
    ("sm90", 128, "16"): Blocks((128, 64), (64, 64), (64, 64), 8, 3),
    ("sm90", 128, "32"): Blocks((64, 32), (32, 32), (32, 32), 4, 2),
    ("sm90", 256, "16"): Blocks((64, 32), (32, 32), (32, 32), 8, 2),
    ("sm90", 256, "32"): Blocks((32, 32), (16, 32), (32, 16), 4, 1),
    ("sm80", 64, "16"): Blocks((128, 64), (32, 128), (128, 32), 4, 3),
    ("sm80", 64, "32"): Blocks((64, 64), (32, 64), (64, 32), 4, 2),
    ("sm80", 128, "16"): Blocks((128, 64), (64, 64), (64, 64), 8, 2),
    ("sm80", 128, "32"): Blocks((64, 32), (32, 32), (32, 32), 4, 2),
    ("sm80", 256, "16"): Blocks((64, 32), (32, 32), (32, 32), 8, 1),
    ("sm80", 256, "32"): Blocks((32, 32), (16, 32), (32, 16), 4, 1),
    ("cuda", 64, "16"): Blocks((64, 64), (32, 64), (64, 32), 4, 2),
    ("cuda", 64, "32"): Blocks((64, 32), (32, 32), (32, 32), 4, 2),
    ("cuda", 128, "16"): Blocks((64, 64), (32, 64), (64, 32), 4, 2),
    ("cuda", 128, "32"): Blocks((32, 32), (32, 32), (32, 32), 4, 1),
    ("cuda", 256, "16"): Blocks((32, 32), (16, 32), (32, 16), 4, 1),
    ("cuda", 256, "32"): Blocks((16, 32), (16, 16), (16, 16), 4, 1),
}


def device_key(capability: tuple[int, int] | None) -> str:
    """The table's device name for a CUDA capability, or "interpreter" for None."""
    if capability is None:
        return "interpreter"
    if capability[0] in (9, 10):
        return "sm90"
    if capability == (8, 0):
        return "sm80"
    return "cuda"


def block_sizes(spec: AttentionSpec, capability: tuple[int, int] | None) -> Blocks:
    """Tiles for a spec on a device (`capability` None means Triton's interpreter)."""
    bucket = 64 if spec.block_d <= 64 else 128 if spec.block_d <= 128 else 256
    width = "32" if spec.dtype == "float32" else "16"
    return BLOCK_TABLE[(device_key(capability), bucket, width)]


def autotune_candidates(blocks: Blocks) -> list[Blocks]:
    """Configs worth trying on CUDA around a table entry: itself, narrower key tiles, more warps."""
    def halve(tile: tuple[int, int]) -> tuple[int, int]:
        return tile[0], max(16, tile[1] // 2)

    candidates = [
        blocks,
        Blocks(halve(blocks.fwd), halve(blocks.dkdv), halve(blocks.dq), blocks.num_warps,
               blocks.num_stages),
        Blocks(blocks.fwd, blocks.dkdv, blocks.dq, min(8, blocks.num_warps * 2), blocks.num_stages),
    ]
    unique: list[Blocks] = []
    for c in candidates:
        if c not in unique:
            unique.append(c)
    return unique
