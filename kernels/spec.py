"""AttentionSpec: everything that changes the text of a generated attention kernel.

A spec is a frozen, hashable dataclass, so it keys the kernel cache. It is validated when it
is created, and every problem is reported at once. Batch, head counts and sequence lengths
are not part of it: they are runtime arguments, and every kernel masks its loads, so lengths
that are not multiples of the block sizes are always handled.

Conventions (torch's `scaled_dot_product_attention` and FlashAttention):

- `causal`: query i sees key j iff j <= i, aligned top-left like SDPA's `is_causal`.
- `window=(left, right)`: query i sees key j iff i - left <= j <= i + right, counted as
  FlashAttention counts it; -1 (or None) on a side means unbounded. `causal` is right = 0.
- `group_size`: query heads per key/value head (GQA; MQA is group_size == heads).
- `scale`: softmax scale, 1/sqrt(head_dim) when None.
- `softcap`: scaled scores become softcap * tanh(scores / softcap) before the bias is added
  (Gemma-2; FlashAttention's `softcap`); None: no capping.
- `bias`: an additive bias tensor is passed; `bias_grad`: the backward returns its gradient.
- `alibi`: ALiBi slopes are passed (adds -slope * |i - j|).
- `dropout_p`: attention-probability dropout, kept elements scaled by 1/(1-p).
- `dtype`: of q, k, v and the output: "float32", "float16" or "bfloat16" (the
  log-sum-exp is always float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = ("float32", "float16", "bfloat16")
MAX_HEAD_DIM = 256

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
            "bf16": "bfloat16"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch.bfloat16 (or "bf16") -> "bfloat16"; ValueError for a dtype the kernels lack."""
    if isinstance(dtype, torch.dtype):
        name = _NAMES.get(dtype)
    else:
        name = _ALIASES.get(dtype, dtype)
        name = name if name in DTYPES else None
    if name is None:
        raise ValueError(f"dtype {dtype} is not supported by the attention kernels: "
                         f"use one of {DTYPES}")
    return name


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class AttentionSpec:
    """What one generated attention kernel set is specialized for (see module docstring)."""

    head_dim: int
    dtype: str = "float32"
    causal: bool = False
    window: tuple[int, int] | None = None
    group_size: int = 1
    scale: float | None = None
    softcap: float | None = None
    bias: bool = False
    bias_grad: bool = False
    alibi: bool = False
    dropout_p: float = 0.0

    def __post_init__(self) -> None:
        errors: list[str] = []
        hd = self.head_dim
        if not _is_int(hd) or not 1 <= hd <= MAX_HEAD_DIM:
            errors.append(f"head_dim must be an int in [1, {MAX_HEAD_DIM}], got {hd!r}")
        try:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        except (ValueError, TypeError) as e:
            errors.append(str(e))
        if not isinstance(self.causal, bool):
            errors.append(f"causal must be a bool, got {self.causal!r}")
        window = self.window
        if window is not None:
            if not (isinstance(window, (tuple, list)) and len(window) == 2
                    and all(w is None or _is_int(w) for w in window)):
                errors.append(f"window must be (left, right) ints, -1 or None for unbounded, "
                              f"got {window!r}")
            else:
                left, right = (-1 if w is None else w for w in window)
                if left < -1 or right < -1:
                    errors.append(f"window sides must be >= 0, or -1 for unbounded, got {window!r}")
                elif self.causal and right > 0:
                    errors.append(f"causal=True means the window's right side is 0, but window="
                                  f"{tuple(window)!r}: pass window=({left}, 0) or causal=False")
                else:
                    if self.causal:
                        right = 0
                    window = None if (left, right) == (-1, -1) else (left, right)
                    object.__setattr__(self, "window", window)
        g = self.group_size
        if not _is_int(g) or g < 1:
            errors.append(f"group_size (query heads per kv head) must be an int >= 1, got {g!r}")
        scale = self.scale
        if scale is None:
            if _is_int(hd) and hd >= 1:
                object.__setattr__(self, "scale", 1.0 / math.sqrt(hd))
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            errors.append(f"scale must be a finite number > 0, got {scale!r}")
        else:
            object.__setattr__(self, "scale", float(scale))
        cap = self.softcap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) \
                    or not math.isfinite(cap) or cap <= 0:
                errors.append(f"softcap must be a finite number > 0 or None, got {cap!r}")
            else:
                object.__setattr__(self, "softcap", float(cap))
        for name in ("bias", "bias_grad", "alibi"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.bias_grad is True and self.bias is not True:
            errors.append("bias_grad=True needs bias=True: only a bias tensor has a gradient")
        p = self.dropout_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            errors.append(f"dropout_p must be a number in [0, 1), got {p!r}")
        else:
            object.__setattr__(self, "dropout_p", float(p))
        if errors:
            raise ValueError("invalid AttentionSpec:\n  - " + "\n  - ".join(errors))

    @property
    def window_left(self) -> int:
        """Keys visible to the left of a query; -1 unbounded."""
        return -1 if self.window is None else self.window[0]

    @property
    def window_right(self) -> int:
        """Keys visible to the right of a query; -1 unbounded (0 when causal)."""
        if self.causal:
            return 0
        return -1 if self.window is None else self.window[1]

    @property
    def block_d(self) -> int:
        """head_dim padded to the next power of two (at least 16, tl.dot's smallest operand)."""
        return max(16, 1 << (self.head_dim - 1).bit_length())

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        """One line naming every choice, printed in the generated source's header."""
        parts = [f"head_dim={self.head_dim} (padded {self.block_d})", self.dtype]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.group_size > 1:
            parts.append(f"group_size={self.group_size}")
        parts.append(f"scale={self.scale!r}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap!r}")
        if self.bias:
            parts.append("bias" + (" (with grad)" if self.bias_grad else ""))
        if self.alibi:
            parts.append("alibi")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p!r}")
        return ", ".join(parts)
