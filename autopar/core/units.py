"""Human-readable units for reports: bytes in GiB/MiB, seconds, FLOP/s."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """>>> format_bytes(3 * 2**30)
    '3.00 GiB'
    """
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def format_seconds(s: float) -> str:
    """>>> format_seconds(0.0123)
    '12.3 ms'
    """
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} µs"


def format_count(n: float) -> str:
    """>>> format_count(70.55e9)
    '70.55 B'
    """
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"
