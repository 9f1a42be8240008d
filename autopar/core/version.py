"""autopar's version, written into emitted programs, reports and plans' provenance (kept
equal to pyproject.toml's by tests/test_layers.py)."""

__version__ = "0.1.0"
