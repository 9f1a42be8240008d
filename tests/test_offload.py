"""CPU offload (ZeRO-3's shards in host memory, FSDP2's CPUOffloadPolicy) is planned only
when nothing fits in device memory without it, and then fits."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.cluster import load_cluster
from autopar.models import GPT, GPTConfig
from autopar.solver.options import PlanOptions
from autopar.solver.search.memory_floors import lowest_memory

CLUSTER = {"nodes": 1, "devices_per_node": 2, "device": {"preset": "A100-80GB"}}


@pytest.fixture(scope="module")
def traced():
    model = GPT(GPTConfig(block_size=64, vocab_size=4096, n_layer=4, n_head=4, n_embd=256))
    idx = torch.randint(0, 4096, (8, 64))
    return autopar.trace(model, (idx, idx))


def test_offload_is_used_only_when_nothing_else_fits(traced) -> None:
    roomy = autopar.plan(traced, CLUSTER, precision="fp32")
    assert "offload" not in roomy.training
    offloaded = autopar.plan(traced, CLUSTER, precision="fp32", offload="optimizer+params")
    assert offloaded.training["offload"] == "optimizer+params"
    assert offloaded.training["zero"] == 3
    kept = autopar.plan(traced, CLUSTER, precision="fp32", offload="none", zero=3)
    # the leanest offloaded plan (one sequence a microbatch) against the leanest kept one
    host = autopar.plan(traced, CLUSTER, precision="fp32", offload="optimizer+params",
                        microbatch=1).predicted["peak_memory_bytes"]
    # the least memory any plan without offload needs (what the planner's "fits nowhere"
    # error reports: every mesh at microbatch 1, each op at its leanest strategy)
    smallest = lowest_memory(traced, load_cluster(CLUSTER), PlanOptions(precision="fp32"))[1].total
    assert host < smallest  # the shards left the device
    # a device between the two: only offload fits, and the planner takes it by itself
    capacity = (host + smallest) / 2
    fraction = capacity / (80 * 2**30)
    tight = autopar.plan(traced, CLUSTER, precision="fp32", memory_fraction=fraction)
    assert tight.training.get("offload") == "optimizer+params"
    assert tight.predicted["peak_memory_bytes"] <= capacity
    # the host link and the host optimizer are priced: slower than the same plan kept
    assert tight.predicted["optimizer_s"] > kept.predicted["optimizer_s"]
    with pytest.raises(autopar.AutoparError):
        autopar.plan(traced, CLUSTER, precision="fp32", memory_fraction=fraction,
                     offload="none")


def test_offload_names_only_modes_the_runtime_runs(traced) -> None:
    with pytest.raises(autopar.AutoparError, match="offload") as info:
        autopar.plan(traced, CLUSTER, offload="optimizer")
    assert info.value.where == "PlanOptions.offload"
