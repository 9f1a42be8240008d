"""The pipeline schedule as blocks on a time axis: each rank's order of actions, as
``torch.distributed.pipelining`` runs it, played out against the dependencies.

The report draws what the runtime does, so the per-rank orders below follow the schedule
classes :mod:`autopar.runtime.pipeline` uses (torch 2.13): ``ScheduleGPipe`` (every
forward, then every backward), ``Schedule1F1B`` (``pp - rank`` forwards, then one backward
and one forward in turn), ``ScheduleInterleaved1F1B`` (``_get_1f1b_rank_ops`` with
``_get_warmup_ops``) and ``ScheduleZBVZeroBubble`` (its
``_calculate_single_rank_operations``; backward split into B, the input gradient, and W,
the weight gradient). ``tests/test_report.py`` checks them against torch's own.

The simulation is event-driven with blocking ranks: each rank runs its actions in order,
each as soon as the rank is free and its inputs have arrived. Forward of microbatch ``i``
on chunk ``c`` needs chunk ``c-1``'s forward of ``i``; backward needs chunk ``c+1``'s
backward (the last chunk its own forward); W needs its own B. Sending across ranks adds
``transfer_s`` to the dependency.

>>> blocks = simulate("1f1b", pp=2, microbatches=4, forward_s=[1.0, 1.0], backward_s=[2.0, 2.0])
>>> span(blocks), idle(blocks, rank=0)
(15.0, 3.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.core.knobs import rank_of_chunk
from autopar.cost_models.pipeline import ZB_V_CHUNKS, schedule_name

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}


@dataclass(frozen=True)
class Action:
    """One unit of a rank's work: ``kind`` of ``microbatch`` on model chunk ``chunk``."""

    kind: str  # F, B (the full backward, or only the input gradient under zb_v), W
    chunk: int  # the global chunk (pipeline stage) index
    microbatch: int


@dataclass(frozen=True)
class Block:
    """An action placed in time on its rank (seconds from the step's start)."""

    rank: int
    action: Action
    start: float
    end: float


def chunks_per_rank(schedule: str, virtual: int) -> int:
    """Model chunks each rank holds: ``virtual`` for interleaved, two for zb_v, else one."""
    name = schedule_name(schedule)
    if name == "zb_v":
        return ZB_V_CHUNKS
    return virtual if name == "interleaved" else 1


