"""Errors that say what went wrong, where, and what to do.

Every error autopar raises on bad input is an ``AutoparError``. Its message has three parts
so a user never has to read a traceback to act on it::

    autopar: cluster file 'c.yaml': unknown device preset 'H1000'
      where: devices.preset
      fix:   use one of A100-40GB, A100-80GB, H100-80GB, ...

The CLI prints the message and exits with status 2; the Python API raises it.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base of every error autopar raises on purpose."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [self.what]
        if self.where:
            lines.append(f"  where: {self.where}")
        if self.fix:
            lines.append(f"  fix:   {self.fix}")
        return "\n".join(lines)


class ClusterError(AutoparError):
    """A cluster description or shorthand is malformed."""


class TraceError(AutoparError):
    """A model could not be traced into a graph."""


class ModelSpecError(AutoparError):
    """A model name, parametric spec or factory path could not be resolved."""


class PlanError(AutoparError):
    """A plan is malformed, or belongs to another model or schema version."""


class NoFeasiblePlanError(AutoparError):
    """No mesh fits the model in device memory."""


class PassError(AutoparError):
    """A graph rewrite pass failed."""


class RuntimeSetupError(AutoparError):
    """The distributed runtime cannot run a plan (world size, backend, ...)."""
