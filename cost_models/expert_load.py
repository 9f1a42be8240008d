"""Expert load under balanced routing: how uneven it is by chance, and what capacity drops.

The step-time model prices every expert at its expected share of tokens (top-k / experts).
Even when a router balances its experts perfectly on average, each batch's counts vary: the
``n`` (token, choice) pairs of a batch fall on ``E`` experts as a multinomial, so the
count of one expert is ``Binomial(n, 1/E)``. Two things follow, both lower bounds (real
routers are less even than chance: see the balancing loss's value during training):

- under expert parallelism the step waits for the busiest ``ep`` rank, whose expected load
  exceeds the mean by about ``sigma * z`` with ``z`` the expected maximum of ``ep``
  standard normals (Blom's approximation ``Phi^-1((ep - 0.375) / (ep + 0.25))``);
- with a capacity of ``C`` slots per expert (GShard, Switch: ``capacity_factor``), pairs
  beyond ``C`` are dropped: the expected dropped fraction is ``E[(X - C)+] / E[X]``.

>>> round(dropped_fraction(pairs=64, experts=8, capacity=8), 3)  # capacity factor 1.0
0.131
>>> round(dropped_fraction(pairs=64, experts=8, capacity=16), 4)  # 2.0
0.0003
>>> round(busiest_rank_excess(pairs=4096, ranks=8), 3)
0.059
"""

from __future__ import annotations

import math
from statistics import NormalDist


def busiest_rank_excess(pairs: float, ranks: int) -> float:
    """Expected excess of the busiest of ``ranks`` equal shares of ``pairs`` routed pairs
    over the mean share (0.05: 5 % more than its expected tokens), under chance alone."""
    if ranks <= 1 or pairs <= 0:
        return 0.0
    p = 1.0 / ranks
    mean = pairs * p
    sigma = math.sqrt(pairs * p * (1 - p))
    z = NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))
    return sigma * z / mean


def dropped_fraction(pairs: int, experts: int, capacity: int) -> float:
    """Expected fraction of ``pairs`` (token, choice) pairs dropped by a capacity of
    ``capacity`` slots per expert, each expert's count ``Binomial(pairs, 1/experts)``."""
    if capacity >= pairs or experts <= 0:
        return 0.0
    p = 1.0 / experts
    mean = pairs * p
    # E[(X - C)+] = E[X] - E[min(X, C)], with E[min(X, C)] = sum_{k < C} P(X > k)
    below = 0.0  # P(X <= k), accumulated
    kept = 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    for k in range(capacity):
        below += math.exp(math.lgamma(pairs + 1) - math.lgamma(k + 1)
                          - math.lgamma(pairs - k + 1) + k * log_p + (pairs - k) * log_q)
        kept += max(0.0, 1.0 - below)
    return max(0.0, (mean - kept) / mean)
