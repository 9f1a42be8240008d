"""Compile the generated kernels for a CUDA target without a GPU, to check them offline.

Why: the interpreter executes the kernels' arithmetic but not Triton's type checks, layout
and shared-memory allocation, so a kernel can pass every CPU test and still fail to compile
on a GPU, or need more shared memory than the block table's tiles allow. Triton's own
compiler (with the `ptxas` its wheel ships) builds a cubin for any capability on a CPU-only
machine, which lets CI check every block-table entry against the device's shared memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .blocks import COMPILE_OPTIONS, Blocks, block_sizes
from .codegen import build_kernels
from .spec import AttentionSpec

SHARED_MEMORY_BYTES: dict[tuple[int, int], int] = {
    (8, 0): 166912,  # A100: 163 KB per block (opt-in)
    (8, 6): 101376,  # RTX 30xx, A10, A40: 99 KB
    (8, 9): 101376,  # L4, L40, RTX 40xx: 99 KB
    (9, 0): 232448,  # H100: 227 KB
}
"""Largest dynamic shared memory one program may use, per CUDA capability."""

_POINTER_ARGS = ("Q", "K", "V", "Bias", "Out", "DO", "DK", "DV", "DQ")
_FP32_POINTER_ARGS = ("Slopes", "Lse", "Delta", "DBias")


@dataclass(frozen=True)
class CompiledKernel:
    """What compiling one kernel for a target produced (compiled, not measured on a GPU)."""

    name: str
    block: tuple[int, int]
    num_warps: int
    num_stages: int
    shared_bytes: int
    seconds: float


def cross_compile(spec: AttentionSpec, capability: tuple[int, int],
                  blocks: Blocks | None = None) -> list[CompiledKernel]:
    """Compile forward, dK/dV and dQ kernels of `spec` to a cubin for `capability`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = build_kernels(spec, False)
    blocks = blocks or block_sizes(spec, capability)
    elem = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}[spec.dtype]
    results = []
    for fn, block in ((kernels.fwd, blocks.fwd), (kernels.dkdv, blocks.dkdv),
                      (kernels.dq, blocks.dq)):
        signature: dict[str, str] = {}
        constants = {"BLOCK_M": block[0], "BLOCK_N": block[1]}
        for arg in fn.arg_names:
            if arg in constants:
                signature[arg] = "constexpr"
            elif arg in _POINTER_ARGS:
                signature[arg] = elem
            elif arg in _FP32_POINTER_ARGS:
                signature[arg] = "*fp32"
            else:
                signature[arg] = "i32"
        start = time.perf_counter()
        compiled = triton.compile(
            ASTSource(fn, signature, constants),
            target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
            options={"num_warps": blocks.num_warps, "num_stages": blocks.num_stages,
                     **COMPILE_OPTIONS})
        results.append(CompiledKernel(fn.__name__, block, blocks.num_warps, blocks.num_stages,
                                      int(compiled.metadata.shared),
                                      time.perf_counter() - start))
    return results
