"""One name per knob: the words ``autopar.plan``, ``parallelize``, the CLI and the plan JSON share.

Each planning knob -- its keyword, flag, values, default, help text and where a plan
records it -- is one row of :data:`autopar.core.knob_table.KNOBS` (rendered as the table in
docs/cli.md). This module holds the name lists those rows and the plan schema check, and
reads old spellings. Recording a run for refitting is no planning knob: ``record_run``
(``parallelize``), ``--record-run`` (``demo``), ``--from-run`` (``calibrate``).

Schedule names are those ``torch.distributed.pipelining`` runs: ``gpipe``, ``1f1b``,
``interleaved`` (interleaved 1F1B) and ``zb_v`` (the zero-bubble V schedule).

Old spellings (``zero_stages``, ``virtual``, ``dtype``, ``zero-bubble``) are still accepted,
with a ``DeprecationWarning`` that names the new one.

>>> schedule_name("gpipe"), schedule_name("1F1B")
('gpipe', '1f1b')
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from autopar.core.errors import AutoparError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_v")
"""Pipeline schedules autopar plans and runs (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)."""

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""Compute precisions of a plan (``training.precision``): fp32, or mixed precision with fp32
master weights computing matmuls in bf16/fp16, or fp8 linears (tensorwise scaling) with the
rest in bf16. Per node, the plan's ``precision`` map says which ops follow it
(:mod:`autopar.analysis.precision`)."""

PRECISION_CHOICES = (*PRECISIONS, "auto")
"""What ``precision=`` / ``--precision`` accept: ``auto`` is the fastest the device runs
without loss scaling (bf16 where it has bf16, else fp32); fp8 and fp16 are asked for."""

RECOMPUTE_MODES = ("none", "selective", "full", "op")
"""Activation recomputation: keep everything; drop the sequence-squared tensors (Korthikanti
et al.); keep only each layer's inputs; torchtitan's per-op policy (keep matmul outputs but
every second, and attention's). See ``autopar/solver/pricing/recompute_tables.py``."""

LEANNESS = ("full", "op", "selective", "none")
"""Recomputation modes from the least kept to the most (a plan with a mode per layer is
solved under its leanest)."""

SEARCHED_RECOMPUTE_MODES = ("none", "selective", "full", "op")
"""What the planner chooses among unless told otherwise: every mode the runtime executes
("selective" is dropped where fused attention already recomputes the scores)."""

RUNNABLE_SCHEDULES = ("1f1b", "interleaved", "zb_v", "gpipe")
"""Schedules ``torch.distributed.pipelining`` runs (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleZBVZeroBubble), in the order the search tries them."""

ZERO_STAGES_RUNNABLE = (0, 1, 2, 3)
"""The ZeRO stages the runtime executes (DDP; FSDP2: :mod:`autopar.runtime.data_parallel`)."""

OFFLOADS_RUNNABLE = ("none", "optimizer+params")
"""Offload modes the runtime executes ("optimizer+params": FSDP2's CPUOffloadPolicy)."""

MASTER_WEIGHTS = ("params", "optimizer")
"""Where the fp32 master weights live (:mod:`autopar.analysis.precision` says what each
means)."""

BATCH_COUPLING_MODES = ("exact", "local")
"""How ops that couple a batch's samples are split (:mod:`autopar.analysis.batch_coupling`)."""

CP_ALGORITHMS = ("ring", "all_gather", "ulysses")
"""The attention algorithms under context parallelism (the ``cp_algorithm`` knob)."""

CP_LAYOUTS = ("zigzag", "contiguous")
"""How a sequence is cut over ``cp``: ``zigzag`` (2·cp chunks, rank i holds i and
2cp-1-i) or ``contiguous`` (cp chunks in order)."""

OPTIMIZERS = ("adamw", "adam", "adamw_fused", "adam_fused", "momentum", "sgd", "adam8bit",
              "adafactor")
"""Every optimizer the memory model accounts (:mod:`autopar.cost_models.memory`)."""

