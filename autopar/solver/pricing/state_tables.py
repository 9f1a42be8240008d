"""Model states in the cost tables: the bytes of a parameter, its gradient and its optimizer
states on one device, for the setting's tp and ep shards, ZeRO stage and offload.

A part of :class:`autopar.solver.pricing.costs.CostTables` (a mixin); the formulas are
:mod:`autopar.cost_models.memory`'s.
"""

from __future__ import annotations

from functools import cached_property

import torch

from autopar.analysis.precision import BYTES, params_are_masters
from autopar.core.placements import Shard, divisor
from autopar.cost_models.memory import StateBytes, model_state_bytes
from autopar.solver.model.problem import Decision
from autopar.strategies import Strategy


class StateTables:
    """Parameter, gradient and optimizer bytes of one instance of a parameter."""

    @property
    def states_key(self) -> tuple:
        """What :meth:`states` reads of the setting and options besides the decision (for
        caches of state sums: the microbatch and the pipeline do not change them)."""
        o, st = self.options, self.setting
        return (st.zero, st.shard_group, st.ep, st.offload, o.precision, o.optimizer,
                o.master_weights, o.weight_copies)

    def states(self, d: Decision, s: Strategy) -> StateBytes:
        """Parameter, gradient and optimizer bytes of one instance of a parameter."""
        param = d.facts.param
        if d.kind != "param" or param is None:
            return StateBytes(0.0, 0.0, 0.0)
        div = divisor(s.outputs[0], self.setting.tp)
        shape = list(param.shape)
        if isinstance(s.outputs[0], Shard) and shape:
            shape[s.outputs[0].dim] //= div
        ep = self.expert_divisor(d)
        if ep > 1:
            shape[0] //= ep
        if param.is_buffer:  # stored as it is (QLoRA's uint8 codes), never sharded by ZeRO
            itemsize = torch.empty((), dtype=getattr(torch, param.dtype)).element_size()
            return StateBytes(param.numel / div / ep * itemsize, 0.0, 0.0)
        return model_state_bytes(
            param.numel / div / ep,
            trainable=param.trainable,
            precision=self.options.precision if not param.is_buffer else "fp32",
            optimizer=self.options.optimizer,
            zero_stage=self.setting.zero,
            dp=self.setting.shard_group // ep,
            shape=tuple(shape) if shape else None,
            fp32_params=params_are_masters(self.precision.params, self.setting.zero),
            fp32_grads=True,  # DDP's and FSDP2's (reduce_dtype) gradients are fp32
            offload=self.setting.offload,
        )

    def grad_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of one instance's gradients on one device before data-parallel sync: fp32,
        as the parameters are (FSDP2 reduces in fp32 too: ``reduce_dtype``)."""
        param = d.facts.param
        if d.kind != "param" or param is None or not param.trainable:
            return 0.0
        return param.numel / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d) * 4

    def trainable_numel(self, d: Decision, s: Strategy) -> float:
        """Trainable parameters of one instance on one device (local over tp and ep)."""
        param = d.facts.param
        if d.kind != "param" or param is None or not param.trainable:
            return 0.0
        return param.numel / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d)

    def weight_bytes(self, d: Decision, s: Strategy) -> float:
        """Bytes of one instance's working weights, whole over dp (what ZeRO-3 gathers, in
        FSDP2's ``param_dtype``)."""
        param = d.facts.param
        if d.kind != "param" or param is None or param.is_buffer:
            return 0.0  # FSDP2 neither shards nor gathers buffers
        return (param.numel / divisor(s.outputs[0], self.setting.tp) / self.expert_divisor(d)
                * BYTES[self.precision.params])

    @cached_property
    def capacity(self) -> float:
        return self.options.capacity(self.cluster.device.memory_bytes)
