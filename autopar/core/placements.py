"""How a tensor is laid out along one mesh axis: the DTensor algebra, as plain data.

A placement says what each device on a mesh axis holds of the global ("logical") tensor:

- ``Replicate()``: the whole tensor.
- ``Shard(dim)``: an equal slice along tensor dimension ``dim``. ``Shard(dim, groups=k)``
  means the dimension is made of ``k`` equal blocks (a fused QKV projection has three) and
  each block is sliced separately; the local tensor is the concatenation of the local slices
  of each block. DTensor calls this a strided shard; Megatron reorders fused weights for the
  same reason.
- ``Partial(reduce)``: a pending reduction; the global value is the sum (or mean) of the
  local values.

Placements are written compactly in plans and reports: ``R``, ``S(0)``, ``S(2)g3``, ``P``,
``P(avg)``.

>>> parse_placement("S(1)g3")
Shard(dim=1, groups=3)
>>> str(Partial("avg"))
'P(avg)'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.core.errors import PlanError


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    def is_shard(self, dim: int | None = None) -> bool:
        return False


@dataclass(frozen=True)
class Shard:
    dim: int
    groups: int = 1

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard.dim must be normalized to >= 0, got {self.dim}")
        if self.groups < 1:
            raise ValueError(f"Shard.groups must be >= 1, got {self.groups}")

    def __str__(self) -> str:
        return f"S({self.dim})" + (f"g{self.groups}" if self.groups > 1 else "")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim


REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE_OPS:
            raise ValueError(f"Partial.reduce must be one of {REDUCE_OPS}, got {self.reduce!r}")

    def __str__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"

    def is_shard(self, dim: int | None = None) -> bool:
        return False


Placement = Replicate | Shard | Partial

R = Replicate()
P = Partial()

_SHARD_RE = re.compile(r"^S\((\d+)\)(?:g(\d+))?$")


def parse_placement(text: str) -> Placement:
    """The inverse of ``str(placement)``; plans store placements this way."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("P(") and text.endswith(")"):
        reduce = text[2:-1]
        if reduce in REDUCE_OPS:
            return Partial(reduce)
    m = _SHARD_RE.match(text)
    if m:
        return Shard(int(m.group(1)), int(m.group(2) or 1))
    raise PlanError(
        f"unknown placement {text!r}",
        where="placement",
        fix="use R, P, P(avg), S(dim) or S(dim)gK, e.g. 'S(0)' or 'S(2)g3'",
    )


def divisor(placement: Placement, n: int) -> int:
    """How many parts ``placement`` splits a value into over a mesh axis of ``n`` ranks."""
    return n if isinstance(placement, Shard) else 1


def local_shape(
    shape: tuple[int, ...], placements: tuple[Placement, ...], axis_sizes: tuple[int, ...]
) -> tuple[int, ...]:
    """Shape of the local tensor for ``placements`` over mesh axes of ``axis_sizes``."""
    out = list(shape)
    for placement, n in zip(placements, axis_sizes):
        if isinstance(placement, Shard) and n > 1:
            if out[placement.dim] % n:
                raise ValueError(
                    f"dimension {placement.dim} of size {out[placement.dim]} does not divide "
                    f"evenly over {n} devices"
                )
            out[placement.dim] //= n
    return tuple(out)


def can_shard(size: int, axis_size: int, groups: int = 1) -> bool:
    """Even sharding only: each of ``groups`` blocks must split into ``axis_size`` pieces."""
    return size > 0 and size % (axis_size * groups) == 0
