"""Layout solves run ahead on a second core while the search goes on.

CP-SAT releases the GIL while it solves (measured: eight layout models of Llama-3-70B on
1,024 H100s in 5.3 s one after another, 2.9 s on two threads), and most of a large plan's
time is such solves, one at a time, each waiting for the last. The search therefore builds
the solve it will most likely need next (the same setting at the next smaller microbatch)
and hands it to one worker thread, solving the current one itself meanwhile. When the
search then asks for that setting, the result is ready or under way; when it does not ask
(a bound pruned it, or a reused layout fitted) the result is dropped.

Results are the same as solving in turn: a layout solve is a pure function of its model
(one CP-SAT worker, a fixed seed, no hint), and the worker runs only OR-Tools code; every
autopar object (cost tables, caches, constraint hooks) is touched on the calling thread.
With one core there is no worker and every solve runs in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from autopar.core.cluster.compute_share import usable_cores
from autopar.solver.model.cpsat import LayoutModel, SolveResult, run


class SolveAhead:
    """Solves by key: :meth:`submit` starts one on the worker, :meth:`solve` returns the
    result for a key, taking the worker's when it has started or finished it and solving
    on this thread otherwise. :meth:`close` drops and stops what is left.

    >>> ahead = SolveAhead(cores=1)  # no worker: every solve runs in turn
    >>> ahead.enabled
    False
    >>> ahead.close()
    """

    def __init__(self, cores: int | None = None) -> None:
        cores = usable_cores() if cores is None else cores
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="autopar-solve")
                      if cores >= 2 else None)
        self._pending: dict[tuple, tuple[LayoutModel, Future]] = {}
        self.taken = 0  # solves the worker ran that the search then used

    @property
    def enabled(self) -> bool:
        return self._pool is not None

    def wants(self, key: tuple) -> bool:
        """Whether submitting ``key`` would do anything."""
        return self._pool is not None and key not in self._pending

    def submit(self, key: tuple, built: LayoutModel) -> None:
        if self.wants(key):
            self._pending[key] = (built, self._pool.submit(run, built))

    def solve(self, key: tuple, build: Callable[[], LayoutModel]) -> SolveResult:
        """The result for ``key``: the worker's when it has it in hand, else solved here."""
        built, future = self._pending.pop(key, (None, None))
        if future is not None and not future.cancel():  # started or done: wait for it
            self.taken += 1
            return future.result()
        return run(built if built is not None else build())  # still queued: solved here

    def close(self) -> None:
        """Cancel what has not started, stop what has, and let the worker go."""
        for built, future in self._pending.values():
            if not future.cancel():
                built.stop()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
