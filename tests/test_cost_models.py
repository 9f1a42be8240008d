"""Cost models: compute, collectives and links by mesh axis, memory, pipelines."""

from __future__ import annotations

import math

import pytest

from autopar.core.cluster import load_cluster
from autopar.core.placements import Partial, Replicate, Shard
from autopar.cost_models.comm import axis_link, collective_latency, collective_time
from autopar.cost_models.memory import model_state_bytes
from autopar.cost_models.redistribute import partial_grad_time, redistribution_time


def test_ring_all_reduce_moves_twice_the_data_of_all_gather() -> None:
    link = load_cluster("8xH100-80GB").intra_node
    big = 1e9
    ar = collective_time("all_reduce", big, 8, link)
    ag = collective_time("all_gather", big, 8, link)
    assert ar == pytest.approx(2 * ag, rel=1e-9)
    assert collective_time("all_reduce", big, 1, link) == 0.0
    # bus-bandwidth convention: 2 (n-1)/n bytes at the link's bandwidth, plus 2 (n-1) hops
    assert ar == pytest.approx(
        2 * 7 / 8 * big / link.bandwidth_bytes_per_s + 14 * link.latency_s, rel=1e-9
    )


def test_axis_links_follow_the_mesh_layout() -> None:
    c = load_cluster("4x8xH100-80GB")
    assert axis_link(c, {"dp": 4, "tp": 8}, "tp") is c.intra_node
    assert axis_link(c, {"dp": 4, "tp": 8}, "dp") is c.inter_node
    assert axis_link(c, {"dp": 16, "tp": 2}, "dp") is c.inter_node
    one_node = load_cluster("8xH100-80GB")
    assert axis_link(one_node, {"dp": 4, "tp": 2}, "dp") is one_node.intra_node


@pytest.mark.parametrize(
    "zero,expected", [(0, 16.0), (1, 4 + 12 / 64), (2, 2 + 14 / 64), (3, 16 / 64)]
)
def test_zero_stages_follow_the_zero_paper(zero: int, expected: float) -> None:
    s = model_state_bytes(
        1.0, trainable=True, precision="bf16", optimizer="adamw", zero_stage=zero, dp=64
    )
    assert s.total == pytest.approx(expected)


def test_frozen_parameters_keep_weights_only() -> None:
    s = model_state_bytes(
        10.0, trainable=False, precision="bf16", optimizer="adamw", zero_stage=0, dp=1
    )
    assert (s.params, s.grads, s.optimizer) == (20.0, 0.0, 0.0)


def test_redistribution_costs_match_megatron_conventions() -> None:
    link = load_cluster("8xH100-80GB").intra_node
    b = 1e8
    # P -> R is an all-reduce forward and nothing backward (Megatron's "g").
    assert redistribution_time(Partial(), Replicate(), b, 8, link, backward=True) == pytest.approx(
        collective_time("all_reduce", b, 8, link)
    )
    # S -> R all-gathers forward; backward takes a slice.
    assert redistribution_time(Shard(1), Replicate(), b, 8, link, backward=True) == pytest.approx(
        collective_time("all_gather", b, 8, link)
    )
    # R -> S is free forward, all-gathers backward.
    assert redistribution_time(Replicate(), Shard(1), b, 8, link, backward=False) == 0.0
    # "f": a gathered shard sends back a reduce-scatter, a replicated tensor an all-reduce.
    assert partial_grad_time(Shard(1), b, 8, link) < partial_grad_time(Replicate(), b, 8, link)


