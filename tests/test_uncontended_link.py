"""The intra-node link with no more processes than cores: gloo is slower while CPU processes
outnumber the cores, so a plan on fewer of them (a sub-cluster) is priced on the link that
`autopar calibrate` measured with one process per core, not the crowded one."""

from __future__ import annotations

import pytest

from autopar.core.cluster import format_cluster, load_cluster
from autopar.core.cluster.subset import sub_cluster
from autopar.core.errors import ClusterError

CROWDED = {"bandwidth_gb_per_s": 1.7, "latency_us": 940, "busy_latency_us": 1170}
ONE_PER_CORE = {"bandwidth_gb_per_s": 2.3, "latency_us": 440, "busy_latency_us": 1000}


def _four_on_two_cores(**extra) -> dict:
    return {"nodes": 1, "devices_per_node": 4, "cores_per_node": 2, "device": {"preset": "cpu"},
            "intra_node_link": CROWDED, "intra_node_link_uncontended": ONE_PER_CORE, **extra}


def test_a_sub_cluster_within_the_cores_uses_the_uncontended_link() -> None:
    four = load_cluster(_four_on_two_cores())
    assert four.intra_node.latency_s == pytest.approx(940e-6)  # 4 processes on 2 cores
    two = sub_cluster(four, 2)
    assert two.intra_node.latency_s == pytest.approx(440e-6)
    assert two.intra_node.bandwidth_bytes_per_s == pytest.approx(2.3e9)
    assert two.intra_node.busy_latency_s == pytest.approx(1000e-6)
    for c in (four, two):
        assert load_cluster(c.to_dict()) == c
    assert "at most 2 processes" in format_cluster(four)


def test_without_cores_per_node_the_link_is_kept() -> None:
    gpu_like = load_cluster({k: v for k, v in _four_on_two_cores().items() if k != "cores_per_node"})
    assert sub_cluster(gpu_like, 2).intra_node.latency_s == pytest.approx(940e-6)


def test_half_a_link_names_the_missing_key() -> None:
    with pytest.raises(ClusterError) as err:
        load_cluster(_four_on_two_cores(intra_node_link_uncontended={"latency_us": 10}))
    assert err.value.where.endswith("intra_node_link_uncontended.bandwidth_gb_per_s")


def test_plans_on_fewer_processes_are_priced_on_it() -> None:
    torch = pytest.importorskip("torch")
    import autopar
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=256))
    x = torch.randint(0, 64, (4, 32))
    pins = {"dp": 1, "tp": 2, "devices": 2}
    crowded = autopar.plan(model, _four_on_two_cores(intra_node_link_uncontended=CROWDED),
                           (x, x), **pins).predicted
    calm = autopar.plan(model, _four_on_two_cores(), (x, x), **pins).predicted
    # the crowded link makes sharding the matmuls dearer: at best the same plan, costlier
    assert calm["tp_comm_s"] > 0
    assert calm["step_time_s"] < crowded["step_time_s"]