def rank_orders(schedule: str, pp: int, microbatches: int, virtual: int = 1
                ) -> list[list[Action]]:
    """Each rank's actions in the order its torch schedule issues them."""
    name = schedule_name(schedule)
    if pp < 1 or microbatches < 1:
        raise ValueError(f"need pp >= 1 and microbatches >= 1, got {pp} and {microbatches}")
    if name == "gpipe":
        return [[Action(FORWARD, r, i) for i in range(microbatches)]
                + [Action(BACKWARD, r, i) for i in range(microbatches)] for r in range(pp)]
    if name == "1f1b":
        return [_one_f_one_b(r, pp, microbatches) for r in range(pp)]
    if name == "interleaved":
        return [_interleaved(r, pp, microbatches, virtual) for r in range(pp)]
    if name == "zb_v":
        return [_zb_v(r, pp, microbatches) for r in range(pp)]
    raise ValueError(f"the report draws gpipe, 1f1b, interleaved and zb_v, not {name!r} "
                     "(the runtime runs only those)")


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(m, pp - rank)
    ops = [Action(FORWARD, rank, i) for i in range(warmup)]
    f = warmup
    for b in range(m):
        ops.append(Action(BACKWARD, rank, b))
        if f < m:
            ops.append(Action(FORWARD, rank, f))
            f += 1
    return ops


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of "
                         f"their rounds ({rounds})")
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    steady = m * v - warmup

    def fwd_chunk(step: int) -> int:
        return (step // per_round) % v * pp + rank

    def bwd_chunk(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    next_f: dict[int, int] = {}
    next_b: dict[int, int] = {}

    def take(kind: str, chunk: int) -> Action:
        count = next_f if kind == FORWARD else next_b
        count[chunk] = count.get(chunk, 0) + 1
        return Action(kind, chunk, count[chunk] - 1)

    ops = []
    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            ops.append(take(FORWARD, fwd_chunk(step)))
        if step >= warmup:
            ops.append(take(BACKWARD, bwd_chunk(step)))
    return ops


def _zb_v(rank: int, pp: int, m: int) -> list[Action]:
    n = max(2 * pp - 1, m)  # torch fills the V with at least this many, then drops extras
    c0, c1 = rank, 2 * pp - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        ops.append(Action(FORWARD, c0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [Action(FORWARD, c1, f1), Action(FORWARD, c0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(pp - rank):
        ops += [Action(FORWARD, c1, f1), Action(BACKWARD, c1, b1), Action(WEIGHT, c1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(Action(FORWARD, c0, f0))
            f0 += 1
        ops += [Action(BACKWARD, c0, b0), Action(WEIGHT, c0, b0)]
        ops += [Action(FORWARD, c1, f1), Action(BACKWARD, c1, b1), Action(WEIGHT, c1, b1)]
        f1, b0, b1 = f1 + 1, b0 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [Action(BACKWARD, c0, b0), Action(BACKWARD, c1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        ops += [Action(BACKWARD, c0, b0), Action(WEIGHT, c0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [Action(WEIGHT, c1, i) for i in range(w1, b1)]
    ops += [Action(WEIGHT, c0, i) for i in range(w0, b0)]
    return [a for a in ops if a.microbatch < m]


def simulate(
    schedule: str,
    pp: int,
    microbatches: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    virtual: int = 1,
    weight_s: Sequence[float] | None = None,
    transfer_s: Sequence[float] | None = None,
) -> list[Block]:
    """Play the schedule out. Times are per microbatch and per *chunk* (global chunk index):
    ``forward_s``, ``backward_s`` (the full backward), ``weight_s`` (its weight-gradient
    part, run separately under zb_v; by default half, as the cost model splits it), and
    ``transfer_s`` (sending chunk ``c``'s output or input gradient to another rank)."""
    name = schedule_name(schedule)
    n_chunks = pp * chunks_per_rank(name, virtual)
    for what, times in (("forward_s", forward_s), ("backward_s", backward_s),
                        ("weight_s", weight_s), ("transfer_s", transfer_s)):
        if times is not None and len(times) != n_chunks:
            raise ValueError(f"{what} needs one time per chunk ({n_chunks}), got {len(times)}")
    w = list(weight_s) if weight_s is not None else [b / 2 for b in backward_s]
    send = list(transfer_s) if transfer_s is not None else [0.0] * n_chunks
    split = name == "zb_v"

    def duration(a: Action) -> float:
        if a.kind == FORWARD:
            return forward_s[a.chunk]
        if a.kind == WEIGHT:
            return w[a.chunk]
        return backward_s[a.chunk] - (w[a.chunk] if split else 0.0)

    def hop(src: int, dst: int) -> float:
        """Sending from chunk ``src`` to ``dst``: nothing when one rank holds both."""
        same = rank_of_chunk(src, pp, name) == rank_of_chunk(dst, pp, name)
        return 0.0 if same else send[src]

    def needs(a: Action) -> list[tuple[Action, float]]:
        """The actions ``a`` waits for, each with the transfer it then waits for."""
        c, i = a.chunk, a.microbatch
        if a.kind == FORWARD:
            return [] if c == 0 else [(Action(FORWARD, c - 1, i), hop(c - 1, c))]
        if a.kind == WEIGHT:
            return [(Action(BACKWARD, c, i), 0.0)]
        own = (Action(FORWARD, c, i), 0.0)
        if c == n_chunks - 1:
            return [own]
        return [own, (Action(BACKWARD, c + 1, i), hop(c + 1, c))]

    orders = rank_orders(name, pp, microbatches, virtual)
    done: dict[Action, float] = {}
    free = [0.0] * pp
    position = [0] * pp
    blocks: list[Block] = []
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                a = orders[r][position[r]]
                deps = needs(a)
                if any(d not in done for d, _ in deps):
                    break
                start = max([free[r], *(done[d] + wait for d, wait in deps)])
                end = start + duration(a)
                blocks.append(Block(r, a, start, end))
                done[a] = free[r] = end
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])}
            raise ValueError(f"{name} schedule deadlocks at {stuck}")
    return blocks


def span(blocks: Sequence[Block]) -> float:
    """When the last action ends."""
    return max((b.end for b in blocks), default=0.0)


def busy(blocks: Sequence[Block], rank: int) -> float:
    return sum(b.end - b.start for b in blocks if b.rank == rank)


def idle(blocks: Sequence[Block], rank: int) -> float:
    """Time ``rank`` waits within the pipeline's span: its bubble."""
    return span(blocks) - busy(blocks, rank)
