"""Progress of long planning work on a terminal: what is traced or solved now, and the best
plan so far.

The CLI opens a display for its command (:func:`for_terminal`: a live line on stderr when
stderr is a terminal and ``--quiet`` is not given, nothing otherwise) and makes it current
(:func:`reporting`); tracing and the search report to whatever is current, which by
default shows nothing, so the library API stays silent.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from typing import IO


class Progress:
    """Shows nothing (the default, for pipes, ``--quiet`` and library calls)."""

    def update(self, doing: str, best: str | None = None) -> None:
        """Say what runs now, and the best plan so far (text, or None when there is none)."""

    def close(self) -> None:
        """Take the display down."""


class LiveProgress(Progress):
    """One live status line on a terminal (rich), redrawn as the work moves on."""

    def __init__(self, stream: IO[str]):
        from rich.console import Console

        self._console = Console(file=stream, stderr=stream is sys.stderr)
        self._status = self._console.status("starting", spinner="dots")
        self._status.start()
        self._started = time.perf_counter()
        self._best: str | None = None

    def update(self, doing: str, best: str | None = None) -> None:
        self._best = best or self._best
        elapsed = time.perf_counter() - self._started
        line = f"[{elapsed:5.1f} s] {doing}"
        if self._best:
            line += f"  [bold]best so far:[/] {self._best}"
        self._status.update(line)

    def close(self) -> None:
        self._status.stop()


_SILENT = Progress()
_CURRENT: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "autopar_progress", default=None)


def current() -> Progress:
    """The display work reports to now (one that shows nothing outside :func:`reporting`)."""
    return _CURRENT.get() or _SILENT


def for_terminal(quiet: bool = False, stream: IO[str] | None = None) -> Progress:
    """A live display when ``stream`` (stderr) is a terminal and not ``quiet``; else one
    that shows nothing."""
    stream = stream if stream is not None else sys.stderr
    if quiet or not getattr(stream, "isatty", lambda: False)():
        return Progress()
    return LiveProgress(stream)


@contextlib.contextmanager
def reporting(progress: Progress) -> Iterator[Progress]:
    """Make ``progress`` current for the block; take it down after."""
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.close()