ATTENTION_KERNELS = ("generated", "device")
"""What runs the fused attention sites, as the cost model prices them (``attention_kernel``)."""

WEIGHT_COPIES = ("step", "use")
"""How long the low-precision copy of an fp32 weight lives (``weight_copies``): a 16-bit
working copy, or an fp8 linear's fp8 copy."""

LOCAL_IMPL_NAMES = ("vocab_parallel_embedding", "vocab_parallel_cross_entropy", "sync_batch_norm")
"""The rank-local implementations a plan may name (:mod:`autopar.ops.local_ops`)."""

DEPRECATED_SCHEDULES = {
    "zero-bubble": "zb_v", "zero_bubble": "zb_v", "zbv": "zb_v", "zb-v": "zb_v",
    "interleaved-1f1b": "interleaved", "interleaved_1f1b": "interleaved",
}

DEPRECATED_KEYWORDS = {"zero_stages": "zero", "virtual": "virtual_stages", "dtype": "precision"}
"""Old Python keyword -> its one name now."""


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn once per call site that ``old`` is now spelled ``new``."""
    warnings.warn(f"autopar: {old!r} is deprecated; use {new!r} (same meaning)",
                  DeprecationWarning, stacklevel=stacklevel)


def schedule_name(name: str, where: str = "schedule") -> str:
    """The one name of a pipeline schedule, or an error listing them."""
    if not isinstance(name, str):
        raise AutoparError(f"schedule must be a name, got {name!r}", where=where,
                           fix=f"use one of {', '.join(SCHEDULES)}")
    key = name.strip().lower()
    if key in DEPRECATED_SCHEDULES:
        deprecated(name, DEPRECATED_SCHEDULES[key], stacklevel=4)
        key = DEPRECATED_SCHEDULES[key]
    if key not in SCHEDULES:
        raise AutoparError(f"unknown pipeline schedule {name!r}", where=where,
                           fix=f"use one of {', '.join(SCHEDULES)}")
    return key


def zero_stages(value: Any, where: str = "zero") -> tuple[int, ...]:
    """``zero=3`` pins a stage; ``zero=(0, 3)`` lets the solver choose among them."""
    stages = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        stages = tuple(stages)
    except TypeError:
        stages = ()
    if (not stages or any(not isinstance(z, int) or isinstance(z, bool) or z not in (0, 1, 2, 3)
                          for z in stages)):
        raise AutoparError(f"zero must be a ZeRO stage 0-3 or a non-empty tuple of them, got "
                           f"{value!r}", where=where, fix="e.g. zero=3, or zero=(0, 3)")
    return tuple(dict.fromkeys(stages))


def check_keywords(given: dict[str, Any], valid: Iterable[str], function: str,
                   taken: Iterable[str] = ()) -> dict[str, Any]:
    """``given`` with deprecated keywords renamed (warning once each); an error naming
    ``function`` and listing the valid keywords for any other unknown one. ``taken``: the
    new names the caller was already given (an old spelling beside its new one is an error)."""
    valid = list(valid)
    taken = set(taken) | set(given)
    out: dict[str, Any] = {}
    for key, value in given.items():
        new = DEPRECATED_KEYWORDS.get(key)
        if new is not None and new in valid:
            if new in taken:
                raise AutoparError(f"{function}() got both {key!r} and {new!r}",
                                   where=f"{function}({key}=...)", fix=f"pass only {new}=")
            deprecated(key, new, stacklevel=4)
            out[new] = value
        elif key in valid:
            out[key] = value
        else:
            raise AutoparError(
                f"{function}() got an unknown keyword {key!r}", where=f"{function}({key}=...)",
                fix=f"valid keywords: {', '.join(valid)}")
    return out


def rank_of_chunk(chunk: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs ``chunk``.

    >>> [rank_of_chunk(c, 2, "interleaved") for c in range(4)], [rank_of_chunk(c, 2, "zb_v") for c in range(4)]
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    if schedule_name(schedule) == "zb_v" and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp
