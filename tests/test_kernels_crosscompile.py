"""The compiled (CUDA) path, checked without a GPU: Triton's compiler builds each generated
kernel into a cubin for A100 (sm80) and H100 (sm90) from this CPU machine. The interpreter
tests check the arithmetic; this checks what only compilation catches (Triton's type rules,
layouts, and the shared memory the block table's tiles need against the device's limit)."""

from __future__ import annotations

import pytest

from autopar.kernels import AttentionSpec
from autopar.kernels.crosscompile import SHARED_MEMORY_BYTES, cross_compile

pytest.importorskip("triton")

SPECS = {
    "bf16-causal-d64": AttentionSpec(head_dim=64, dtype="bfloat16", causal=True),
    "fp16-gqa-bias-dropout-d128": AttentionSpec(head_dim=128, dtype="float16", group_size=4,
                                                bias=True, bias_grad=True, dropout_p=0.1),
    "bf16-window-alibi-d80": AttentionSpec(head_dim=80, dtype="bfloat16", window=(128, 0),
                                           alibi=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("name", list(SPECS))
def test_generated_kernels_compile_for_the_gpu(name: str, capability, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = cross_compile(SPECS[name], capability)
    assert [k.name for k in compiled] == ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"]
    for kernel in compiled:
        assert 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[capability], kernel