# --- compute --------------------------------------------------------------------------------
def test_small_and_skinny_matmuls_run_below_large_gemm_efficiency() -> None:
    from autopar.cost_models.matmul_efficiency import matmul_efficiency

    dev = load_cluster("A100-80GB").device
    large = matmul_efficiency(dev, (8192, 8192, 8192))
    assert large == pytest.approx(dev.matmul_efficiency, rel=0.02)
    assert matmul_efficiency(dev, (256, 256, 256)) < 0.2 * large  # too few tiles for a wave
    assert matmul_efficiency(dev, (16, 8192, 8192)) < 0.2 * large  # skinny: padded tiles
    assert matmul_efficiency(dev, (8192, 8192, 32)) < 0.5 * large  # short K loop
    # no shape: the large-GEMM asymptote (what the solver assumes until it passes shapes)
    assert matmul_efficiency(dev) == dev.matmul_efficiency


def test_measured_curve_replaces_the_parametric_one() -> None:
    from autopar.cost_models.compute import efficiency_from_measurement, op_time

    dev = load_cluster("A100-80GB").device
    curve = ((1e6, 0.05), (1e9, 0.4), (1e12, 0.8))
    calibrated = _DeviceWithCurve(dev, curve)
    flops = 2 * 1024**3  # ~2.1e9: between the last two points, in log-FLOPs
    t = op_time(flops, 0, calibrated, "bf16", shape=(1024, 1024, 1024))
    eff = efficiency_from_measurement(flops, t, calibrated, "bf16")
    expected = 0.4 + (0.8 - 0.4) * math.log(flops / 1e9) / math.log(1e3)
    assert eff == pytest.approx(expected, rel=1e-9)


class _DeviceWithCurve:
    """A device carrying a measured efficiency curve (what a calibrated profile gives)."""

    def __init__(self, device, curve):
        self._device, self.matmul_efficiency_curve = device, curve

    def __getattr__(self, name):
        return getattr(self._device, name)


def test_kernel_floor_dominates_a_tiny_op() -> None:
    from autopar.cost_models.compute import kernel_floor, op_time

    dev = load_cluster("H100-80GB").device
    tiny = op_time(2 * 8**3, 3 * 8 * 8 * 2, dev, "bf16", shape=(8, 8, 8))
    assert kernel_floor(dev) / tiny > 0.9
    assert op_time(2 * 8**3, 384, dev, "bf16", kernels=3) > 2.9 * kernel_floor(dev)
    assert op_time(0, 0, dev, "bf16") == 0.0  # views launch nothing


def test_dtype_peaks_and_backward_of_a_matmul() -> None:
    from autopar.cost_models.compute import backward_time, forward_time, recompute_time

    dev = load_cluster("H100-80GB").device
    flops, moved, shape = 2 * 8192**3, 3 * 8192**2 * 2, (8192, 8192, 8192)
    fp8 = forward_time(flops, moved, dev, "fp8", shape=shape)
    bf16 = forward_time(flops, moved, dev, "bf16", shape=shape)
    fp32 = forward_time(flops, moved, dev, "fp32", shape=shape)
    assert fp8 < bf16 < fp32
    # backward = dX and dW, each a matmul as large as the forward: 2x FLOPs in 2 kernels
    assert backward_time(flops, moved, dev, "bf16", shape=shape) == pytest.approx(2 * bf16)
    assert backward_time(flops, moved, dev, "bf16", shape=shape, weight_grad=False) == (
        pytest.approx(bf16)
    )
    assert recompute_time(flops, moved, dev, "bf16", shape=shape) == bf16


def test_matmul_dims() -> None:
    from autopar.cost_models.matmul_efficiency import linear_dims, matmul_dims, matmul_flops

    assert matmul_dims((2, 12, 1024, 64), (2, 12, 64, 1024)) == (24, 1024, 1024, 64)
    assert linear_dims((2, 1024, 768), 3072) == (1, 2048, 3072, 768)
    assert matmul_flops((2, 3, 4, 5)) == 2 * 2 * 3 * 4 * 5
    with pytest.raises(ValueError, match="inner dims"):
        matmul_dims((4, 5), (6, 7))


