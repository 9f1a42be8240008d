"""What a user can pin or tune when planning; validated on creation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autopar.core.errors import AutoparError
from autopar.core.knobs import (
    BATCH_COUPLING_MODES,
    CP_ALGORITHMS,
    CP_LAYOUTS,
    MASTER_WEIGHTS,
    OFFLOADS_RUNNABLE,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
    SEARCHED_RECOMPUTE_MODES,
    ZERO_STAGES_RUNNABLE,
    schedule_name,
    zero_stages,
)

ATTENTION_KERNELS = ("generated", "device")
"""What runs the fused attention sites, as the cost model prices them (PlanOptions)."""


FP8_WEIGHT_COPIES = ("step", "use")
"""How long an fp8 linear's fp8 weight copy lives (``PlanOptions.fp8_weight_copies``)."""


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of one planning run. ``None`` means "let the solver choose".

    - ``global_batch``: sequences per optimizer step (default: the traced batch).
    - ``dp``/``tp``/``pp``/``cp``: pin mesh degrees (``cp``: context parallelism, the
      sequence split over ``cp`` ranks). ``cp_algorithm``: pin attention under cp ("ring",
      "all_gather", "ulysses"; default: the cheapest modelled, held to validated ground).
      ``cp_layout``: "zigzag" (2·cp chunks, rank i holds i and 2cp-1-i: even causal work)
      or "contiguous". ``microbatch``: pin the per-device microbatch size, or
      ``microbatches`` their number per step.
    - ``schedule``/``virtual_stages``: pin the pipeline schedule ("gpipe", "1f1b",
      "interleaved", "zb_v" — the zero-bubble schedule ``torch.distributed.pipelining``
      runs) and the chunks per pipeline rank (interleaved only).
    - ``precision``: compute precision ("bf16", "fp16" and "fp8" mean mixed precision with
      fp32 master weights; which node computes in what: :mod:`autopar.analysis.precision`).
    - ``precision_overrides``: node name or module path -> dtype word, over the policy.
    - ``zero``: ZeRO stages the solver may pick (0 = DDP, 3 = FSDP2 fully_shard).
    - ``dp_replicate``: pin HSDP, ZeRO sharded within dp/dp_replicate ranks and replicated
      across dp_replicate groups (1: over all of dp; default: chosen by cost).
    - ``recompute``: activation recomputation modes the solver may pick, per layer (a plan
      may recompute some layers and not others: ``training.recompute`` "mixed").
    - ``recompute_layers``: pins one mode per repeated layer, in the order they run.
    - ``fuse_attention``: run every attention site the kernels support as one fused call.
    - ``chunked_loss``: compute cross-entropy over class indices a block of tokens at a
      time (``autopar.ops.loss_ops``), keeping no ``[tokens, vocab]`` log-softmax.
    - ``memory_fraction``: share of device memory a plan may fill (the rest is headroom
      for the allocator and the runtime's own buffers).
    - ``time_limit_s``: CP-SAT time limit per mesh candidate.
    - ``max_solves``: CP-SAT solves the search may run (None: no limit); past it only
      layouts already solved are priced, and the plan says the budget was reached.
    - ``extrapolation_margin``: how much faster (a fraction) a plan using a scheme beyond
      the cost model's validated ground must be predicted than the best validated plan to
      be chosen (``autopar.cost_models.ground``); ``None``: the model's own error there
      (how much more optimistic it is on the scheme than on validated ground); 0: no
      preference.
    """

    global_batch: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None  # expert parallelism, carved out of dp (autopar.solver.axes.expert_axis)
    # HSDP: ZeRO shards within dp/dp_replicate consecutive ranks and replicates across the
    # dp_replicate groups (autopar.solver.axes.hsdp); None: chosen by cost, 1: shard over all dp
    dp_replicate: int | None = None
    cp_algorithm: str | None = None  # ring | all_gather | ulysses; None: by cost
    cp_layout: str = "zigzag"
    schedule: str | None = None  # gpipe | 1f1b | interleaved | zb_v
    virtual_stages: int | None = None  # chunks per pipeline rank (interleaved schedules)
    microbatch: int | None = None
    microbatches: int | None = None  # microbatches per step (the alternative to microbatch)
    # "exact": split the batch only where batch-coupled ops stay exact (autopar.solver.
    # batch_coupling); "local": split anyway, each rank's statistics its own (as DDP does)
    batch_coupling: str = "exact"
    precision: str = "fp32"
    precision_overrides: tuple[tuple[str, str], ...] = ()
    # where the fp32 master weights live (autopar.analysis.precision.MASTER_WEIGHTS); the runtime
    # executes "params" (and ZeRO-3's gathered 16-bit parameters); "optimizer" is priced only
    master_weights: str = "params"
    # how long an fp8 linear's fp8 weight copy lives (FP8_WEIGHT_COPIES): "step", one copy
    # for the whole step shared by its microbatches (autopar's runtime, Transformer
    # Engine's weight workspaces); "use", made where the linear runs and not kept (torchao's
    # Float8Linear, which saves the 16-bit weight for backward); priced only
    fp8_weight_copies: str = "step"
    optimizer: str = "adamw"
    zero: tuple[int, ...] = ZERO_STAGES_RUNNABLE
    recompute: tuple[str, ...] = SEARCHED_RECOMPUTE_MODES
    # pins the recomputation of each repeated layer, in the order they run
    recompute_layers: tuple[str, ...] | None = None
    # May tensor parallelism split the batch (data parallelism inside a tp group)? Off, tp
    # splits work within each sequence only, as Megatron's does. None (the default): off
    # when tp is pinned (a pinned tp means Megatron's tensor parallelism), on when the
    # solver chooses tp.
    tp_splits_batch: bool | None = None
    # Replace attention sites with the generated fused kernels (autopar.kernels.attention).
    fuse_attention: bool = True
    # Which kernel the fused sites are priced as (ATTENTION_KERNELS): "generated", autopar's
    # own, which its program runs on GPUs (DeviceSpec.generated_attention_*); "device", the
    # kernel the cluster's attention_efficiency describes -- another framework's run
    # (SDPA's flash backend, cuDNN), as benchmarks/fidelity_sources.py prices published ones.
    attention_kernel: str = "generated"
    chunked_loss: bool = True
    memory_fraction: float = 0.9
    time_limit_s: float = 20.0
    extrapolation_margin: float | None = None
    # CP-SAT solves the search may run (None: no limit). Past it, settings are priced only
    # with layouts already solved; the plan says the budget was reached. A count, not
    # seconds, so the same inputs give the same plan on any machine.
    max_solves: int | None = 300
    # Offload modes the planner may use: "optimizer+params" keeps ZeRO-3's parameter,
    # gradient and optimizer shards in host memory and steps the optimizer there (FSDP2's
    # CPUOffloadPolicy). Chosen only when no plan fits in device memory without it.
    offload: tuple[str, ...] = ("none", "optimizer+params")
    # What the plan must obey (autopar.core.constraints): settings they rule out are skipped,
    # stage cuts bound the pipeline partition, a memory cap lowers the capacity.
    constraints: tuple = ()

    def __post_init__(self) -> None:
        for name in ("global_batch", "dp", "tp", "pp", "cp", "ep", "dp_replicate",
                     "virtual_stages", "microbatch",
                     "microbatches", "max_solves"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise AutoparError(
                    f"{name} must be a positive integer, got {value!r}",
                    where=f"PlanOptions.{name}",
                    fix=f"pass {name}=None to let the solver choose, or a positive int",
                )
        if self.cp_algorithm is not None and self.cp_algorithm not in CP_ALGORITHMS:
            raise AutoparError(
                f"unknown cp_algorithm {self.cp_algorithm!r}", where="PlanOptions.cp_algorithm",
                fix=f"use one of {', '.join(CP_ALGORITHMS)}, or None to choose by cost")
        if self.cp_layout not in CP_LAYOUTS:
            raise AutoparError(
                f"unknown cp_layout {self.cp_layout!r}", where="PlanOptions.cp_layout",
                fix=f"use one of {', '.join(CP_LAYOUTS)}")
        if self.tp_splits_batch is None:
            object.__setattr__(self, "tp_splits_batch", self.tp is None)
        if self.schedule is not None:
            object.__setattr__(self, "schedule", schedule_name(self.schedule))
        if self.virtual_stages is not None and self.virtual_stages > 1 and self.schedule not in (
                None, "interleaved"):
            raise AutoparError(
                f"virtual_stages={self.virtual_stages} needs the interleaved schedule, not "
                f"{self.schedule!r}",
                where="PlanOptions.virtual_stages",
                fix="pass schedule='interleaved', or virtual_stages=1",
            )
        if self.microbatch is not None and self.microbatches is not None:
            raise AutoparError(
                "both microbatch (size) and microbatches (count) are pinned",
                where="PlanOptions.microbatch/microbatches",
                fix="pin one of them; the global batch fixes the other",
            )
        if self.batch_coupling not in BATCH_COUPLING_MODES:
            raise AutoparError(
                f"unknown batch_coupling {self.batch_coupling!r}",
                where="PlanOptions.batch_coupling",
                fix=f"use one of {', '.join(BATCH_COUPLING_MODES)}")
        if self.precision not in PRECISIONS:
            raise AutoparError(
                f"unknown precision {self.precision!r}",
                where="PlanOptions.precision",
                fix=f"use one of {', '.join(PRECISIONS)}",
            )
        overrides = self.precision_overrides
        if isinstance(overrides, Mapping):
            overrides = tuple(overrides.items())
        if not isinstance(overrides, tuple) or any(
                not isinstance(o, tuple) or len(o) != 2 or not isinstance(o[0], str)
                for o in overrides):
            raise AutoparError(
                f"precision_overrides must map node names or module paths to dtypes, got "
                f"{self.precision_overrides!r}", where="PlanOptions.precision_overrides",
                fix='e.g. precision_overrides={"lm_head": "fp32"}')
        for key, word in overrides:
            if word not in PRECISIONS:
                raise AutoparError(f"unknown precision {word!r} for {key!r}",
                                   where=f"precision_overrides[{key!r}]",
                                   fix=f"use one of {', '.join(PRECISIONS)}")
        object.__setattr__(self, "precision_overrides", tuple(sorted(overrides)))
        if self.master_weights not in MASTER_WEIGHTS:
            raise AutoparError(f"unknown master_weights {self.master_weights!r}",
                               where="PlanOptions.master_weights",
                               fix=f"use one of {', '.join(MASTER_WEIGHTS)}")
        if self.fp8_weight_copies not in FP8_WEIGHT_COPIES:
            raise AutoparError(f"unknown fp8_weight_copies {self.fp8_weight_copies!r}",
                               where="PlanOptions.fp8_weight_copies",
                               fix=f"use one of {', '.join(FP8_WEIGHT_COPIES)}")
        if self.optimizer not in OPTIMIZERS:
            raise AutoparError(
                f"unknown optimizer {self.optimizer!r}",
                where="PlanOptions.optimizer",
                fix=f"use one of {', '.join(OPTIMIZERS)}",
            )
        object.__setattr__(self, "zero", zero_stages(self.zero, where="PlanOptions.zero"))
        offload = (self.offload,) if isinstance(self.offload, str) else tuple(self.offload)
        if not offload or any(o not in OFFLOADS_RUNNABLE for o in offload):
            raise AutoparError(
                f"offload must be one or more of {', '.join(OFFLOADS_RUNNABLE)}, got "
                f"{self.offload!r}", where="PlanOptions.offload",
                fix='e.g. offload="none", or offload=("none", "optimizer+params")')
        object.__setattr__(self, "offload", tuple(dict.fromkeys(offload)))
        modes = RECOMPUTE_MODES
        if not self.recompute or any(m not in modes for m in self.recompute):
            raise AutoparError(
                f"recompute must be a non-empty subset of {modes}, got {self.recompute}",
                where="PlanOptions.recompute",
                fix='e.g. recompute=("none", "full")',
            )
        if self.recompute_layers is not None:
            layers = self.recompute_layers
            if isinstance(layers, str) or not isinstance(layers, (tuple, list)) or not layers \
                    or any(m not in modes for m in layers):
                raise AutoparError(
                    f"recompute_layers must give one of {modes} per layer, got {layers!r}",
                    where="PlanOptions.recompute_layers",
                    fix='e.g. recompute_layers=("full", "full", "none", "none")')
            object.__setattr__(self, "recompute_layers", tuple(layers))
        for name in ("tp_splits_batch", "fuse_attention", "chunked_loss"):
            if not isinstance(getattr(self, name), bool):
                raise AutoparError(f"{name} must be True or False, got {getattr(self, name)!r}",
                                   where=f"PlanOptions.{name}", fix=f"pass {name}=True or False")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise AutoparError(f"unknown attention_kernel {self.attention_kernel!r}",
                               where="PlanOptions.attention_kernel",
                               fix=f"use one of {', '.join(ATTENTION_KERNELS)}")
        for name in ("memory_fraction", "time_limit_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                    value):
                raise AutoparError(f"{name} must be a finite number, got {value!r}",
                                   where=f"PlanOptions.{name}", fix="e.g. memory_fraction=0.9, "
                                   "time_limit_s=20")
        if not 0 < self.memory_fraction <= 1:
            raise AutoparError(
                f"memory_fraction must be in (0, 1], got {self.memory_fraction}",
                where="PlanOptions.memory_fraction",
                fix="e.g. 0.9 leaves 10% headroom",
            )
        from autopar.core.constraints import Constraint

        if not isinstance(self.constraints, tuple) or not all(
                isinstance(c, Constraint) for c in self.constraints):
            raise AutoparError(f"constraints must be a tuple of Constraint, got "
                               f"{self.constraints!r}", where="PlanOptions.constraints",
                               fix="parse text with autopar.core.constraints.parse_constraints")
        margin = self.extrapolation_margin
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not math.isfinite(margin) or margin < 0):
            raise AutoparError(
                f"extrapolation_margin must be a fraction >= 0 or None, got {margin!r}",
                where="PlanOptions.extrapolation_margin",
                fix="e.g. 0.1 (an extrapolated plan must be predicted 10% faster), 0 for none, "
                "or None for the model's own error")
        if self.time_limit_s <= 0:
            raise AutoparError(
                f"time_limit_s must be positive, got {self.time_limit_s}",
                where="PlanOptions.time_limit_s",
                fix="e.g. 20",
            )

    def capacity(self, device_memory_bytes: float) -> float:
        """Bytes a plan may fill on one device: ``memory_fraction`` of it, or less under a
        memory cap constraint."""
        from autopar.core.constraints import memory_cap

        cap = memory_cap(self.constraints)
        usable = device_memory_bytes * self.memory_fraction
        return min(usable, cap.bytes) if cap else usable

    def allows(self, setting) -> bool:
        """Whether every constraint allows ``setting`` (an ``autopar.core.constraints.SettingView``)."""
        return all(c.allows(setting) for c in self.constraints)
