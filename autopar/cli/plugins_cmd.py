"""``autopar plugins``: what installed packages add through entry points, and whether it
loaded."""

from __future__ import annotations

import argparse
import warnings

from autopar.core.plugins import GROUPS, PluginWarning, discover


def format_plugins() -> str:
    with warnings.catch_warnings():  # the listing says it; no warning on top
        warnings.simplefilter("ignore", PluginWarning)
        found = discover()
    if not found:
        return ("no plugins: no installed package declares entry points in "
                + ", ".join(GROUPS))
    rows = [("group", "name", "package", "version", "runs", "status")]
    for p in found:
        status = "loaded" if p.status == "loaded" else f"failed: {p.error}"
        rows.append((p.group, p.name, p.package, p.version, p.where or "-", status))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths)) + "  " + r[5]
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    failed = sum(p.status == "failed" for p in found)
    lines.append(f"\n{len(found) - failed} loaded, {failed} failed (skipped; everything else "
                 "runs)")
    return "\n".join(lines)


def run_plugins(args: argparse.Namespace) -> int:
    print(format_plugins())
    return 0