# --- communication --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]
)
def test_bus_bandwidth_round_trip(kind: str) -> None:
    from autopar.cost_models.comm import (
        algorithm_bandwidth,
        algorithm_bandwidth_from_bus,
        bus_bandwidth,
        collective_transfer_time,
    )

    link = load_cluster("8xA100-80GB").intra_node
    n, nbytes = 8, 256e6
    seconds = collective_transfer_time(kind, nbytes, n, link)
    # the transfer time at the link's busbw, read back as nccl-tests would, is that busbw
    assert bus_bandwidth(kind, nbytes, seconds, n) == pytest.approx(link.bandwidth_bytes_per_s)
    assert algorithm_bandwidth_from_bus(kind, link.bandwidth_bytes_per_s, n) == pytest.approx(
        algorithm_bandwidth(nbytes, seconds)
    )


def test_tree_all_reduce_has_log_latency_and_ring_like_bandwidth() -> None:
    from autopar.cost_models.comm import collective_transfer_time

    link = load_cluster("4x8xH100-80GB").inter_node
    n = 64
    assert collective_latency("all_reduce", n, link, algorithm="tree") == pytest.approx(
        2 * 6 * link.latency_s
    )
    ring = collective_transfer_time("all_reduce", 1e9, n, link)
    tree = collective_transfer_time("all_reduce", 1e9, n, link, algorithm="tree")
    assert 1.0 < tree / ring < 1.2
    # small messages: tree wins on latency; auto picks the faster
    small = 1e3
    assert collective_time("all_reduce", small, n, link, algorithm="tree") < collective_time(
        "all_reduce", small, n, link
    )
    assert collective_time("all_reduce", small, n, link, algorithm="auto") == collective_time(
        "all_reduce", small, n, link, algorithm="tree"
    )
    with pytest.raises(ValueError, match="all_reduce only"):
        collective_time("all_gather", 1e6, n, link, algorithm="tree")


def test_hierarchical_all_reduce_beats_a_flat_inter_node_ring() -> None:
    from autopar.cost_models.comm import group_collective_time, hierarchical_time

    c = load_cluster("4x8xH100-80GB")
    mesh = {"dp": 32, "tp": 1}
    nbytes = 2e9
    flat = collective_time("all_reduce", nbytes, 32, c.inter_node)
    grouped = group_collective_time("all_reduce", nbytes, mesh, "dp", c)
    assert grouped < flat / 4
    assert grouped == pytest.approx(
        hierarchical_time("all_reduce", nbytes, 8, 4, c.intra_node, c.inter_node)
    )
    # a dp axis strided by tp=8 has one member per node: flat on the inter-node link
    assert group_collective_time("all_reduce", nbytes, {"dp": 4, "tp": 8}, "dp", c) == (
        pytest.approx(collective_time("all_reduce", nbytes, 4, c.inter_node))
    )
    # tp innermost inside a node: the intra-node link
    assert group_collective_time("all_gather", nbytes, {"dp": 4, "tp": 8}, "tp", c) == (
        pytest.approx(collective_time("all_gather", nbytes, 8, c.intra_node))
    )
    # gather and scatter have no hierarchical algorithm in NCCL: flat rings of n - 1 steps
    # whose channels cross the nodes on every device's NIC; send_recv crosses nodes
    for kind in ("all_gather", "reduce_scatter"):
        ring = group_collective_time(kind, nbytes, mesh, "dp", c)
        assert ring < collective_time(kind, nbytes, 32, c.inter_node)
        assert ring >= collective_latency(kind, 4, c.inter_node)  # 3 hops between nodes
    assert group_collective_time("send_recv", 1e6, {"pp": 4, "tp": 8}, "pp", c) == (
        pytest.approx(collective_time("send_recv", 1e6, 2, c.inter_node))
    )


# --- memory ---------------------------------------------------------------------------------
def _adam_state(numel: float, **kw) -> float:
    return model_state_bytes(
        numel, trainable=True, precision="bf16", zero_stage=0, dp=1, **{"optimizer": "adamw", **kw}
    ).optimizer


