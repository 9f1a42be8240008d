"""JSON read as data: every object's keys unique.

``json.loads`` keeps the last of two equal keys without a word, so a hand edit that adds a
key a second time would be silently ignored. Plans and cluster files are read with this.
"""

from __future__ import annotations

import json
from typing import Any


class DuplicateKey(ValueError):
    """An object gives ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def loads(text: str) -> Any:
    """``json.loads``, raising :class:`DuplicateKey` for a key given twice in one object."""
    return json.loads(text, object_pairs_hook=unique_keys)
