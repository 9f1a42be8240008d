"""What a user can pin or tune when planning; validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.errors import AutoparError
from autopar.core.knob_table import OPTION_KNOBS
from autopar.core.knobs import ATTENTION_KERNELS as ATTENTION_KERNELS  # their old home
from autopar.core.knobs import SEARCHED_RECOMPUTE_MODES, ZERO_STAGES_RUNNABLE
from autopar.core.knobs import WEIGHT_COPIES as WEIGHT_COPIES


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of one planning run, checked on creation. ``None`` means "let the solver
    choose". Each field is a knob of :data:`autopar.core.knob_table.KNOBS`, whose row says
    what it means, what values it takes and how it is checked (docs/cli.md lists them);
    ``constraints`` are parsed (:mod:`autopar.core.constraints`), and ``precision`` is a
    word ``autopar.plan`` has resolved (no "auto")."""

    global_batch: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None  # carved out of dp (autopar.solver.axes.expert_axis)
    dp_replicate: int | None = None  # HSDP (autopar.solver.axes.hsdp)
    cp_algorithm: str | None = None
    cp_layout: str = "zigzag"
    schedule: str | None = None
    virtual_stages: int | None = None
    microbatch: int | None = None
    microbatches: int | None = None
    batch_coupling: str = "exact"  # autopar.analysis.batch_coupling
    precision: str = "fp32"
    precision_overrides: tuple[tuple[str, str], ...] = ()
    master_weights: str = "optimizer"  # autopar.analysis.precision.params_word
    weight_copies: str = "step"
    optimizer: str = "adamw"
    zero: tuple[int, ...] = ZERO_STAGES_RUNNABLE
    recompute: tuple[str, ...] = SEARCHED_RECOMPUTE_MODES
    recompute_layers: tuple[str, ...] | None = None
    tp_splits_batch: bool | None = None  # None: off when tp is pinned, on when chosen
    fuse_attention: bool = True  # autopar.kernels.attention
    attention_kernel: str = "generated"
    chunked_loss: bool = True  # autopar.ops.loss_ops
    compile: bool = False  # autopar.runtime.compiled
    memory_fraction: float = 0.9
    time_limit_s: float = 20.0
    extrapolation_margin: float | None = None  # autopar.cost_models.ground
    # A count, not seconds, so the same inputs give the same plan on any machine.
    max_solves: int | None = 300
    offload: tuple[str, ...] = ("none", "optimizer+params")
    constraints: tuple = ()

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        """Each knob's check from the knob table (its value normalised: a tuple, a
        schedule's one name), then the rules that relate two knobs."""
        _resolve_tp_splits_batch(self)
        for knob in OPTION_KNOBS:
            object.__setattr__(self, knob.name, knob.check(knob.name, getattr(self, knob.name)))
        for rule in CROSS_FIELD_RULES:
            rule(self)

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


def _resolve_tp_splits_batch(options: PlanOptions) -> None:
    """``tp_splits_batch=None``: a pinned tp is Megatron's (it splits work within each
    sequence only); a tp the solver chooses may split the batch too."""
    if options.tp_splits_batch is None:
        object.__setattr__(options, "tp_splits_batch", options.tp is None)


def virtual_stages_need_interleaving(options: PlanOptions) -> None:
    """More than one chunk per pipeline rank runs under the interleaved schedule only."""
    if options.virtual_stages is not None and options.virtual_stages > 1 and (
            options.schedule not in (None, "interleaved")):
        raise AutoparError(
            f"virtual_stages={options.virtual_stages} needs the interleaved schedule, not "
            f"{options.schedule!r}",
            where="PlanOptions.virtual_stages",
            fix="pass schedule='interleaved', or virtual_stages=1",
        )


def one_microbatch_pin(options: PlanOptions) -> None:
    """The microbatch size and count fix each other (with the global batch): pin one."""
    if options.microbatch is not None and options.microbatches is not None:
        raise AutoparError(
            "both microbatch (size) and microbatches (count) are pinned",
            where="PlanOptions.microbatch/microbatches",
            fix="pin one of them; the global batch fixes the other",
        )


CROSS_FIELD_RULES = (virtual_stages_need_interleaving, one_microbatch_pin)
"""The rules ``PlanOptions`` checks after each knob's own check: each relates two knobs."""
