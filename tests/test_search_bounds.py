"""The search never discards a better plan: settings it pruned by a bound, skipped or never
reached, solved pinned, are never faster than its choice, and their memory and time floors
are never above what they solve to (``benchmarks/search_audit.py``; it runs 200 pairs and
more, this test a fixed handful of small ones)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _audit_module():
    spec = importlib.util.spec_from_file_location("search_audit",
                                                  ROOT / "benchmarks" / "search_audit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["search_audit"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_no_pruned_or_skipped_setting_beats_the_plan() -> None:
    audit = _audit_module().run_audit(pairs=10, pinned=2, seed=11, models=5, small=True)
    assert audit.planned >= 5 and len(audit.findings) >= 8, (audit.planned, audit.findings)
    assert not audit.violations, "\n".join(
        f"{f.pair}: {f.status} {f.setting}: pinned {f.pinned} vs {f.auto} {f.floor_note}"
        for f in audit.violations)
