"""The package's public names load on first use: ``import autopar`` stays cheap (no solver,
no runtime, no torch.distributed), and every public name still resolves to what it names."""

from __future__ import annotations

import subprocess
import sys

import autopar


def test_every_public_name_resolves() -> None:
    for name in autopar.__all__:
        assert getattr(autopar, name) is not None, name
    assert set(autopar.__all__) <= set(dir(autopar))


def test_trace_stays_the_function_once_its_package_loads() -> None:
    import autopar.trace.capture  # noqa: F401  (sets the submodule on the package)

    assert callable(autopar.trace) and autopar.trace.__name__ == "trace"


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        autopar.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("autopar.no_such_name resolved")


def test_import_autopar_loads_neither_solver_nor_runtime() -> None:
    code = ("import sys, autopar; print(sorted(m for m in sys.modules if m.startswith(("
            "'autopar.solver', 'autopar.runtime', 'autopar.api', 'torch', 'ortools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
