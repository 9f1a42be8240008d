"""Suite-wide settings."""

from __future__ import annotations

import pytest

from tests.strict_warnings import raise_on_autopar_deprecations


@pytest.fixture(autouse=True)
def _no_deprecated_calls_from_autopar() -> None:
    raise_on_autopar_deprecations()
