"""autopar uses current torch APIs only: a ``DeprecationWarning`` or ``FutureWarning`` raised
while autopar's own code is on the call stack is an error in the tests.

Filtering by module (``error:::autopar``) is not enough: torch wraps its collectives
(``c10d_logger``), and ``copy.deepcopy`` reaches deprecated constructors through ``copyreg``,
so such warnings are attributed to torch or to the standard library although autopar made the
call. The stack says who did. Tests that check autopar's own deprecation messages (old knob
spellings) catch them with ``pytest.warns``, which bypasses this hook.
"""

from __future__ import annotations

import sys
import warnings

CATEGORIES = (DeprecationWarning, FutureWarning)


def _caller_in_autopar() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "autopar" or name.startswith("autopar."):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def raise_on_autopar_deprecations() -> None:
    """Make such warnings raise where they are issued (call once per process, or per test
    inside pytest's own warning capture)."""
    shown = warnings.showwarning

    def check(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, CATEGORIES):
            caller = _caller_in_autopar()
            if caller is not None:
                raise category(f"{message} (issued while {caller} was running)")
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = check
    for category in CATEGORIES:
        warnings.simplefilter("always", category)
