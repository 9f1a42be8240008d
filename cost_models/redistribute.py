"""What changing a tensor's placement on one mesh axis costs, forward and backward.

The runtime keeps the Megatron convention for gradients: the gradient of a ``Replicate``
tensor is whole on every device, of a ``Shard`` tensor sharded the same way, and of a
``Partial`` tensor whole (``Replicate``). So each forward redistribution has a fixed
backward:

========== ================= =====================
forward    forward collective backward collective
========== ================= =====================
S -> R     all-gather         none (take the slice)
P -> R     all-reduce         none
P -> S     reduce-scatter     all-gather
R -> S     none (slice)       all-gather
S -> S'    all-to-all         all-to-all
R -> P     none (mask)        none
========== ================= =====================

A ``Replicate`` tensor that feeds sharded computation (a column-parallel matmul) receives a
partial gradient; :func:`partial_grad_time` is what making it whole costs (Megatron's "f"
operator): an all-reduce, or a reduce-scatter when the tensor was all-gathered from a shard
(sequence parallelism's backward).
"""

from __future__ import annotations

from autopar.core.cluster import LinkSpec
from autopar.core.placements import Partial, Placement, Shard
from autopar.cost_models.comm import collective_time


def _kind(p: Placement) -> str:
    return "S" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R"


def redistribution_collectives(src: Placement, dst: Placement) -> tuple[str | None, str | None]:
    """(forward collective, backward collective) for ``src -> dst``; None means local."""
    if src == dst:
        return None, None
    pair = _kind(src) + _kind(dst)
    table = {
        "SR": ("all_gather", None),
        "PR": ("all_reduce", None),
        "PS": ("reduce_scatter", "all_gather"),
        "RS": (None, "all_gather"),
        "SS": ("all_to_all", "all_to_all"),
        "RP": (None, None),
        "SP": ("all_gather", None),
        "PP": (None, None),  # sum <-> avg: rescale locally
    }
    return table[pair]


def redistribution_time(
    src: Placement, dst: Placement, nbytes: float, n: int, link: LinkSpec, *, backward: bool,
    backend: str = "nccl",
) -> float:
    """Seconds to move a tensor of ``nbytes`` (global size) from ``src`` to ``dst`` placement
    over ``n`` devices, including the backward collective when the tensor needs a gradient."""
    if n <= 1:
        return 0.0
    fwd, bwd = redistribution_collectives(src, dst)
    if fwd == "all_to_all":
        if src.groups == 1 and dst.groups == 1:
            nbytes = nbytes / n  # each device exchanges its own shard
        else:  # split-then-shard layouts are regathered whole, then sliced
            fwd = bwd = "all_gather"
    t = collective_time(fwd, nbytes, n, link, backend=backend) if fwd else 0.0
    if backward and bwd:
        t += collective_time(bwd, nbytes, n, link, backend=backend)
    return t


def partial_grad_time(
    src: Placement, nbytes: float, n: int, link: LinkSpec, backend: str = "nccl"
) -> float:
    """Backward cost of making the gradient of a replicated tensor whole, when sharded
    computation consumes it: reduce-scatter if the tensor was gathered from a shard (the
    gather's backward becomes the reduce-scatter), otherwise all-reduce."""
    if n <= 1:
        return 0.0
    kind = "reduce_scatter" if isinstance(src, Shard) else "all_reduce"
    return collective_time(kind, nbytes, n, link, backend=backend)


