"""The backward the cost model prices is the one autograd runs op by op: each memory-bound
op's backward kernels as the trace measured them (``autopar/trace/backward_kernels.py``),
and the sums of gradients a value read by several differentiable ops needs
(``CostTables._gradient_sums``). Figures are modelled (H100 preset)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.core.cluster import load_cluster
from autopar.core.graph_facts import META_KEY
from autopar.cost_models.compute import op_time
from autopar.solver.search.pinned import PinnedConfig, estimate_graph

WHOLE = PinnedConfig(dp=1, global_batch=32, microbatch=32, precision="fp32", recompute="none")
"""The traced batch in one microbatch, in fp32: the tensors the trace measured."""


class Ops(torch.nn.Module):
    """One each of the ops whose backward differs: a pass-through (add), a product with a
    gradient per input (mul), a derivative with its own power (pow), and ``h`` read three
    times (its gradient is summed from three)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.proj(x)
        a = h + x
        b = h * a
        c = h.pow(2)
        return (a + b + c).sum()


def _facts(gm) -> dict[str, object]:
    return {n.meta[META_KEY].target: n.meta[META_KEY] for n in gm.graph.nodes
            if n.op == "call_function"}


@pytest.fixture(scope="module")
def traced():
    return autopar.trace(Ops(), (torch.randn(32, 64),))


def test_the_trace_counts_the_backward_kernels_autograd_runs(traced) -> None:
    facts = _facts(traced)
    add, mul, pow_ = (facts[t] for t in ("aten.add.Tensor", "aten.mul.Tensor",
                                         "aten.pow.Tensor_Scalar"))
    size = 32 * 64 * 4
    assert add.bwd_kernels == 0 and add.bwd_bytes == 0  # its gradient passes through
    assert mul.bwd_kernels == 2 and mul.bwd_bytes == 2 * 3 * size  # grad * b, grad * a
    assert pow_.bwd_kernels == 3 and pow_.bwd_bytes > 2 * (pow_.bytes_read + pow_.bytes_written)


def test_memory_bound_backwards_are_priced_from_their_kernels(traced) -> None:
    cluster = load_cluster("1xH100-80GB")
    est = estimate_graph(traced, cluster, WHOLE)
    times = {d.name: est.tables.times(d, d.candidates[i])
             for d, i in zip(est.problem.decisions, est.choice) if d.kind == "op"}
    size = 32 * 64 * 4
    device = cluster.device
    assert times["add_2"][1] == 0.0  # read once: no sum either
    assert times["mul"][1] == pytest.approx(op_time(0.0, 6 * size, device, "fp32", kernels=2))
    assert times["pow_1"][1] > times["mul"][1]


def test_a_value_read_by_three_ops_pays_two_gradient_sums(traced) -> None:
    cluster = load_cluster("1xH100-80GB")
    est = estimate_graph(traced, cluster, WHOLE)
    tables = est.tables
    by_name = {d.name: (d, d.candidates[i])
               for d, i in zip(est.problem.decisions, est.choice) if d.kind == "op"}
    one = op_time(0.0, 3 * 32 * 64 * 4, cluster.device, "fp32")
    assert tables._gradient_sums(*by_name["linear"]) == pytest.approx(2 * one)  # add, mul, pow
    assert tables._gradient_sums(*by_name["add"]) == pytest.approx(one)  # mul, add_1
    assert tables._gradient_sums(*by_name["pow_1"]) == 0.0  # read once


def test_a_fusing_program_folds_the_sums(traced) -> None:
    cluster = load_cluster("1xH100-80GB")
    est = estimate_graph(traced, cluster, replace(WHOLE, fuse_elementwise=True))
    d, i = next((d, i) for d, i in zip(est.problem.decisions, est.choice)
                if d.kind == "op" and d.name == "linear")
    assert est.tables._gradient_sums(d, d.candidates[i]) == 0.0


def test_measured_op_rates_bound_only_backwards_that_run() -> None:
    """A CPU's measured per-element rate for ``add`` (a bias broadcast, whose backward sums
    into the bias) bounds a broadcast add's backward; a same-shape add, whose gradient
    passes through, still costs nothing in backward."""

    class Adds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(64))

        def forward(self, x):
            return ((x + self.bias) + x).sum()

    gm = autopar.trace(Adds(), (torch.randn(32, 64),))
    cluster = load_cluster({"name": "c", "nodes": 1, "devices_per_node": 1, "device": {
        "preset": "cpu", "op_ns_per_element": {"add": [2, 3]}}})
    est = estimate_graph(gm, cluster, WHOLE)
    times = {d.name: est.tables.times(d, d.candidates[i])
             for d, i in zip(est.problem.decisions, est.choice) if d.kind == "op"}
    assert times["add"][1] >= 32 * 64 * 3e-9  # the bias's gradient: a sum over rows
    assert times["add_1"][1] == 0.0


def test_each_piece_of_a_split_sums_its_own_gradients() -> None:
    """``a, b = h.split(32, -1)`` with ``b`` read twice: one sum, of ``b``'s size."""

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x):
            a, b = self.proj(x).split(32, -1)
            return (b * b.sin() + a).sum()

    gm = autopar.trace(Split(), (torch.randn(32, 64),))
    cluster = load_cluster("1xH100-80GB")
    est = estimate_graph(gm, cluster, WHOLE)
    d, i = next((d, i) for d, i in zip(est.problem.decisions, est.choice)
                if d.kind == "op" and d.facts.target == "aten.split.Tensor")
    assert est.tables._gradient_sums(d, d.candidates[i]) == pytest.approx(
        op_time(0.0, 3 * 32 * 32 * 4, cluster.device, "fp32"))
