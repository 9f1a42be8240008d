"""Pipeline schedules: bubbles, microbatches in flight per stage, and a step's time.

``p`` stages, ``m`` microbatches per step, ``v`` model chunks per stage (interleaving).
Times are per microbatch per stage: ``t_f`` forward, ``t_b`` backward (for zero-bubble
schedules split into B, the input gradient, and W, the weight gradient).

Bubble fractions are idle time over ideal compute time ``m (t_f + t_b)``:

- gpipe and 1f1b: ``(p-1)/m`` (Huang et al. 2019; Narayanan et al. SC'21 §2.2: 1F1B, i.e.
  PipeDream-Flush, has GPipe's bubble with less activation memory);
- interleaved 1F1B: ``(p-1)/(v m)`` (Narayanan et al. SC'21 §2.2.2);
- zb_h1: ``(p-1)(T_F + T_B - T_W)`` idle against 1F1B's ``(p-1)(T_F + T_B + T_W)``, with B
  the input-gradient and W the weight-gradient pass (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR'24, Table 2): ``(p-1)/(3m)`` when T_F = T_B = T_W;
- zb_h2: ``(p-1)(T_F + T_B - 2 T_W)``, floored at 0 (same table): 0 when the three are equal;
- zb_v: two chunks per device in a V (Qi et al., arXiv v2): modelled as zb_h2 on chunks with
  half the stage's times, so 0 when the three are equal, once ``m >= 2p`` microbatches fill
  its warm-up; below that as zb_h1 on half-stage chunks.

The equal-thirds default (T_F = T_B = T_W) is physical for matmul-dominated layers: the
input gradient ``dY Wᵀ`` and the weight gradient ``Xᵀ dY`` are each one matmul as large as
the forward's.

Activation memory is counted in *microbatch-stage activations*: the bytes one microbatch
leaves saved for backward in all of the stage's layers. :func:`in_flight` gives the count at
the stage's peak.

>>> bubble_fraction("1f1b", p=4, m=8), bubble_fraction("interleaved", p=4, m=8, v=2)
(0.375, 0.1875)
>>> [in_flight("1f1b", p=4, m=8, stage=s) for s in range(4)]
[4.0, 3.0, 2.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v")
_ALIASES = {
    "interleaved_1f1b": "interleaved",
    "zb1p": "zb_h1",
    "zb2p": "zb_h2",
    "zbv": "zb_v",
}

ZB_V_CHUNKS = 2
"""ZB-V places exactly two model chunks on every device, in a V (Qi et al., ZB-V)."""

W_MEMORY_RATIO = 1.0
"""Activations a deferred W pass keeps, relative to a pending B pass (``M_W / M_B``). Qi et
al. Table 1 gives M_B = 34sbh + 5as^2b and M_W = 32sbh per GPT layer: 0.94 with flash
attention (no s^2 term); we round up to 1 unless the caller knows better."""


def schedule_name(schedule: str) -> str:
    """Canonical name of ``schedule`` (accepts ``interleaved_1f1b``, ``zb1p`` for ZB-H1,
    ``zb-v`` ...).

    >>> schedule_name("zb1p"), schedule_name("Interleaved-1F1B")
    ('zb_h1', 'interleaved')
    """
    known = _CANONICAL.get(schedule)
    if known is not None:  # the search asks this hundreds of thousands of times a plan
        return known
    key = schedule.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    _CANONICAL[schedule] = key
    return key


_CANONICAL: dict[str, str] = {}
"""Names :func:`schedule_name` has canonicalised, by the text it was given."""


def _check(schedule: str, p: int, m: int, v: int) -> str:
    name = schedule_name(schedule)
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be >= 1, got p={p} m={m} v={v}")
    if v != 1 and name not in ("interleaved", "zb_v"):
        raise ValueError(f"{name} runs one chunk per stage, got v={v}; use 'interleaved'")
    if name == "zb_v" and v not in (1, ZB_V_CHUNKS):
        raise ValueError(f"zb_v always runs {ZB_V_CHUNKS} chunks per stage, got v={v}")
    return name


def bubble_fraction(
    schedule: str,
    p: int,
    m: int,
    v: int = 1,
    *,
    t_f: float = 1.0,
    t_b: float = 1.0,
    t_w: float = 1.0,
) -> float:
    """Idle time over ideal compute time ``m * (t_f + t_b + t_w)`` (``t_b + t_w`` is the full
    backward; only the zero-bubble schedules care how it splits).

    >>> round(bubble_fraction("zb_h1", 4, 8), 6)   # a third of 1F1B's 3/8
    0.125
    >>> bubble_fraction("zb_v", 4, 8), bubble_fraction("zb_h2", 4, 8)
    (0.0, 0.0)
    """
    name = _check(schedule, p, m, v)
    if p == 1:
        return 0.0
    if name in ("gpipe", "1f1b"):
        return (p - 1) / m
    if name == "interleaved":
        return (p - 1) / (v * m)
    work = m * (t_f + t_b + t_w)
    if name == "zb_h1":
        return (p - 1) * max(0.0, t_f + t_b - t_w) / work
    if name == "zb_h2":
        return (p - 1) * max(0.0, t_f + t_b - 2 * t_w) / work
    c = ZB_V_CHUNKS  # zb_v: chunks carry half the stage's times
    if m >= 2 * p:
        return (p - 1) * max(0.0, (t_f + t_b - 2 * t_w) / c) / work
    return (p - 1) * max(0.0, (t_f + t_b - t_w) / c) / work


def in_flight(
    schedule: str,
    p: int,
    m: int,
    stage: int,
    v: int = 1,
    *,
    w_ratio: float = W_MEMORY_RATIO,
) -> float:
    """Microbatch-stage activations ``stage`` (0 = first) holds at its peak.

    - gpipe: all ``m`` forwards run before any backward.
    - 1f1b: ``p - stage`` warm-up-plus-one forwards before the first backward frees one
      (Megatron ``num_warmup_microbatches = p - rank - 1``), at most ``m``.
    - interleaved: Megatron warms up ``2(p - rank - 1) + (v - 1) p`` chunk forwards
      (``forward_backward_pipelining_with_interleaving``), so the peak is that plus one
      chunk, each ``1/v`` of the stage, at most all ``m v`` chunks. The first stage holds
      ``p + (p-1)/v = p (1 + (p-1)/(p v))`` microbatch-stages, Narayanan et al.'s factor.
    - zb_h1: ``(p - stage) M_B + stage M_W`` (Qi et al. §2): like 1F1B, plus the W passes it
      defers; ``w_ratio`` = M_W / M_B (:data:`W_MEMORY_RATIO`).
    - zb_h2: ``(2p - 2 stage - 1) M_B + 2 stage M_W`` (same).
    - zb_v: ``p`` on every stage, 1F1B's peak (Qi et al.: "the same activation memory as
      1F1B", balanced by the V placement).

    >>> round(in_flight("interleaved", p=4, m=8, stage=0, v=2), 6)   # 4 + 3/2
    5.5
    >>> in_flight("gpipe", p=4, m=8, stage=3)
    8.0
    """
    name = _check(schedule, p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in [0, {p}), got {stage}")
    if name == "gpipe":
        return float(m)
    if name == "1f1b" or (name == "interleaved" and v == 1):
        return float(min(m, p - stage))
    if name == "interleaved":
        chunks = 2 * (p - stage - 1) + (v - 1) * p + 1
        return min(chunks, m * v) / v
    if name == "zb_v":
        return float(min(m, p))
    pending_b = min(m, p - stage) if name == "zb_h1" else min(m, 2 * p - 2 * stage - 1)
    deferred_w = stage if name == "zb_h1" else 2 * stage
    return pending_b + w_ratio * min(deferred_w, m - pending_b)


@dataclass(frozen=True)
class StepTime:
    """A training step's time and its parts, in seconds (modelled).

    ``compute`` is the slowest stage's work for all microbatches, ``bubble`` the pipeline's
    fill and drain, ``p2p`` the stage-boundary sends on the critical path, ``dp_exposed`` the
    data-parallel (DDP/ZeRO) communication the backward did not hide.
    """

    compute: float
    bubble: float
    p2p: float
    dp_exposed: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.p2p + self.dp_exposed

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def step_time(
    stage_fwd_s: Sequence[float] | float,
    stage_bwd_s: Sequence[float] | float,
    m: int,
    schedule: str = "1f1b",
    v: int = 1,
    p2p_s: float = 0.0,
    dp_comm_s: float = 0.0,
    dp_overlap_s: float | None = None,
    *,
    p: int | None = None,
    stage_w_s: Sequence[float] | float | None = None,
) -> StepTime:
    """Compose a step from per-microbatch stage times.

    ``stage_fwd_s`` / ``stage_bwd_s``: forward and full backward seconds of one microbatch on
    each stage (a sequence, one per stage, or one number with ``p`` stages alike).
    ``stage_w_s``: the weight-gradient part of the backward, for zero-bubble schedules (by
    default half: the input and weight gradients are one matmul each). ``p2p_s``: one
    activation (or its gradient) sent across one stage boundary. ``dp_comm_s``: the step's
    gradient (or ZeRO) communication; ``dp_overlap_s``: the compute it hides behind (by
    default the last microbatch's backward of the slowest stage).

    The pipeline runs at its slowest stage, ``t = max(t_f + t_b)``:

    - compute = ``m * t``; bubble = ``bubble_fraction * m * t``, i.e. ``(p-1)/v * t`` for the
      1F1B family and GPipe (``(m + (p-1)/v) * t`` in all, Narayanan et al.);
    - p2p: Megatron's schedules block on their sends and receives, so each of the
      ``m + (p-1)/v`` steps pays one forward and one backward transfer per chunk: ``2 v p2p_s``
      (ZB-V's two chunks double it, as Qi et al. note);
    - dp_exposed = ``max(0, dp_comm_s - dp_overlap_s)``.

    >>> s = step_time([1.0] * 4, [2.0] * 4, m=8, schedule="1f1b", p2p_s=0.01)
    >>> s.compute, s.bubble, round(s.p2p, 6), s.total == s.compute + s.bubble + s.p2p
    (24.0, 9.0, 0.22, True)
    """
    fwd = _per_stage(stage_fwd_s, p)
    bwd = _per_stage(stage_bwd_s, len(fwd))
    if len(bwd) != len(fwd):
        raise ValueError(f"{len(fwd)} forward stage times but {len(bwd)} backward ones")
    stages = len(fwd)
    name = _check(schedule, stages, m, v)
    w = _per_stage(stage_w_s, stages) if stage_w_s is not None else [b / 2 for b in bwd]
    slowest = max(range(stages), key=lambda i: fwd[i] + bwd[i])
    t = fwd[slowest] + bwd[slowest]
    t_w = w[slowest]
    frac = bubble_fraction(name, stages, m, v, t_f=fwd[slowest], t_b=bwd[slowest] - t_w, t_w=t_w)
    chunks = ZB_V_CHUNKS if name == "zb_v" else v
    p2p = 0.0
    if stages > 1:
        p2p = (m + (stages - 1) / chunks) * 2 * chunks * p2p_s
    overlap = bwd[slowest] if dp_overlap_s is None else dp_overlap_s
    return StepTime(
        compute=m * t,
        bubble=frac * m * t,
        p2p=p2p,
        dp_exposed=max(0.0, dp_comm_s - overlap),
    )


def _per_stage(value: Sequence[float] | float, p: int | None) -> list[float]:
    if isinstance(value, (int, float)):
        if p is None:
            raise ValueError("give one time per stage, or the number of stages p")
        return [float(value)] * p
    times = [float(x) for x in value]
    if not times:
        raise ValueError("a pipeline has at least one stage")
    return times
