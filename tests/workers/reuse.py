"""One trace and one model per process, shared by the cases a worker runs.

``autopar.parallelize`` traces the model it is given (and again at the plan's microbatch):
a second of work per trace, on every rank, for every case. The cases of one launch often
use the same model: :class:`Traces` keeps each trace and gives each case a copy of it (the
passes rewrite the graph they are given), and :func:`shared_model` builds each model once
and hands it back with its first weights (training under a layout updates the weights the
traced graph shares with the model).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx as fx

import autopar.api.parallelize as parallelize_module


def copy_traced(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module over the same parameters, with its own graph to rewrite."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    module = fx.GraphModule(gm, graph, gm.__class__.__name__)
    module.meta.update(gm.meta)
    return module


def _shapes(inputs: Any) -> str:
    return repr(fx.node.map_aggregate(
        inputs, lambda v: (type(v).__name__, tuple(v.shape), str(v.dtype))
        if hasattr(v, "shape") else v))


class Traces:
    """Every trace of this process, made once (installed as ``parallelize``'s ``trace``)."""

    def __init__(self) -> None:
        self.made: dict[tuple, tuple[fx.GraphModule, bool]] = {}
        self.real = parallelize_module.trace
        parallelize_module.trace = self

    def __call__(self, model, example_inputs, **kwargs) -> fx.GraphModule:
        return copy_traced(self.first(model, example_inputs, **kwargs))

    def first(self, model, example_inputs, **kwargs) -> fx.GraphModule:
        """The trace itself (every name of a tied weight still on it), made once (again
        where op costs are asked for and the kept one was traced without them)."""
        key = (id(model), _shapes(example_inputs))
        costs = kwargs.get("costs", True)
        if key not in self.made or costs and not self.made[key][1]:
            self.made[key] = (self.real(model, example_inputs, **kwargs), costs)
        return self.made[key][0]

    def clear(self) -> None:
        self.made.clear()


_MODELS: dict[Any, tuple[Any, Any, dict]] = {}


@contextmanager
def shared_model(key: Any, build: Callable[[], tuple]) -> Iterator[tuple]:
    """``build()``'s ``(model, batch)``, built once per ``key`` in this process; the model's
    first weights and buffers are restored when the block ends."""
    if key not in _MODELS:
        model, batch = build()
        _MODELS[key] = (model, batch, copy.deepcopy(model.state_dict()))
    model, batch, initial = _MODELS[key]
    try:
        yield model, batch
    finally:
        model.load_state_dict(initial)
