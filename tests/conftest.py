"""Suite-wide settings."""

from __future__ import annotations

import os

import pytest
import torch

from tests.strict_warnings import raise_on_autopar_deprecations

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: one thread each, in them and in what they launch (a
    # second thread per worker only spins against the other worker)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_deprecated_calls_from_autopar() -> None:
    raise_on_autopar_deprecations()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first: the files of multi-process (``slow``) tests run before the rest, the
    one that says ``LONGEST = True`` (the zoo matrix, one launch) before all, so that the two
    xdist workers (``-n 2 --dist loadfile``, pyproject.toml) end together. Order within a
    file is kept; no test depends on another's order."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> int:
        if getattr(getattr(item, "module", None), "LONGEST", False):
            return 0
        return 1 if item.path in slow else 2
    items.sort(key=rank)  # stable
