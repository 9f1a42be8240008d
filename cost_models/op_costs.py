"""Op costs a plugin supplies: seconds for an op the roofline prices poorly (a custom kernel,
an op whose FLOPs the tracer cannot count).

A package's ``autopar.cost_models`` entry point names a function that registers them::

    from autopar.cost_models.op_costs import OpCostQuery, register_op_cost

    def register():
        @register_op_cost("mylib.fused_gelu.default")
        def fused_gelu(q: OpCostQuery) -> tuple[float, float]:
            seconds = q.bytes_moved / q.device.memory_bandwidth_bytes_per_s
            return seconds, 2 * seconds          # forward, backward (modelled)

The solver then prices every node of that op with it, on this rank's share of the work.

>>> from autopar.core.cluster import load_cluster
>>> q = OpCostQuery(0.0, 1e6, load_cluster("H100-80GB").device, "bf16", None, True)
>>> register_op_cost("doctest.op.default", replace=True)(lambda q: (1e-6, 2e-6))(q)
(1e-06, 2e-06)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.core.cluster import DeviceSpec


@dataclass(frozen=True)
class OpCostQuery:
    """One node on one rank, as a registered cost sees it."""

    flops: float  # forward FLOPs on this rank
    bytes_moved: float  # forward bytes read and written on this rank
    device: DeviceSpec
    dtype: str  # the precision word it computes in
    shape: Sequence[int] | None  # (m, n, k) when it is a matmul
    requires_grad: bool  # whether it runs a backward


OpCost = Callable[[OpCostQuery], tuple[float, float]]
_COSTS: dict[str, OpCost] = {}


def register_op_cost(target: str, replace: bool = False) -> Callable[[OpCost], OpCost]:
    """Price op ``target`` (``"namespace.name.overload"``, as ``str(node.target)`` prints
    it) with ``fn(query) -> (forward_s, backward_s)``. Registering a target twice is an error
    unless ``replace``, so two plugins cannot silently fight over an op."""

    def decorate(fn: OpCost) -> OpCost:
        if target in _COSTS and not replace:
            raise ValueError(f"op {target!r} already has a registered cost; pass replace=True")
        _COSTS[target] = fn
        return fn
    return decorate


def op_cost_for(target: str) -> OpCost | None:
    return _COSTS.get(target)