def test_adafactor_and_8bit_adam_are_much_smaller_than_adam() -> None:
    from autopar.cost_models.memory import adafactor_state_bytes, optimizer_state_bytes

    shape = (4096, 11008)
    numel = shape[0] * shape[1]
    adam = optimizer_state_bytes(numel, "adamw")
    assert adam == 8 * numel
    factored = optimizer_state_bytes(numel, "adafactor", shape=shape)
    assert factored == adafactor_state_bytes(shape) == 4 * (4096 + 11008)
    assert factored < adam / 1000
    assert optimizer_state_bytes(numel, "adam8bit") == pytest.approx(numel * (2 + 2 * 4 / 2048))
    # with the fp32 master copy a 16-bit model keeps either way
    assert _adam_state(numel, optimizer="adam8bit") < 0.55 * _adam_state(numel)
    assert _adam_state(numel, optimizer="adafactor", shape=shape) < 0.34 * _adam_state(numel)
    assert _adam_state(numel, optimizer="sgd") == 4 * numel
    assert _adam_state(numel, optimizer="momentum") == 8 * numel


def test_frozen_weights_in_4_bits_cost_half_a_byte() -> None:
    from autopar.cost_models.memory import lora_params

    s = model_state_bytes(
        1e6,
        trainable=False,
        precision="bf16",
        optimizer="adamw",
        zero_stage=0,
        dp=1,
        storage_bits=4,
    )
    assert (s.params, s.grads, s.optimizer) == (0.5e6, 0.0, 0.0)
    assert lora_params(4096, 4096, 8) == 8 * 8192
    with pytest.raises(ValueError, match="frozen"):
        model_state_bytes(
            1e6,
            trainable=True,
            precision="bf16",
            optimizer="adamw",
            zero_stage=0,
            dp=1,
            storage_bits=4,
        )


def test_cpu_offload_moves_optimizer_bytes_off_the_device() -> None:
    kw = {"trainable": True, "precision": "bf16", "optimizer": "adamw", "dp": 8}
    on = model_state_bytes(1e6, zero_stage=1, **kw)
    off = model_state_bytes(1e6, zero_stage=1, offload="optimizer", **kw)
    assert off.optimizer == 0.0 and off.host_optimizer == on.optimizer
    assert off.params == on.params and off.grads == on.grads
    assert off.total + off.host_total == pytest.approx(on.total)
    full = model_state_bytes(1e6, zero_stage=3, offload="optimizer+params", **kw)
    assert full.total == 0.0
    assert full.host_total == pytest.approx(model_state_bytes(1e6, zero_stage=3, **kw).total)
    with pytest.raises(ValueError, match="zero_stage 3"):
        model_state_bytes(1e6, zero_stage=2, offload="optimizer+params", **kw)


def test_buffers_and_fragmentation() -> None:
    from autopar.cost_models.memory import (
        MemoryBreakdown,
        ddp_bucket_count,
        ddp_buffer_bytes,
        fsdp_buffer_bytes,
    )

    assert ddp_buffer_bytes(1e9) == 1e9  # DDP's buckets copy every gradient
    assert ddp_buffer_bytes(1e9, gradient_as_bucket_view=True) == 0.0
    assert ddp_bucket_count(26 * 2**20) == 2
    assert fsdp_buffer_bytes(100.0, prefetch=1, root_bytes=10.0) == 310.0
    m = MemoryBreakdown(1.0, 2.0, 3.0, 4.0, 0.0, host=5.0, fragmentation=0.5)
    assert m.live == 10.0 and m.total == 15.0
    assert m.to_dict()["fragmentation"] == 5 and m.to_dict()["host"] == 5


