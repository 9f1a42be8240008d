"""A sharding rule for the plugin's custom op: elementwise, so it runs on any shard."""

from __future__ import annotations

from autopar.strategies import OpCall, Strategy, register_rule, replicate_all
from autopar.strategies.pointwise import shard_each_dim


def scaled_tanh_rule(call: OpCall, axis_size: int) -> list[Strategy]:
    """Whole, or split along any dimension the axis divides (elementwise)."""
    return [replicate_all(call), *shard_each_dim(call, axis_size, call.out[0].shape)]


def register() -> None:
    """The ``autopar.rules`` entry point: autopar calls it once, on discovery."""
    import autopar_example_plugin.ops  # noqa: F401 - defines the op

    register_rule("autopar_example::scaled_tanh", replace=True)(scaled_tanh_rule)
