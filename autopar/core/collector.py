"""Python's cycle collector paused while autopar builds or searches large structures.

Tracing a 70B model and planning it each build about half a million long-lived objects
(the graph, its node facts, the search's tables). Every full collection walks all of them,
and the allocation rate of both triggers several: measured on Llama-3-70B on 1,024 H100s,
0.5-0.9 s of a trace and 0.4-0.5 s of a plan (5-10% of each). Both leave some objects in
cycles behind (about 125,000 after a plan); the first collection after them frees those.

>>> import gc
>>> with collector_paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within it the cycle collector is off (left as it was when it was off already)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