# --- pipelines ------------------------------------------------------------------------------
def test_bubble_fractions() -> None:
    from autopar.cost_models.pipeline import bubble_fraction

    assert bubble_fraction("gpipe", 8, 32) == pytest.approx(7 / 32)
    assert bubble_fraction("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert bubble_fraction("interleaved", 8, 32, v=4) == pytest.approx(7 / 128)
    assert bubble_fraction("zb_h1", 8, 32) == pytest.approx(7 / 96)  # a third of 1F1B's
    assert bubble_fraction("zb1p", 8, 32) == bubble_fraction("zb_h1", 8, 32)
    assert bubble_fraction("zb_h2", 8, 32) == 0.0
    assert bubble_fraction("zb_v", 8, 16) == 0.0  # m >= 2p
    assert 0 < bubble_fraction("zb_v", 8, 8) < bubble_fraction("zb_h1", 8, 8)
    # Qi et al. Table 2 with unequal passes: bubble (p-1)(F+B-W) over m(F+B+W)
    assert bubble_fraction("zb_h1", 4, 8, t_f=1.0, t_b=1.5, t_w=0.5) == pytest.approx(
        3 * 2.0 / (8 * 3.0)
    )
    assert bubble_fraction("1f1b", 1, 4) == 0.0
    with pytest.raises(ValueError, match="one chunk"):
        bubble_fraction("1f1b", 4, 8, v=2)


def test_microbatches_in_flight() -> None:
    from autopar.cost_models.pipeline import in_flight

    p, m = 8, 32
    assert [in_flight("1f1b", p, m, s) for s in range(p)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert in_flight("1f1b", p, 4, 0) == 4  # fewer microbatches than stages
    assert all(in_flight("gpipe", p, m, s) == m for s in range(p))
    # interleaved: the first stage holds p (1 + (p-1)/(p v)) microbatch-stages
    for v in (2, 4):
        assert in_flight("interleaved", p, m, 0, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert in_flight("interleaved", p, m, 0, 1) == in_flight("1f1b", p, m, 0)
    # zero-bubble H1 peaks like 1F1B on the first stage; without W memory, like 1F1B everywhere
    assert in_flight("zb_h1", p, m, 0) == in_flight("1f1b", p, m, 0)
    assert [in_flight("zb_h1", p, m, s, w_ratio=0.0) for s in range(p)] == [
        in_flight("1f1b", p, m, s) for s in range(p)
    ]
    assert in_flight("zb_h2", p, m, 0) == 2 * p - 1


def test_step_time_composition() -> None:
    from autopar.cost_models.pipeline import step_time

    fwd, bwd = [1.0, 1.0, 1.5, 1.0], [2.0, 2.0, 3.0, 2.0]
    s = step_time(fwd, bwd, m=8, schedule="1f1b", p2p_s=0.01, dp_comm_s=5.0)
    t = 4.5  # the slowest stage's forward + backward
    assert s.compute == pytest.approx(8 * t)
    assert s.bubble == pytest.approx(3 * t)  # (m + p - 1) t in all
    assert s.p2p == pytest.approx((8 + 3) * 2 * 0.01)
    assert s.dp_exposed == pytest.approx(5.0 - 3.0)  # hidden behind the last backward
    assert s.total == pytest.approx(s.compute + s.bubble + s.p2p + s.dp_exposed)
    inter = step_time(fwd, bwd, m=8, schedule="interleaved", v=2, p2p_s=0.01)
    assert inter.bubble == pytest.approx(1.5 * t)
    assert step_time(2.0, 4.0, m=4, p=1).total == pytest.approx(24.0)


def test_attention_runs_at_the_cluster_files_attention_efficiency() -> None:
    """A cluster file's ``device.attention_efficiency`` (the kernel a run uses) sets fused
    attention's time: twice the share, half the time of a compute-bound attention; the A100
    preset's FlashAttention-2 share is twice the H100's (modelled)."""
    from autopar.cli.load import trace_model
    from autopar.solver.search.pinned import PinnedConfig, estimate_graph

    traced = trace_model("llama:layers=1,hidden=1024,heads=8,kv_heads=2,ffn=2048,vocab=256,"
                         "seq=8192", 1, None)

    def attention_seconds(efficiency: float) -> float:
        cluster = load_cluster({"nodes": 1, "devices_per_node": 1, "device": {
            "preset": "H100-80GB", "attention_efficiency": efficiency}})
        est = estimate_graph(traced.gm, cluster, PinnedConfig(
            dp=1, global_batch=1, precision="bf16", recompute="none"))
        (d,) = [d for d in est.problem.decisions if "scaled_dot_product" in d.facts.target]
        forward, backward, _ = est.tables.times(d, d.candidates[0])
        return forward + backward

    assert attention_seconds(0.6) == pytest.approx(attention_seconds(0.3) / 2, rel=0.02)
    a100, h100 = load_cluster("A100-80GB").device, load_cluster("H100-80GB").device
    assert a100.attention_efficiency == 2 * h100.attention_efficiency


def test_fused_attention_is_not_charged_a_short_k_loop_for_its_head_dim() -> None:
    """A fused attention kernel's query tile sweeps every key once its pipeline is full, so
    its efficiency does not fall with a short head dim the way a GEMM's falls with a short
    ``k`` (measured on an H100: ``benchmarks/results/h100_2026-11-26_layers.md``); the same
    FLOPs at head dim 64 and 128 cost the same, while a plain matmul of that ``k`` is slower
    (modelled)."""
    from autopar.cost_models.compute import attention_time, op_time

    dev = load_cluster("H100-80GB").device
    flops = 4 * 32 * 8192 * 8192 * 128
    for head_dim in (64, 128):
        shape = (32 * 8192 * 128 // head_dim, 8192, head_dim)
        fused = attention_time(flops, 0, dev, "bf16", shape=shape)
        gemm = op_time(flops, 0, dev, "bf16", shape=shape,
                       efficiency_scale=dev.attention_efficiency)
        assert fused == pytest.approx(op_time(flops, 0, dev, "bf16", shape=(262144, 8192, 8192),
                                              efficiency_scale=dev.attention_efficiency),
                                      rel=0.02)
        assert gemm > 1.2 * fused
    # the values matmul of eager attention contracts over the keys: the same depth
    assert attention_time(flops, 0, dev, "bf16", shape=(262144, 128, 8192)) == attention_time(
        flops, 0, dev, "bf16", shape=(262144, 8192, 128))


def test_communication_hidden_behind_compute_still_slows_it() -> None:
    """Overlap is not free (Lee et al. 2025: compute beside a collective runs 18.9% slower):
    the hidden part of FSDP's and DDP's collectives adds OVERLAP_SLOWDOWN of its time; what
    is exposed is paid once, and gloo (nothing overlaps) pays exactly its communication."""
    from autopar.cost_models.data_parallel import (
        OVERLAP_SLOWDOWN,
        Unit,
        bucketed_step,
        fsdp_step,
        with_contention,
    )

    units = [Unit(gather_s=1.0, reduce_s=1.0, forward_s=2.0, backward_s=4.0)] * 3
    free = fsdp_step(units, contention=0.0)
    taxed = fsdp_step(units)
    assert taxed.comm_s == free.comm_s == 9.0
    assert taxed.exposed_s == pytest.approx(free.exposed_s + OVERLAP_SLOWDOWN * (9.0 - 3.0))
    assert fsdp_step(units, overlap=False).exposed_s == 9.0
    ddp = bucketed_step([1.0, 1.0], 4.0)
    assert ddp.exposed_s == pytest.approx(1.0 + OVERLAP_SLOWDOWN * 1.0)
    assert bucketed_step([1.0, 1.0], 4.0, overlap=False).exposed_s == 2.0
    with pytest.raises(ValueError, match="contention"):
        with_contention(1.0, 0.0, 1.0)


def test_fsdp_copies_are_priced_as_the_bytes_they_stream() -> None:
    """FSDP2 copies every gathered unit out of its flat buffer (read + write the unsharded
    weights) and every gradient into the reduce buffer in the reduce dtype (read 16-bit,
    write fp32): memory-bound work on the device, none for a unit without weights."""
    from autopar.cost_models.compute import kernel_floor, memory_efficiency
    from autopar.cost_models.data_parallel import fsdp_copies_s

    dev = load_cluster("H100-80GB").device
    rate = dev.memory_bandwidth_bytes_per_s * memory_efficiency(dev)
    out, into = fsdp_copies_s(2e9, 4e9, dev)  # 1e9 bf16 weights, their fp32 gradients
    assert out == pytest.approx(4e9 / rate + kernel_floor(dev))
    assert into == pytest.approx(6e9 / rate + kernel_floor(dev))
    assert fsdp_copies_s(0.0, 0.0, dev) == (0.0, 0.0)


@pytest.mark.parametrize("zero, microbatches, calls", [
    (1, 1, 5 + 5), (1, 2, 5 + 5),        # gathered once, reduced once per step
    (2, 1, 5 + 5), (2, 2, 5 + 2 * 5),    # reduced every microbatch
    (3, 1, 9 + 5), (3, 2, 2 * (9 + 5)),  # blocks gathered again in backward
])
def test_zero_stages_are_priced_as_the_fsdp2_calls_the_runtime_makes(
        zero: int, microbatches: int, calls: int) -> None:
    """ZeRO 1-3 run on FSDP2, one all-gather and one reduce-scatter per unit (the demo GPT:
    its 4 blocks and the root, as a recorded run shows), so a step pays one collective latency
    per unit and call, not one per 25 MiB gradient bucket. On links where only the latency
    costs (10 ms, 1 TB/s), the predicted data-parallel time counts the calls."""
    import autopar
    from autopar.cli.demo_data import demo_batches, demo_model

    link = {"bandwidth_gb_per_s": 1000.0, "latency_us": 10_000}
    cluster = {"name": "latency-only", "nodes": 1, "devices_per_node": 2,
               "device": {"preset": "A100-80GB"}, "intra_node_link": link,
               "inter_node_link": link}
    plan = autopar.plan(demo_model(), cluster, demo_batches(1)[0], dp=2, tp=1, pp=1,
                        zero=zero, microbatches=microbatches, recompute="none")
    assert plan.predicted["dp_comm_s"] / 10e-3 == pytest.approx(calls, abs=0.1)


def test_a_dropout_that_returns_its_input_costs_no_time(monkeypatch) -> None:
    """ATen returns the input itself from a dropout with p == 0 (nanoGPT's default and most
    Llama configurations): no kernel forward or backward, so no step time. p > 0 pays."""
    import torch

    import autopar
    from autopar.cli.demo_data import demo_batches
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.solver.pricing.costs import identity_dropout
    from autopar.trace import trace

    batch = demo_batches(1)[0]
    pins = dict(dp=1, tp=1, pp=1, zero=0, microbatches=1, recompute="none")

    def compute_s(dropout: float) -> float:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64,
                              dropout=dropout))
        return autopar.plan(model, "1xcpu", batch, **pins).predicted["compute_s"]

    free, paid = compute_s(0.0), compute_s(0.1)
    assert free < paid
    from autopar.solver.pricing import costs

    monkeypatch.setattr(costs, "identity_dropout", lambda node: False)
    assert compute_s(0.0) > free  # priced as a kernel, it would cost time
    monkeypatch.undo()
    torch.manual_seed(0)
    gm = trace(GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)),
               batch)
    dropouts = [n for n in gm.graph.nodes if "dropout" in str(n.target)]
    assert dropouts and all(identity_dropout(n) for n in dropouts)
