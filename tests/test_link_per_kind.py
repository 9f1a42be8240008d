"""A link's per-kind fits: a collective measured on its own is priced on its own fit.

gloo's reduce-scatter takes 1.7-2.5x an all-reduce of the same tensor
(``benchmarks/results/cpu_steps_plan_time_2026-11-27e.md``); a calibrated profile fits each
collective kind, and the cost model must price ZeRO's reduce-scatters on that fit, not on
the all-reduce's.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.calibrate import CollectivePoint, make_profile
from autopar.cli.demo_data import demo_batches, demo_model
from autopar.core.cluster import LinkSpec, load_cluster
from autopar.core.cluster.profile import write_profile
from autopar.core.errors import ClusterError
from tests.test_calibrate import recorded_device

LATENCY_ONLY = {"bandwidth_gb_per_s": 1000.0, "latency_us": 10_000}
"""A link where only latency costs: the predicted time counts hops x latency."""


@pytest.mark.parametrize("backend, gather_hops, reduce_units", [
    ("nccl", 1, 3),   # all-gather: one 10 ms hop on 2 ranks; reduce-scatter: its own 30 ms
    ("gloo", 2, 3),   # gloo's all-gather priced as an all-reduce (2 hops); its own fit wins
])
def test_a_collective_with_its_own_fit_is_priced_on_it(backend: str, gather_hops: int,
                                                       reduce_units: int) -> None:
    """ZeRO-2 on the demo GPT makes 5 all-gathers and 5 reduce-scatters (one per unit); with
    a 30 ms fit of its own, each reduce-scatter costs 3 of the all-reduce fit's 10 ms hops."""
    link = {**LATENCY_ONLY, "per_kind": {"reduce_scatter": {"bandwidth_gb_per_s": 1000.0,
                                                            "latency_us": 30_000}}}
    cluster = {"name": "per-kind", "nodes": 1, "devices_per_node": 2, "backend": backend,
               "device": {"preset": "A100-80GB"}, "intra_node_link": link,
               "inter_node_link": LATENCY_ONLY}
    plan = autopar.plan(demo_model(), cluster, demo_batches(1)[0], dp=2, tp=1, pp=1, zero=2,
                        microbatches=1, recompute="none")
    expected = 5 * gather_hops + 5 * reduce_units
    assert plan.predicted["dp_comm_s"] / 10e-3 == pytest.approx(expected, abs=0.1)


def test_calibration_writes_each_kinds_fit_and_the_cluster_reads_it(tmp_path) -> None:
    """make_profile fits the all-reduce points to the link and every other kind measured at
    two sizes or more to its own ``per_kind`` entry; a cluster naming the profile prices with
    it, and the fits survive ``to_dict``."""
    points = [CollectivePoint("all_reduce", b, 2, 2e-4 + b / 1e9) for b in (2**10, 2**20)]
    points += [CollectivePoint("reduce_scatter", b, 2, 3e-4 + 0.5 * b / 2e8)
               for b in (2**10, 2**20)]  # 0.5: a 2-rank reduce-scatter's bus factor
    path = write_profile(make_profile(recorded_device(), points, {"nproc": 2}), tmp_path / "p.json")
    fits = json.loads(path.read_text())["intra_node_link"]["per_kind"]
    assert set(fits) == {"reduce_scatter"}
    c = load_cluster({"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": str(path)})
    bandwidth, latency = c.intra_node.per_kind["reduce_scatter"]
    assert bandwidth == pytest.approx(2e8, rel=1e-6)
    assert latency == pytest.approx(3e-4, rel=1e-6)
    assert load_cluster(c.to_dict()) == c


@pytest.mark.parametrize("per_kind, where", [
    ({"reduce_scater": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}},
     "per_kind.reduce_scater"),
    ({"reduce_scatter": {"bandwidth_bytes_per_s": 1e9}}, "per_kind.reduce_scatter"),
    ({"all_gather": {"bandwidth_bytes_per_s": -1.0, "latency_s": 1e-4}},
     "per_kind.all_gather.bandwidth_bytes_per_s"),
])
def test_a_bad_fit_in_a_profile_is_refused_naming_it(tmp_path, per_kind: dict,
                                                      where: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "format": "autopar-profile", "version": 1,
        "intra_node_link": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4,
                            "per_kind": per_kind}}))
    with pytest.raises(ClusterError) as err:
        load_cluster({"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": str(path)})
    assert where in err.value.where


def test_a_bad_fit_in_code_is_refused() -> None:
    with pytest.raises(ClusterError, match="per_kind.reduce_scatter"):
        LinkSpec(1e9, 1e-4, per_kind={"reduce_scatter": (1e9,)})
