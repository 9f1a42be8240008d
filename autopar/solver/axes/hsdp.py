"""Which HSDP shapes a setting may use: ZeRO sharded within a node, replicated across nodes.

Fully sharded data parallelism over hundreds of ranks gathers every layer's weights across
nodes, where per-call latency and the slow links dominate. HSDP (hybrid sharded data
parallelism: FSDP2 on a 2-D mesh, ``(dp_replicate, dp_shard)``) shards the states over the
ranks of one group only, so the per-layer all-gathers and reduce-scatters stay on the fast
links, and all-reduces each gradient shard across the groups once per step; the price is
states ``dp_replicate`` times larger than under full sharding. The solver prices both.

Groups are consecutive data-parallel ranks (the mesh is ``pp, dp, cp, tp``, outer to inner),
so the group that fills one node holds ``devices_per_node / (cp x tp)`` data-parallel ranks.
Only that group size is offered: a smaller one moves the same bytes across nodes with more
replicas' memory, and a larger one crosses the node boundary again; a pinned
``dp_replicate`` can ask for any shape.
"""

from __future__ import annotations

from autopar.core.errors import AutoparError
from autopar.solver.options import PlanOptions


def replicate_degrees(options: PlanOptions, dp: int, cp: int, tp: int, zero: int, ep: int,
                      offload: str, devices_per_node: int) -> list[int]:
    """The ``dp_replicate`` values to price for one (mesh, ZeRO stage): 1 (ZeRO over all of
    dp x cp) and, where ZeRO runs over ranks of more than one node, the one whose groups fill
    a node each. A pinned ``options.dp_replicate`` is the only value (none where this mesh
    cannot run it: it must divide dp, under ZeRO 1-3, without experts or offload).

    >>> replicate_degrees(PlanOptions(), dp=8, cp=1, tp=2, zero=3, ep=1, offload="none",
    ...                   devices_per_node=8)
    [1, 2]
    >>> replicate_degrees(PlanOptions(), dp=4, cp=1, tp=2, zero=3, ep=1, offload="none",
    ...                   devices_per_node=8)   # ZeRO's ranks are all in one node
    [1]
    """
    runs = zero > 0 and ep == 1 and offload == "none"
    pinned = options.dp_replicate
    if pinned is not None:
        if pinned == 1:
            return [1]
        return [pinned] if runs and dp % pinned == 0 and pinned < dp * cp else []
    if not runs or devices_per_node % (cp * tp):
        return [1]
    per_node = devices_per_node // (cp * tp)  # data-parallel ranks in one node
    if per_node < 2 or per_node >= dp or dp % per_node:
        return [1]
    return [1, dp // per_node]


def check_dp_replicate(options: PlanOptions) -> None:
    """A pinned ``dp_replicate`` > 1 needs a ZeRO stage that shards (1, 2 or 3), and a
    pinned dp it divides leaving groups of 2 or more ranks; refused before any search."""
    replicate = options.dp_replicate or 1
    if replicate == 1:
        return
    if not any(z > 0 for z in options.zero):
        raise AutoparError(
            f"dp_replicate={replicate} (HSDP) shards with ZeRO 1, 2 or 3, but only "
            f"ZeRO {', '.join(map(str, options.zero))} is allowed", where="dp_replicate",
            fix="allow zero=3 (or 1, 2), or drop dp_replicate")
    dp, cp = options.dp, options.cp or 1
    if dp is not None and (dp % replicate or replicate >= dp * cp):
        raise AutoparError(
            f"dp_replicate={replicate} does not split dp={dp}"
            + (f" (x cp={cp})" if cp > 1 else "") + " into replica groups of 2 or more ranks",
            where="dp_replicate",
            fix=f"pick a divisor of dp={dp} that leaves 2 or more ranks per group "
            "(e.g. dp / devices per node), or drop dp_replicate")
