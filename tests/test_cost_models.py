"""Cost model v0: collectives, links by mesh axis, ZeRO model-state accounting."""

from __future__ import annotations

import pytest

from autopar.cluster import load_cluster
from autopar.cost_models.comm import axis_link, collective_time
from autopar.cost_models.memory import model_state_bytes
from autopar.cost_models.redistribute import partial_grad_time, redistribution_time
from autopar.placements import Partial, Replicate, Shard


def test_ring_all_reduce_moves_twice_the_data_of_all_gather() -> None:
    link = load_cluster("8xH100-80GB").intra_node
    big = 1e9
    ar = collective_time("all_reduce", big, 8, link)
    ag = collective_time("all_gather", big, 8, link)
    assert ar == pytest.approx(2 * ag, rel=1e-9)
    assert collective_time("all_reduce", big, 1, link) == 0.0
    # bus-bandwidth convention: 2 (n-1)/n bytes at the link's bandwidth, plus 2 (n-1) hops
    assert ar == pytest.approx(2 * 7 / 8 * big / link.bandwidth_bytes_per_s
                               + 14 * link.latency_s, rel=1e-9)


def test_axis_links_follow_the_mesh_layout() -> None:
    c = load_cluster("4x8xH100-80GB")
    assert axis_link(c, {"dp": 4, "tp": 8}, "tp") is c.intra_node
    assert axis_link(c, {"dp": 4, "tp": 8}, "dp") is c.inter_node
    assert axis_link(c, {"dp": 16, "tp": 2}, "dp") is c.inter_node
    one_node = load_cluster("8xH100-80GB")
    assert axis_link(one_node, {"dp": 4, "tp": 2}, "dp") is one_node.intra_node


@pytest.mark.parametrize("zero,expected", [(0, 16.0), (1, 4 + 12 / 64), (2, 2 + 14 / 64),
                                           (3, 16 / 64)])
def test_zero_stages_follow_the_zero_paper(zero: int, expected: float) -> None:
    s = model_state_bytes(1.0, trainable=True, precision="bf16", optimizer="adamw",
                          zero_stage=zero, dp=64)
    assert s.total == pytest.approx(expected)


def test_frozen_parameters_keep_weights_only() -> None:
    s = model_state_bytes(10.0, trainable=False, precision="bf16", optimizer="adamw",
                          zero_stage=0, dp=1)
    assert (s.params, s.grads, s.optimizer) == (20.0, 0.0, 0.0)


def test_redistribution_costs_match_megatron_conventions() -> None:
    link = load_cluster("8xH100-80GB").intra_node
    b = 1e8
    # P -> R is an all-reduce forward and nothing backward (Megatron's "g").
    assert redistribution_time(Partial(), Replicate(), b, 8, link, backward=True) == pytest.approx(
        collective_time("all_reduce", b, 8, link))
    # S -> R all-gathers forward; backward takes a slice.
    assert redistribution_time(Shard(1), Replicate(), b, 8, link, backward=True) == pytest.approx(
        collective_time("all_gather", b, 8, link))
    # R -> S is free forward, all-gathers backward.
    assert redistribution_time(Replicate(), Shard(1), b, 8, link, backward=False) == 0.0
    # "f": a gathered shard sends back a reduce-scatter, a replicated tensor an all-reduce.
    assert partial_grad_time(Shard(1), b, 8, link) < partial_grad_time(Replicate(), b, 8, link)
