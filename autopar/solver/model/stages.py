"""Pipeline stages: which layers each chunk runs, and which pipeline rank runs each chunk.

The layers are cut into ``pp x virtual`` contiguous chunks. Chunk ``c`` runs on rank
``c % pp`` (GPipe, 1F1B, interleaved 1F1B), or in a V for ZB-V (chunk ``c < pp`` on rank
``c``, the others back from the last rank to the first), as ``torch.distributed.pipelining``
places them. What runs before the layers (embeddings) joins the first chunk, what runs
after them (the head, the loss) the last.

:func:`balance` chooses the cut: the partition whose slowest chunk is fastest, with each
stage under its memory limit — under 1F1B the first stage holds the most microbatches in
flight, so it can hold the fewest layers. Embeddings and the output head count at their
real cost, so a large vocabulary moves layers off the last stage (Megatron balances this by
hand).

>>> load = StageLoad(pre_time=0.0, post_time=2.0, layer_time=(1.0,) * 6,
...                  pre_state=0.0, post_state=0.0, layer_state=(0.0,) * 6,
...                  pre_act=0.0, post_act=0.0, layer_act=(0.0,) * 6)
>>> balance(load, pp=2, schedule="1f1b", virtual=1, microbatches=4, capacity=1.0)
(4, 2)
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from autopar.core.knobs import rank_of_chunk
from autopar.cost_models.pipeline import in_flight, schedule_name


def equal_partition(n_layers: int, chunks: int) -> tuple[int, ...]:
    """Equal layer counts per chunk, the first chunks taking the remainder (Megatron's cut)."""
    per, extra = divmod(n_layers, chunks)
    return tuple(per + (1 if c < extra else 0) for c in range(chunks))


@dataclass(frozen=True)
class StageLoad:
    """Per-microbatch time and bytes of what runs before the layers, each layer, and what
    runs after them (modelled). ``*_state`` are weights, gradients and optimizer states,
    ``*_act`` the activations one microbatch keeps for backward."""

    pre_time: float
    post_time: float
    layer_time: tuple[float, ...]
    pre_state: float
    post_state: float
    layer_state: tuple[float, ...]
    pre_act: float
    post_act: float
    layer_act: tuple[float, ...]
    # seconds to send activations on after layer i (paid by the sender) and gradients back
    # before layer i + 1 (paid by the chunk starting there); empty: free
    send_forward: tuple[float, ...] = ()
    send_backward: tuple[float, ...] = ()


def _prefix(values: tuple[float, ...]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def balance(load: StageLoad, pp: int, schedule: str, virtual: int, microbatches: int,
            capacity: float, cuts: frozenset[int] = frozenset()) -> tuple[int, ...] | None:
    """Layer counts per chunk minimizing the slowest chunk's time, each chunk at least one
    layer; with one chunk per rank every stage's memory (states plus its in-flight
    activations) must also fit ``capacity``. ``cuts`` are layer counts at which a chunk
    must end (a constraint's stage boundaries). None when no cut fits.

    Greedy filling of each chunk as far as a time bound allows is optimal for a bound (the
    constraints only tighten as a chunk grows, and a chunk never crosses a required
    boundary), so bisection on the bound finds the best.
    """
    n = len(load.layer_time)
    chunks = pp * virtual
    if n < chunks or any(not 0 < c < n for c in cuts) or len(cuts) > chunks - 1:
        return None
    boundaries = sorted(cuts)

    def next_cut(start: int) -> int:
        """The furthest a chunk starting at ``start`` may reach."""
        return next((c for c in boundaries if c > start), n)
    one_per_rank = virtual == 1 and schedule_name(schedule) != "zb_v"
    flights = [in_flight(schedule, pp, microbatches, k) if one_per_rank else 0.0
               for k in range(pp)]
    chunk_time, fits, furthest = _chunk_checks(load, pp, chunks, flights, capacity,
                                               one_per_rank)

    def greedy(bound: float) -> tuple[int, ...] | None:
        counts, start = [], 0
        for k in range(chunks):
            if k == chunks - 1:
                if (boundaries and next_cut(start) < n) or not fits(k, start, n, bound):
                    return None
                counts.append(n - start)
                break
            lo, hi = start + 1, n - (chunks - k - 1)  # leave a layer for every later chunk
            if boundaries:
                hi = min(hi, next_cut(start))
            if lo > hi:
                return None
            end = furthest(k, start, lo, hi, bound)
            if end < lo:
                return None
            counts.append(end - start)
            start = end
        return tuple(counts)

    def slowest(counts: tuple[int, ...]) -> float:
        start, worst = 0, 0.0
        for k, count in enumerate(counts):
            worst = max(worst, chunk_time(k, start, start + count))
            start += count
        return worst

    total = _prefix(load.layer_time)[-1] + load.pre_time + load.post_time + sum(
        load.send_forward) + sum(load.send_backward)
    counts = greedy(total * (1 + 1e-9))
    if counts is None:
        return None  # memory alone rules out every cut
    # Bisection on the bound; a bound that fits drops at once to the slowest chunk of the
    # cut it gave (the optimum is some chunk's time), which ends it in a few rounds.
    lo, hi = 0.0, slowest(counts)
    while hi - lo > total * 1e-7:  # finer than any time difference the model means
        mid = (lo + hi) / 2
        found = greedy(mid)
        if found is None:
            lo = mid
        else:
            counts, hi = found, slowest(found)
    if one_per_rank:
        return counts
    return _spread(counts, pp, schedule, chunk_time, cuts)


def _chunk_checks(load: StageLoad, pp: int, chunks: int, flights: list[float],
                  capacity: float, one_per_rank: bool):
    """``(chunk_time, fits, furthest)`` for cutting ``load``'s layers into ``chunks``:
    chunk ``k`` from layer ``start`` to ``end`` takes ``chunk_time(k, start, end)``;
    ``fits(k, start, end, bound)`` says whether it stays within the time ``bound`` (and,
    with one chunk per rank, ``capacity``); ``furthest(k, start, lo, hi, bound)`` is the
    furthest end in [lo, hi] that fits, ``lo - 1`` when none does."""
    n = len(load.layer_time)
    times, states, acts = (_prefix(load.layer_time), _prefix(load.layer_state),
                           _prefix(load.layer_act))
    # Per chunk: what joins it besides its layers (0.0 adds nothing exactly), so that
    # fits(), called about a million times per plan, is arithmetic on lists alone.
    pre_time = [load.pre_time] + [0.0] * (chunks - 1)
    post_time = [0.0] * (chunks - 1) + [load.post_time]
    pre_state = [load.pre_state] + [0.0] * (chunks - 1)
    post_state = [0.0] * (chunks - 1) + [load.post_state]
    pre_act = [load.pre_act] + [0.0] * (chunks - 1)
    post_act = [0.0] * (chunks - 1) + [load.post_act]
    send_forward, send_backward = load.send_forward, load.send_backward

    def chunk_time(k: int, start: int, end: int) -> float:
        """The chunk's layers, what joins it, and its sends: activations on to the next
        chunk, gradients back to the one before."""
        t = 0.0
        if k < chunks - 1 and send_forward:
            t += send_forward[end - 1]
        if k > 0 and send_backward:
            t += send_backward[start - 1]
        return times[end] - times[start] + pre_time[k] + post_time[k] + t

    def fits(k: int, start: int, end: int, bound: float) -> bool:
        if chunk_time(k, start, end) > bound:
            return False
        if not one_per_rank:
            return True
        state = states[end] - states[start] + pre_state[k] + post_state[k]
        act = acts[end] - acts[start] + pre_act[k] + post_act[k]
        return state + act * flights[k] <= capacity

    # A chunk's time and memory grow with its end (layers cost >= 0; the sends, when they
    # differ by layer, are checked): the furthest end that fits is then a bisection of
    # these sorted sums, in C, rather than a Python search calling fits().
    reach_time = [times[end] + (send_forward[end - 1] if send_forward and end else 0.0)
                  for end in range(n + 1)]
    reach_memory = [[states[end] + acts[end] * flights[k % pp] for end in range(n + 1)]
                    for k in range(pp if one_per_rank else 0)]
    sorted_sums = all(a <= b for a, b in zip(reach_time[1:], reach_time[2:])) and all(
        a <= b for row in reach_memory for a, b in zip(row, row[1:]))

    def furthest(k: int, start: int, lo: int, hi: int, bound: float) -> int:
        """The furthest end in [lo, hi] of chunk ``k`` (not the last) that fits ``bound``;
        ``lo - 1`` when none does."""
        if not sorted_sums:
            if not fits(k, start, lo, bound):
                return lo - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(k, start, mid, bound):
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        limit = bound + times[start] - pre_time[k] - post_time[k] - (
            send_backward[start - 1] if k > 0 and send_backward else 0.0)
        end = bisect_right(reach_time, limit, lo, hi + 1) - 1
        if one_per_rank and end >= lo:
            room = (capacity - pre_state[k] - post_state[k]
                    - (pre_act[k] + post_act[k]) * flights[k]
                    + states[start] + acts[start] * flights[k])
            end = min(end, bisect_right(reach_memory[k], room, lo, hi + 1) - 1)
        # The sums are rearranged for bisection, which can round the other way at a limit:
        # the last layer is settled by fits() itself, as every other check judges a stage.
        while end >= lo and not fits(k, start, end, bound):
            end -= 1
        while end < hi and fits(k, start, end + 1, bound):
            end += 1
        return end

    return chunk_time, fits, furthest


def _spread(counts: tuple[int, ...], pp: int, schedule: str, chunk_time,
            cuts: frozenset[int]) -> tuple[int, ...]:
    """With several chunks per rank, a rank's time is the sum of its chunks': move single
    layers across chunk boundaries while that lowers the slowest rank (then the spread).
    A move changes two chunks, so each trial updates two ranks' times, not all."""
    chunks = len(counts)
    owner = [rank_of_chunk(k, pp, schedule) for k in range(chunks)]
    counts = list(counts)
    starts = [sum(counts[:k]) for k in range(chunks)]
    own = [chunk_time(k, starts[k], starts[k] + counts[k]) for k in range(chunks)]
    ranks = [0.0] * pp
    for k in range(chunks):
        ranks[owner[k]] += own[k]
    best = (max(ranks), sum(t * t for t in ranks))
    improved = True
    while improved:
        improved = False
        for k in range(chunks - 1):
            if starts[k + 1] in cuts:
                continue  # a required boundary stays where it is
            for step in (1, -1):  # one layer from chunk k+1 to k, or back
                if min(counts[k] + step, counts[k + 1] - step) < 1:
                    continue
                boundary = starts[k + 1] + step
                a = chunk_time(k, starts[k], boundary)
                b = chunk_time(k + 1, boundary, starts[k + 1] + counts[k + 1])
                trial_ranks = list(ranks)
                trial_ranks[owner[k]] += a - own[k]
                trial_ranks[owner[k + 1]] += b - own[k + 1]
                trial = (max(trial_ranks), sum(t * t for t in trial_ranks))
                if trial < best:
                    counts[k] += step
                    counts[k + 1] -= step
                    starts[k + 1] = boundary
                    own[k], own[k + 1], ranks, best, improved = a, b, trial_ranks, trial, True
    return tuple(counts)


def layer_ranges(layers: tuple[int, ...] | list[int]) -> str:
    """Layers as ranges: ``0-1,4-5`` (an interleaved stage), ``-`` for none.

    >>> layer_ranges((0, 1, 4, 5)), layer_ranges(()), layer_ranges([3])
    ('0-1,4-5', '-', '3')
    """
    if not layers:
        return "-"
    parts, start, prev = [], layers[0], layers[0]
    for layer in list(layers[1:]) + [None]:
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if layer is not None:
            start = prev = layer
    return ",".join(parts)
