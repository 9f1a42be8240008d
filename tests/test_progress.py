"""Progress for long work: a live display on a terminal, nothing when piped or --quiet, and
Ctrl-C stopping with the best plan so far."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from autopar.core import progress
from autopar.core.plan import Plan
from tests.distributed import ROOT

pty = pytest.importorskip("pty")
SMALL = "gpt:layers=2,hidden=64,heads=2,vocab=128,seq=32"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_unless_a_terminal_and_not_quiet() -> None:
    assert type(progress.for_terminal(stream=io.StringIO())) is progress.Progress
    assert type(progress.for_terminal(quiet=True, stream=_Tty())) is progress.Progress
    live = progress.for_terminal(stream=_Tty())
    assert isinstance(live, progress.LiveProgress)
    live.close()


def test_the_library_reports_to_nothing_outside_the_cli() -> None:
    assert type(progress.current()) is progress.Progress
    shown = progress.LiveProgress(_Tty())
    with progress.reporting(shown):
        assert progress.current() is shown
    assert type(progress.current()) is progress.Progress


def _run_in_pty(args: list[str], interrupt_on: bytes | None = None, timeout: float = 300
                ) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on a pseudo-terminal; its exit code and output.
    With ``interrupt_on``, send SIGINT once that text has been shown."""
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "autopar.cli.main", *args], stdout=slave,
                            stderr=slave, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
    os.close(slave)
    out, sent, deadline = b"", False, time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            out += data
        if interrupt_on and not sent and interrupt_on in out:
            proc.send_signal(signal.SIGINT)
            sent = True
        if not ready and proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(), out.decode(errors="replace")


def test_a_terminal_shows_what_is_solved_and_the_best_so_far() -> None:
    code, out = _run_in_pty(["plan", SMALL, "--cluster", "8xA100-80GB"])
    assert code == 0, out[-2000:]
    assert "tracing " + SMALL in out
    assert "devices: solving" in out and "best so far" in out
    assert "autopar plan:" in out  # the plan itself follows


def test_quiet_and_pipes_show_no_progress() -> None:
    code, out = _run_in_pty(["plan", SMALL, "--cluster", "8xA100-80GB", "--quiet"])
    assert code == 0 and "solving" not in out and "best so far" not in out
    assert "autopar plan:" in out
    proc = subprocess.run([sys.executable, "-m", "autopar.cli.main", "plan", SMALL,
                           "--cluster", "8xA100-80GB"], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "solving" not in proc.stdout and proc.stdout.startswith("autopar plan:")


@pytest.mark.slow
def test_ctrl_c_stops_with_the_best_plan_so_far(tmp_path) -> None:
    saved = tmp_path / "plan.json"
    # a search that goes on for minutes after its first plan (70B on 128 GPUs, no solve
    # budget), so that the signal always lands in it, however loaded the machine
    code, out = _run_in_pty(["plan", "llama3-70b", "--cluster", "16x8xH100-80GB",
                             "--max-solves", "none", "--json", str(saved)],
                            interrupt_on=b"best so far")
    assert code == 130, out[-2000:]  # cut short, as Ctrl-C elsewhere; the plan still printed
    assert "search interrupted (Ctrl-C): the best plan found so far" in out
    assert "mesh " in out
    assert Plan.load(saved).solver["interrupted"] is True  # and written
