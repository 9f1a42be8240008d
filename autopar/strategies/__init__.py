"""Sharding strategies: per-op rules listing how each node can run on a mesh axis."""

from autopar.core.strategy import OpCall, Rule, Strategy, TensorMeta, norm_dim, replicate_all
from autopar.strategies.registry import has_rule, register_rule, rule_for, strategies_for

# Register the built-in rules (after the registry exists).
from autopar.strategies import builtin  # noqa: E402,F401  isort: skip

__all__ = [
    "OpCall",
    "Rule",
    "Strategy",
    "TensorMeta",
    "has_rule",
    "norm_dim",
    "register_rule",
    "replicate_all",
    "rule_for",
    "strategies_for",
]
