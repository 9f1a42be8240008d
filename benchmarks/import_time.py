"""What importing autopar costs beyond torch, and how long ``autopar --help`` takes.

    python benchmarks/import_time.py [--runs 5]

Each figure is the median of fresh interpreters (measured, this machine), run alternately so
a busy moment hits both sides alike. The target (issue 56): ``import autopar`` and
``autopar --help`` at most 0.5 s more than ``import torch``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import autopar": [sys.executable, "-c", "import autopar"],
    "import autopar; autopar.plan": [sys.executable, "-c", "import autopar; autopar.plan"],
    "autopar --help": [sys.executable, "-m", "autopar.cli.main", "--help"],
}


def _seconds(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(runs):
        for name, cmd in CASES.items():
            times[name].append(_seconds(cmd))
    torch_s = statistics.median(times["import torch"])
    print(f"median of {runs} fresh interpreters each (measured)")
    print(f"{'':32}{'seconds':>9}{'- torch':>9}{'/ torch':>9}")
    for name, values in times.items():
        s = statistics.median(values)
        print(f"{name:32}{s:9.2f}{s - torch_s:+9.2f}{s / torch_s:9.2f}")
    worst = max(statistics.median(times[n]) for n in ("import autopar", "autopar --help"))
    print(f"target: import autopar and autopar --help <= import torch + 0.5 s: "
          f"{'met' if worst <= torch_s + 0.5 else 'NOT met'} ({worst - torch_s:+.2f} s)")


if __name__ == "__main__":
    main()
