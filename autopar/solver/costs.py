"""Cost coefficients of one planning problem at one setting, from the cost models.

Everything here is per microbatch and per device unless named otherwise, and already
multiplied by the number of graph instances a decision or value stands for. The CP-SAT model
and the exact evaluation of a chosen plan both read these numbers, so the plan's reported
prediction is the solver's objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from autopar.cluster import Cluster, LinkSpec
from autopar.cost_models.comm import axis_link
from autopar.cost_models.compute import op_time
from autopar.cost_models.memory import StateBytes, activation_bytes_per_element, model_state_bytes
from autopar.cost_models.redistribute import partial_grad_time, redistribution_time
from autopar.graph_facts import META_KEY, NodeFacts
from autopar.placements import Placement, Replicate, Shard
from autopar.solver.batch_axis import batch_scaled
from autopar.solver.options import PlanOptions
from autopar.solver.problem import Decision, Problem, ValueKey
from autopar.strategies import Strategy

_FLOAT_DTYPES = {"float32", "float64", "float16", "bfloat16"}


@dataclass(frozen=True)
class Setting:
    """One point of the outer search: mesh degrees, ZeRO stage, microbatching."""

    dp: int
    tp: int
    zero: int
    microbatch: int  # sequences per microbatch on one data-parallel rank
    microbatches: int  # microbatches per optimizer step

    @property
    def mesh(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp}


def sharded_compute(strategy: Strategy) -> bool:
    """Work splits over the axis when anything the node touches is not replicated."""
    return not all(isinstance(p, Replicate) for p in (*strategy.inputs, *strategy.outputs))


def divisor(placement: Placement, n: int) -> int:
    return n if isinstance(placement, Shard) else 1


class CostTables:
    def __init__(
        self,
        problem: Problem,
        cluster: Cluster,
        options: PlanOptions,
        setting: Setting,
        traced_batch: int,
    ):
        self.problem = problem
        self.cluster = cluster
        self.options = options
        self.setting = setting
        self.traced_batch = traced_batch
        self.tp_link: LinkSpec = axis_link(cluster, setting.mesh, "tp")
        self.dp_link: LinkSpec = axis_link(cluster, setting.mesh, "dp")
        self.element_bytes = activation_bytes_per_element(options.precision)

    # --- sizes -----------------------------------------------------------------------
    def _scale(self, d: Decision, output: int = 0) -> float:
        outs = d.batch.outputs
        if output < len(outs) and batch_scaled(outs[output]):
            return self.setting.microbatch / self.traced_batch
        return 1.0

    def _bytes(self, facts: NodeFacts, output: int) -> float:
        shape, dtype = facts.shapes[output], facts.dtypes[output]
        n = 1
        for s in shape:
            n *= s
        if dtype in _FLOAT_DTYPES:
            return n * self.element_bytes
        return n * _itemsize(dtype)

    def value_bytes(self, key: ValueKey) -> float:
        """Bytes of one instance of a value per microbatch (whole over tp, local over dp)."""
        d = self.problem.decisions[key[0]]
        return self._bytes(d.facts, key[1]) * self._scale(d, key[1])

    def value_count(self, key: ValueKey) -> int:
        return self.problem.decisions[key[0]].count

    def requires_grad(self, key: ValueKey) -> bool:
        return self.problem.decisions[key[0]].facts.requires_grad

    # --- per decision ------------------------------------------------------------------
    def compute(self, d: Decision, s: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of all instances of ``d`` under ``s``."""
        facts = d.facts
        if d.kind != "op":
            return 0.0, 0.0
        div = self.setting.tp if sharded_compute(s) else 1
        scale = self._scale(d) / div
        dtype = self.options.precision
        precision_scale = self.element_bytes / 4
        moved = (facts.bytes_read + facts.bytes_written) * scale * precision_scale
        device = self.cluster.device
        fwd = op_time(facts.fwd_flops * scale, moved, device, dtype)
        bwd = op_time(facts.bwd_flops * scale, 2 * moved, device, dtype) if facts.requires_grad else 0.0
        return fwd * d.count, bwd * d.count

    def activation_memory(self, d: Decision, s: Strategy) -> float:
        """Bytes kept for backward that belong to the node itself (its output, its buffers)."""
        facts = d.facts
        if d.kind != "op" or not facts.requires_grad:
            return 0.0
        total = 0.0
        div = self.setting.tp if sharded_compute(s) else 1
        total += facts.extra_saved_bytes * self._scale(d) * (self.element_bytes / 4) / div
        if facts.saves_output and s.outputs:
            total += self.value_bytes((d.index, 0)) / divisor(s.outputs[0], self.setting.tp)
        return total * d.count

    def states(self, d: Decision, s: Strategy) -> StateBytes:
        """Parameter, gradient and optimizer bytes of a parameter decision."""
        param = d.facts.param
        if d.kind != "param" or param is None:
            return StateBytes(0.0, 0.0, 0.0)
        numel = param.numel / divisor(s.outputs[0], self.setting.tp)
        states = model_state_bytes(
            numel,
            trainable=param.trainable,
            precision=self.options.precision if not param.is_buffer else "fp32",
            optimizer=self.options.optimizer,
            zero_stage=self.setting.zero,
            dp=self.setting.dp,
        )
        return StateBytes(states.params * d.count, states.grads * d.count, states.optimizer * d.count)

    def grad_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of this decision's gradients on one device before data-parallel sync."""
        param = d.facts.param
        if d.kind != "param" or param is None or not param.trainable:
            return 0.0
        return param.numel / divisor(s.outputs[0], self.setting.tp) * self.element_bytes * d.count

    # --- per value ---------------------------------------------------------------------
    def redistribution(self, key: ValueKey, src: Placement, dst: Placement) -> float:
        t = redistribution_time(
            src, dst, self.value_bytes(key), self.setting.tp, self.tp_link,
            backward=self.requires_grad(key),
        )
        return t * self.value_count(key)

    def partial_grad(self, key: ValueKey, src: Placement) -> float:
        if not self.requires_grad(key):
            return 0.0
        return partial_grad_time(src, self.value_bytes(key), self.setting.tp, self.tp_link) * (
            self.value_count(key)
        )

    def saved_bytes(self, key: ValueKey, placement: Placement) -> float:
        """Bytes of a value kept for backward by its consumers, in ``placement``."""
        if self.problem.decisions[key[0]].kind == "param":
            return 0.0  # weights are counted as parameters
        return self.value_bytes(key) / divisor(placement, self.setting.tp) * self.value_count(key)

    @cached_property
    def capacity(self) -> float:
        return self.cluster.device.memory_bytes * self.options.memory_fraction


def _itemsize(dtype: str) -> int:
    return {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}.get(dtype, 4)


__all__ = ["META_KEY", "CostTables", "Setting", "divisor", "sharded_compute"]
