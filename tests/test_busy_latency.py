"""Busy latency: asynchronous messages (DDP buckets, pipeline sends) on CPU processes that
hold every core wait for one; blocking tensor-parallel collectives do not."""

from __future__ import annotations

import pytest

import autopar
from autopar.calibrate import busy_latency_from
from autopar.core.cluster import load_cluster
from autopar.core.errors import ClusterError
from autopar.models import GPT, GPTConfig


def _cluster(busy_us: float, cores: int) -> dict:
    return {"nodes": 1, "devices_per_node": 2, "cores_per_node": cores,
            "device": {"preset": "cpu"}, "intra_node_link": {"busy_latency_us": busy_us}}


def _predicted(cluster: dict, width: int = 64, **pins) -> dict:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=width))
    x = torch.randint(0, 64, (4, 32))
    return autopar.plan(model, cluster, (x, x), **pins).predicted


@pytest.mark.parametrize("pins, term", [({"dp": 2, "tp": 1}, "dp_exposed_s"),
                                        ({"pp": 2, "schedule": "1f1b"}, "p2p_s")])
def test_asynchronous_messages_pay_it_when_no_core_is_spare(pins, term) -> None:
    without = _predicted(_cluster(0, 2), **pins)
    busy = _predicted(_cluster(5000, 2), **pins)
    spare_cores = _predicted(_cluster(5000, 4), **pins)
    assert busy[term] > without[term] + 4e-3  # at least one 5 ms message on the path
    assert busy["step_time_s"] > without["step_time_s"]
    # with a core to spare, gloo's threads take it: no wait (compute shares differ, so
    # compare the communication term, not the step)
    assert spare_cores[term] == pytest.approx(without[term], rel=1e-6)


def test_tensor_parallel_collectives_do_not_pay_it() -> None:
    pins = {"dp": 1, "tp": 2, "width": 1024}  # wide enough that splitting the matmuls pays
    without = _predicted(_cluster(0, 2), **pins)
    busy = _predicted(_cluster(5000, 2), **pins)
    assert without["tp_comm_s"] > 0
    assert busy["tp_comm_s"] == pytest.approx(without["tp_comm_s"], rel=1e-6)


def test_a_negative_busy_latency_names_the_field() -> None:
    with pytest.raises(ClusterError) as err:
        load_cluster(_cluster(-1, 2))
    assert "intra_node_link.busy_latency_us" in str(err.value)


def test_fit_is_the_median_wait_beyond_compute_and_idle_message() -> None:
    points = [{"loaded_s": 4e-3, "compute_s": 2e-3, "idle_message_s": 5e-4},
              {"loaded_s": 2.1e-3, "compute_s": 2e-3, "idle_message_s": 5e-4},  # < idle: 0
              {"loaded_s": 7e-3, "compute_s": 5e-3, "idle_message_s": 5e-4}]
    assert busy_latency_from(points) == pytest.approx(1.5e-3)
