"""Stage cuts: with one chunk per rank, ``balance`` finds the cut whose slowest stage is
fastest among those whose every stage fits its memory (checked against all cuts)."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.cost_models.pipeline import in_flight
from autopar.solver.model.stages import StageLoad, balance


def _cuts(n: int, chunks: int):
    """Every way to cut ``n`` layers into ``chunks`` contiguous non-empty chunks."""
    for ends in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0, *ends, n)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _stages(load: StageLoad, counts: tuple[int, ...], schedule: str, m: int):
    """(time, memory) of each stage of a cut, as the pipeline runs it."""
    pp, start, out = len(counts), 0, []
    for k, count in enumerate(counts):
        end = start + count
        time = sum(load.layer_time[start:end])
        state = sum(load.layer_state[start:end])
        act = sum(load.layer_act[start:end])
        if k == 0:
            time, state, act = time + load.pre_time, state + load.pre_state, act + load.pre_act
        if k == pp - 1:
            time, state = time + load.post_time, state + load.post_state
            act += load.post_act
        if k < pp - 1 and load.send_forward:
            time += load.send_forward[end - 1]
        if k > 0 and load.send_backward:
            time += load.send_backward[start - 1]
        out.append((time, state + act * in_flight(schedule, pp, m, k)))
        start = end
    return out


def _load(rng: random.Random, n: int, sends: str) -> StageLoad:
    def values(scale: float) -> tuple[float, ...]:
        return tuple(rng.uniform(0.2, 1.0) * scale for _ in range(n))

    send = {"none": (), "even": (0.05,) * n, "uneven": values(0.3)}[sends]
    return StageLoad(pre_time=rng.uniform(0, 1), post_time=rng.uniform(0, 2),
                     layer_time=values(1.0), pre_state=rng.uniform(0, 2),
                     post_state=rng.uniform(0, 2), layer_state=values(1.0),
                     pre_act=rng.uniform(0, 1), post_act=rng.uniform(0, 1),
                     layer_act=values(0.5), send_forward=send,
                     send_backward=send[::-1] if send else ())


@pytest.mark.parametrize("sends", ["none", "even", "uneven"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_cut_is_the_fastest_that_fits(sends: str, schedule: str) -> None:
    rng = random.Random(f"{sends}-{schedule}")
    for _ in range(60):
        n, pp, m = rng.randint(2, 9), rng.randint(2, 4), rng.randint(2, 8)
        if pp > n:
            continue
        load = _load(rng, n, sends)
        everything = [(max(t for t, _ in st), max(mem for _, mem in st), cut)
                      for cut in _cuts(n, pp) for st in [_stages(load, cut, schedule, m)]]
        # a capacity between the leanest and the fattest cut's peak, so that some cuts do
        # not fit (never exactly at a peak, where summing in another order rounds either way)
        lean, fat = min(e[1] for e in everything), max(e[1] for e in everything)
        capacity = lean * (1 + 1e-9) + rng.uniform(-0.1, 1.0) * (fat - lean)
        fitting = [e for e in everything if e[1] <= capacity]
        cut = balance(load, pp, schedule, 1, m, capacity)
        if not fitting:
            assert cut is None
            continue
        assert cut is not None and sum(cut) == n and min(cut) >= 1
        stages = _stages(load, cut, schedule, m)
        assert max(mem for _, mem in stages) <= capacity * (1 + 1e-12)
        best = min(e[0] for e in fitting)
        total = sum(load.layer_time) + load.pre_time + load.post_time + 2 * sum(
            load.send_forward)
        assert max(t for t, _ in stages) <= best + total * 1e-6, (cut, best)


def test_several_chunks_per_rank_cover_every_layer_once() -> None:
    rng = random.Random(7)
    for _ in range(40):
        pp, virtual = rng.randint(2, 4), rng.randint(2, 3)
        n = rng.randint(pp * virtual, 3 * pp * virtual)
        cut = balance(_load(rng, n, "uneven"), pp, "interleaved", virtual, 2 * pp, 1e18)
        assert cut is not None and len(cut) == pp * virtual
        assert sum(cut) == n and min(cut) >= 1


def test_a_stage_exactly_at_its_limit_fits() -> None:
    """Memory exactly at capacity fits, as the rest of the planner judges it (a rearranged
    sum once rounded this case over the limit and found no cut)."""
    load = StageLoad(pre_time=0.56, post_time=0.82, layer_time=(0.58, 0.42),
                     pre_state=1.3652513517633005, post_state=0.24,
                     layer_state=(0.9408745870898128, 0.89), pre_act=0.3901638028559755,
                     post_act=0.83, layer_act=(0.3368388565120982, 0.36))
    flight = in_flight("1f1b", 2, 6, 0)
    first = (0.9408745870898128 - 0.0 + load.pre_state) + (
        0.3368388565120982 - 0.0 + load.pre_act) * flight  # the first stage, as fits() sums it
    assert balance(load, 2, "1f1b", 1, 6, first) == (1, 1)
