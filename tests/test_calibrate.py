"""Calibration: profiles (format, precedence, errors), the link fit, and real measurements."""

from __future__ import annotations

import json
import random

import pytest

from autopar.calibrate import (
    CalibrationError,
    CollectivePoint,
    DeviceCalibration,
    calibrate_device,
    fit_link,
    make_profile,
    ring_factors,
)
from autopar.calibrate.attention import AttentionPoint
from autopar.calibrate.device_fit import BandwidthPoint, MatmulPoint
from autopar.cli.main import main
from autopar.core.cluster import DeviceSpec, format_cluster, load_cluster
from autopar.core.cluster.profile import Profile, read_profile, write_profile
from autopar.core.errors import ClusterError
from autopar.cost_models.compute import attention_efficiency, causal_fraction, op_time

PROFILE = {
    "format": "autopar-profile",
    "version": 1,
    "created": "2026-11-22T06:00:00+00:00",
    "host": {"hostname": "test", "cpu_count": 2, "backend": "gloo", "threads_per_process": 1},
    "device": {
        "peak_flops": {"fp32": 1.5e11},
        "matmul_efficiency": 0.9,
        "matmul_efficiency_curve": [[1.0e3, 0.1], [1.0e6, 0.6], [1.0e9, 0.9]],
        "memory_bandwidth_bytes_per_s": 2.0e10,
        "memory_efficiency": 1.0,
        "kernel_floor_s": 1.0e-6,
    },
    "intra_node_link": {"bandwidth_bytes_per_s": 1.5e9, "latency_s": 1.2e-4},
    "measurements": {"note": "synthetic"},
}

CLUSTER_YAML = """\
nodes: 1
devices_per_node: 2
profile: prof.json
device: {preset: cpu, kernel_floor_us: 3}
intra_node_link: {latency_us: 7}
"""


def write_json(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def error_of(spec) -> str:
    with pytest.raises(ClusterError) as info:
        load_cluster(spec)
    return str(info.value)


def test_profile_round_trip(tmp_path):
    profile = Profile.from_dict(PROFILE, origin="p.json")
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    assert profile.to_dict() == PROFILE
    path = write_profile(profile, tmp_path / "sub" / "p.json")
    again = read_profile(path)
    assert again == profile and hash(again) == hash(profile)
    assert again.device["matmul_efficiency_curve"][1] == (1.0e6, 0.6)


def test_file_beats_profile_beats_preset(tmp_path):
    prof = write_json(tmp_path / "prof.json", PROFILE)
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER_YAML)
    c = load_cluster(path)
    d, preset = c.device, load_cluster("cpu").device
    # the file's own values
    assert d.kernel_floor_s == pytest.approx(3e-6)
    assert c.intra_node.latency_s == pytest.approx(7e-6)
    assert c.sources["device.kernel_floor_s"] == f"file {path}"
    # the profile's, over the preset's
    assert d.peak("fp32") == 1.5e11 and d.memory_bandwidth_bytes_per_s == 2.0e10
    assert d.matmul_efficiency_curve == ((1e3, 0.1), (1e6, 0.6), (1e9, 0.9))
    assert (d.matmul_efficiency, d.memory_efficiency) == (0.9, 1.0)
    assert c.intra_node.bandwidth_bytes_per_s == 1.5e9
    for key in (
        "device.peak_flops.fp32",
        "device.matmul_efficiency_curve",
        "device.memory_bandwidth_bytes_per_s",
        "intra_node.bandwidth_bytes_per_s",
    ):
        assert c.sources[key] == f"profile {prof}"
    # the preset's, where neither says anything
    assert d.peak("bf16") == preset.peak("bf16") and d.memory_bytes == preset.memory_bytes
    assert c.inter_node == load_cluster("cpu").inter_node
    assert c.sources["device.memory_bytes"] == "preset cpu"
    text = format_cluster(c)
    assert f"profile {prof}" in text and "3 points, 1e3-1e9 FLOP, efficiency 0.1-0.9" in text
    # the resolved cluster round-trips without the profile file
    (tmp_path / "prof.json").unlink()
    assert load_cluster(json.loads(json.dumps(c.to_dict()))) == c


def test_profile_in_a_dict_is_relative_to_cwd(tmp_path, monkeypatch):
    write_json(tmp_path / "prof.json", PROFILE)
    monkeypatch.chdir(tmp_path)
    c = load_cluster({"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": "prof.json"})
    assert c.device.peak("fp32") == 1.5e11
    assert c.sources["intra_node.latency_s"] == "profile prof.json"


def test_partial_profile_overrides_only_what_it_has(tmp_path):
    data = {"format": "autopar-profile", "version": 1, "device": {"kernel_floor_s": 4e-6}}
    prof = write_json(tmp_path / "p.json", data)
    c = load_cluster({"nodes": 1, "devices_per_node": 8, "device": "H100-80GB", "profile": prof})
    assert c.device.kernel_floor_s == 4e-6
    assert c.device.memory_efficiency == load_cluster("H100-80GB").device.memory_efficiency
    assert c.intra_node == load_cluster("H100-80GB").intra_node


@pytest.mark.parametrize(
    "patch, says, where",
    [
        ({"format": "other"}, "is not an autopar profile", "format"),
        ({"version": 2}, "has version 2; this autopar reads version 1", "version"),
        ({"extra": 1}, "unknown key 'extra'", "extra"),
        ({"device": {"kernel_floor_us": 1}}, "unknown key 'kernel_floor_us' in device", "device"),
        ({"device": {"peak_flops": {"int8": 1.0}}}, "unknown key 'int8'", "device.peak_flops"),
        ({"device": {"memory_efficiency": 1.5}}, "must be a number in (0, 1]", "device"),
        (
            {"device": {"matmul_efficiency_curve": [[1e6, 0.5], [1e3, 0.9]]}},
            "FLOPs must rise",
            "device.matmul_efficiency_curve[1]",
        ),
        ({"intra_node_link": {"latency_s": -1}}, "latency_s must be a number >= 0", "intra"),
        ({"host": {"gpu": "x"}}, "unknown key 'gpu' in host", "host.gpu"),
    ],
)
def test_bad_profile_names_file_and_field(tmp_path, patch, says, where):
    prof = write_json(tmp_path / "bad.json", {**PROFILE, **patch})
    text = error_of({"nodes": 1, "devices_per_node": 1, "device": "cpu", "profile": prof})
    assert says in text
    assert f"where: profile ({prof}: {where}" in text


def test_missing_unreadable_and_non_profile_files(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes: 1\ndevices_per_node: 1\ndevice: cpu\nprofile: nope.json\n")
    text = error_of(cluster)
    assert f"profile '{tmp_path / 'nope.json'}' not found" in text
    assert "autopar calibrate --out PROFILE" in text
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not valid JSON" in error_of({"nodes": 1, "device": "cpu", "profile": str(bad)})
    bad.write_text("[1, 2]")
    assert "must be a JSON object" in error_of({"nodes": 1, "device": "cpu", "profile": str(bad)})
    text = error_of({"nodes": 1, "devices_per_node": 1, "device": "cpu", "profile": 3})
    assert "profile must be a path" in text and "where: profile" in text


def synthetic(alpha: float, busbw: float, n: int, noise: float = 0.0) -> list[CollectivePoint]:
    rng = random.Random(0)
    points = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for nbytes in (2**10 * 4**i for i in range(9)):
            steps, frac = ring_factors(kind, n)
            seconds = steps * alpha + frac * nbytes / busbw
            points.append(CollectivePoint(kind, nbytes, n, seconds * (1 + rng.gauss(0, noise))))
    return points


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_latency_and_bandwidth(n):
    fit = fit_link(synthetic(alpha=30e-6, busbw=2.5e9, n=n))
    assert fit.latency_s == pytest.approx(30e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2.5e9, rel=1e-6)
    assert fit.max_error < 1e-6
    noisy = fit_link(synthetic(alpha=30e-6, busbw=2.5e9, n=n, noise=0.05))
    assert noisy.latency_s == pytest.approx(30e-6, rel=0.1)
    assert noisy.bandwidth_bytes_per_s == pytest.approx(2.5e9, rel=0.1)
    assert noisy.median_error < 0.1


def test_fit_clamps_negative_latency_and_rejects_flat_data():
    points = [CollectivePoint("all_reduce", b, 2, b / 1e9 - 1e-6) for b in (2**20, 2**24)]
    fit = fit_link(points)
    assert fit.latency_s == 0.0 and fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.01)
    with pytest.raises(CalibrationError, match="two message sizes"):
        fit_link([CollectivePoint("all_reduce", 1024, 2, 1e-4)])
    flat = [CollectivePoint("all_reduce", b, 2, 1e-4 * (2 - i)) for i, b in enumerate((1, 2**24))]
    with pytest.raises(CalibrationError, match="do not grow with message size"):
        fit_link(flat)


def recorded_device(floor: float = 2e-6, attention: float | None = None,
                    overlap: float = 1.0) -> DeviceCalibration:
    """A calibration from recorded times that a known device would produce: peak 1e11 FLOP/s,
    efficiency rising with size, 20 GB/s elementwise, ``overlap`` of a matmul's traffic
    hidden under its arithmetic; one size timed twice, one call shorter than twice the floor,
    a skinny shape and a bf16 sweep beside the fp32 curve. With ``attention``, causal SDPA at
    two lengths running at that share of the matmul rate."""
    peak, bandwidth = 1e11, 2e10
    eff = {2 * 32**3: 0.2, 2 * 64**3: 0.5, 2 * 128**3: 0.8, 2 * 256**3: 1.0,
           2 * 4 * 64**3: 0.7}

    def matmul(m, k, n, dtype="fp32", skinny=False, e=None, scale=1.0):
        flops = 2 * m * k * n
        e = e if e is not None else eff[flops]
        compute = scale * flops / (peak * e)
        memory = (4 if dtype == "fp32" else 2) * (m * k + k * n + m * n) / bandwidth
        busy = max(compute, memory) + (1 - overlap) * min(compute, memory)
        return MatmulPoint(m, k, n, dtype, busy + floor, skinny)

    points = [matmul(n, n, n) for n in (32, 64, 128, 256)]
    points += [matmul(256, 64, 64, e=0.6), matmul(256, 64, 64, e=0.8)]  # same FLOPs twice
    points += [MatmulPoint(4, 4, 4, "fp32", 1.5 * floor)]  # dominated by the floor
    # as many FLOPs as the 256-cube, but its traffic outlasts its arithmetic
    points += [matmul(8, 1024, 2048, skinny=True, e=1.0)]
    points += [matmul(n, n, n, "bf16", scale=0.25) for n in (128, 256)]
    adds = [BandwidthPoint(b, 3 * b / 2e10 + floor) for b in (2**16, 2**20, 2**24)]
    adds.append(BandwidthPoint(2**26, 3 * 2**26 / 1e10 + floor))  # one slow size
    adds.append(BandwidthPoint(2**12, 3 * 2**12 / 4e10 + floor))  # one cache-sized size
    sdpa = ()
    if attention is not None:  # 4 b h s² d FLOPs forward, 2.5x that backward, as counted
        sdpa = tuple(sdpa_point(seq, peak * eff[2 * 256**3] * attention, floor)
                     for seq in (256, 1024))  # at the largest size's efficiency: curve's end
    return DeviceCalibration("cpu", 1, "fp32", tuple(points), tuple(adds), floor,
                             attention=sdpa)


def sdpa_point(seq: int, rate: float, floor: float, heads: int = 4, dim: int = 64,
               forward_share: float = 0.3) -> AttentionPoint:
    """A causal SDPA point whose run FLOPs took ``rate`` FLOP/s, split unevenly between the
    passes (only their sum is fitted)."""
    forward, backward = 4 * heads * seq**2 * dim, 10 * heads * seq**2 * dim
    busy = (forward + backward) * causal_fraction(seq) / rate
    fwd_s = forward_share * busy + floor
    return AttentionPoint(1, heads, seq, dim, "fp32", fwd_s, busy + 2 * floor, forward, backward)


@pytest.fixture(scope="module")
def quick_device() -> DeviceCalibration:
    """One real quick calibration, shared by the tests that check its structure."""
    return calibrate_device("cpu", quick=True, threads=1)


def test_calibration_arithmetic_on_recorded_times():
    device = recorded_device()
    floor = device.kernel_floor_s
    assert device.peak_flops["fp32"] == pytest.approx(1e11, rel=1e-9)
    assert device.peak_flops["bf16"] == pytest.approx(4e11, rel=1e-9)
    curve = dict(device.matmul_efficiency_curve)
    assert list(curve) == sorted(curve) and len(curve) == 5  # skinny and sub-floor left out
    assert curve[2.0 * 32**3] == pytest.approx(0.2) and curve[2.0 * 256**3] == pytest.approx(1.0)
    # two timings of one FLOP count are averaged by rate
    assert curve[2.0 * 4 * 64**3] == pytest.approx((0.6 + 0.8) / 2)
    assert device.profile_device()["matmul_efficiency"] == curve[2.0 * 256**3]
    # the convention: flops / (peak * efficiency) + floor gives back each measured time
    for p in device.matmuls:
        if p.in_curve(floor) and p.dtype == "fp32" and p.m != 256:
            assert p.flops / (1e11 * curve[float(p.flops)]) + floor == pytest.approx(p.seconds)
    # the skinny point: its 2.1 M elements at 20 GB/s outlast its arithmetic, all of which
    # they hide (overlap 1: the roofline)
    # (335.5 µs of arithmetic, 424.3 µs of traffic)
    assert device.efficiency(device.matmuls[-3]) == pytest.approx(335.54432 / 424.3456)
    assert device.memory_overlap == 1.0 and device.profile_device()["memory_overlap"] == 1.0
    # bandwidth is the median over sizes, net of the floor: neither outlier moves it
    assert device.memory_bandwidth_bytes_per_s == pytest.approx(2e10, rel=1e-9)
    with pytest.raises(ValueError, match="twice the kernel floor"):
        DeviceCalibration("cpu", 1, "fp32", (MatmulPoint(4, 4, 4, "fp32", 1.5 * floor),),
                          device.bandwidth, floor)
    # without attention points the profile says nothing of it: the preset's figure stays
    assert device.attention_efficiency is None
    assert "attention_efficiency" not in device.profile_device()


def test_memory_overlap_is_fitted_from_skinny_matmuls():
    """A core that moves a matmul's operands and then computes (overlap 0.3 here): the fit
    finds it, and the curve, net of the traffic left apart, gives back every measured time
    through the cost model itself."""
    device = recorded_device(overlap=0.3)
    assert device.memory_overlap == pytest.approx(0.3, abs=1e-9)
    spec = DeviceSpec("cpu", 2**30, dict(device.peak_flops), device.memory_bandwidth_bytes_per_s,
                      1.0, kernel_floor_s=device.kernel_floor_s, memory_efficiency=1.0,
                      matmul_efficiency_curve=device.matmul_efficiency_curve,
                      memory_overlap=device.memory_overlap)
    for p in device.matmuls:
        if p.dtype == "fp32" and (p.in_curve(device.kernel_floor_s) or p.skinny) and p.m != 256:
            assert op_time(p.flops, p.bytes_moved, spec, "fp32") == pytest.approx(p.seconds)
    # on a GPU the roofline stands (its launch latency would pass for traffic left apart)
    gpu = DeviceCalibration("cuda", 1, "fp32", device.matmuls, device.bandwidth,
                            device.kernel_floor_s)
    assert gpu.memory_overlap == 1.0


def test_attention_efficiency_inverts_the_cost_model_on_recorded_times(tmp_path):
    device = recorded_device(attention=0.4)
    assert device.attention_efficiency == pytest.approx(0.4, rel=1e-9)
    assert device.profile_device()["attention_efficiency"] == device.attention_efficiency
    rows = device.measurements()["attention"]
    assert [r["seq"] for r in rows] == [256, 1024] and rows[1]["causal_fraction"] == 0.5625
    # each pass alone is recorded too: the forward took more than its FLOPs' share here
    assert all(r["forward_efficiency"] < 0.4 < r["backward_efficiency"] for r in rows)
    # the profile loads, and the cost model gives back the recorded times
    points = [CollectivePoint("all_reduce", b, 2, 1e-4 + b / 1e9) for b in (2**10, 2**20)]
    prof = write_profile(make_profile(device, points, {"hostname": "test"}), tmp_path / "p.json")
    c = load_cluster({"nodes": 1, "devices_per_node": 1, "device": "cpu", "profile": str(prof)})
    assert c.device.attention_efficiency == pytest.approx(0.4, rel=1e-9)
    for p in device.attention:
        assert predicted_sdpa_seconds(c.device, p) == pytest.approx(p.forward_backward_s)
    # faster than the matmul rate (or within the floors) is clamped to 1
    fast = recorded_device(attention=1.5)
    assert fast.attention_efficiency == 1.0


def predicted_sdpa_seconds(dev, p: AttentionPoint) -> float:
    """The cost model's forward plus backward of a causal SDPA node of ``p``'s shape, as
    ``solver/pricing/costs.py`` prices it: the FLOPs the causal kernel runs, the score matmul's shape
    for the efficiency, fused attention's efficiency scale, the backward moving 2x bytes."""
    work = causal_fraction(p.seq)
    shape = (p.batch * p.heads * p.seq, p.seq, p.head_dim)
    moved = 4 * p.batch * p.heads * p.seq * p.head_dim * 4  # q, k, v read, out written (fp32)
    scale = attention_efficiency(dev)
    return (op_time(p.forward_flops * work, moved, dev, p.dtype, shape=shape,
                    efficiency_scale=scale)
            + op_time(p.backward_flops * work, 2 * moved, dev, p.dtype, shape=shape,
                      efficiency_scale=scale))


def test_recorded_calibration_makes_a_profile_that_loads(tmp_path):
    device = recorded_device()
    points = [CollectivePoint("all_reduce", b, 2, 1e-4 + b / 1e9) for b in (2**10, 2**20)]
    host = {"hostname": "test", "threads_per_process": 1}
    prof = write_profile(make_profile(device, points, host), tmp_path / "p.json")
    c = load_cluster({"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": str(prof)})
    assert c.device.peak("fp32") == device.peak_flops["fp32"]
    assert c.device.matmul_efficiency_curve == device.matmul_efficiency_curve
    assert c.intra_node.latency_s == pytest.approx(5e-5, rel=1e-6)  # 2 ring steps share 1e-4


def test_quick_calibration_runs_and_keeps_its_convention(quick_device):
    """A real measurement: only its structure is checked (timings depend on the machine and
    its load; what they are is for ``autopar calibrate`` to print, not for a test to bound)."""
    device = quick_device
    floor = device.kernel_floor_s
    assert floor > 0 and all(v > 0 for v in device.peak_flops.values())
    assert set(device.peak_flops) <= {"fp32", "bf16", "fp16"} and "fp32" in device.peak_flops
    assert {p.dtype for p in device.matmuls} == {"fp32", "bf16", "fp16"}
    assert any(p.skinny for p in device.matmuls)
    assert not any(p.skinny for p in device.matmuls if p.in_curve(floor))
    flops = [f for f, _ in device.matmul_efficiency_curve]
    assert flops == sorted(set(flops))
    assert all(0 < e <= 1 for _, e in device.matmul_efficiency_curve)
    assert device.memory_bandwidth_bytes_per_s > 0


def test_quick_calibration_measures_attention_the_cost_model_reproduces(quick_device, tmp_path):
    """The measured SDPA times, fed back through the profile and the cost model, come back:
    the inversion is checked, not how fast this machine is."""
    device = quick_device
    assert device.attention and {p.dtype for p in device.attention} == {device.curve_dtype}
    for p in device.attention:
        assert p.forward_flops > 0 and p.backward_flops > p.forward_flops  # counted, full square
        assert p.forward_s > 0 and p.forward_backward_s > 0
    points = [CollectivePoint("all_reduce", b, 2, 1e-4 + b / 1e9) for b in (2**10, 2**20)]
    prof = write_profile(make_profile(device, points, {"hostname": "test"}), tmp_path / "p.json")
    measured = read_profile(prof).device["attention_efficiency"]
    assert 0 < measured <= 1
    assert [r["forward_backward_seconds"] for r in read_profile(prof).measurements["attention"]] \
        == [p.forward_backward_s for p in device.attention]
    c = load_cluster({"nodes": 1, "devices_per_node": 1, "device": "cpu", "profile": str(prof)})
    assert c.device.attention_efficiency == measured and c.device.compute_share == 1.0
    predicted = sum(predicted_sdpa_seconds(c.device, p) for p in device.attention)
    actual = sum(p.forward_backward_s for p in device.attention)
    if measured < 1:  # exact up to the memory term, which these compute-bound shapes never hit
        assert predicted == pytest.approx(actual, rel=0.02)
    else:  # clamped: the kernel beat the matmul rate, the model can only be slower
        assert predicted >= actual


def test_calibrate_cli_rejects_bad_arguments_before_measuring(tmp_path, capsys):
    assert main(["calibrate", "--nproc", "1", "--out", str(tmp_path / "p.json")]) == 2
    assert "at least 2 processes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # an argparse error, before measuring
        main(["calibrate", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_calibrate_writes_the_link_with_one_process_per_core(tmp_path) -> None:
    def points(n: int, latency: float) -> list[CollectivePoint]:
        return [CollectivePoint("all_reduce", b, n, latency + b / 1e9) for b in (2**10, 2**20)]

    busy = {"busy_latency_s": 1e-3}
    prof = make_profile(recorded_device(), points(4, 4e-4), {"nproc": 4}, busy,
                        (points(2, 1e-4), {"busy_latency_s": 5e-4}))
    path = write_profile(prof, tmp_path / "p.json")
    c = load_cluster({"nodes": 1, "devices_per_node": 4, "cores_per_node": 2, "device": "cpu",
                      "profile": str(path)})
    assert c.intra_node_uncontended is not None
    # the ring fits of the synthetic points (not timings): 1e-4 s over a 2-rank ring's 2
    # steps, 4e-4 s over a 4-rank ring's 6
    assert c.intra_node_uncontended.latency_s == pytest.approx(1e-4 / 2, rel=1e-6)
    assert c.intra_node.latency_s == pytest.approx(4e-4 / 6, rel=1e-6)
    assert c.intra_node_uncontended.busy_latency_s == pytest.approx(5e-4)
    assert "profile" in c.sources["intra_node_uncontended.latency_s"]


def test_gpu_matmul_times_are_not_net_of_the_launch_floor():
    """A GPU launches the next kernel while one runs: back-to-back calls take max(launch,
    work), so a rate net of the floor would exceed the hardware (measured on an H100:
    2048³ bf16 in 24.3 µs against an 11.5 µs floor read 1,341 TFLOP/s)."""
    floor = 11.5e-6
    points = (MatmulPoint(2048, 2048, 2048, "bf16", 24.3e-6),
              MatmulPoint(4096, 4096, 4096, "bf16", 183.7e-6))
    adds = (BandwidthPoint(2**26, 3 * 2**26 / 2.7e12),)
    gpu = DeviceCalibration("cuda", 1, "bf16", points, adds, floor)
    assert gpu.peak_flops["bf16"] == pytest.approx(2 * 4096**3 / 183.7e-6)  # 748 TFLOP/s
    assert gpu.peak_flops["bf16"] < 989e12  # the datasheet's dense bf16
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(2.7e12)
    # the same times on a CPU, where dispatch and work add up, are taken net of the floor
    cpu = DeviceCalibration("cpu", 1, "bf16", points, adds, floor)
    assert cpu.peak_flops["bf16"] == pytest.approx(2 * 2048**3 / (24.3e-6 - floor))


def test_device_rounds_average_each_measured_time():
    """A CPU switches between a fast and a slow state within seconds: rounds of the device
    measured at different moments are averaged point by point (the expected time), and
    rounds that measured different points are refused, naming why."""
    from autopar.calibrate.rounds import average_rounds

    fast, slow = recorded_device(), recorded_device()
    slow = DeviceCalibration(
        "cpu", 1, slow.curve_dtype,
        tuple(MatmulPoint(p.m, p.k, p.n, p.dtype, 2 * p.seconds, p.skinny) for p in slow.matmuls),
        tuple(BandwidthPoint(p.tensor_bytes, 2 * p.seconds) for p in slow.bandwidth),
        kernel_floor_s=2 * slow.kernel_floor_s)
    mean = average_rounds([fast, slow])
    assert [p.seconds for p in mean.matmuls] == pytest.approx(
        [1.5 * p.seconds for p in fast.matmuls])
    assert mean.kernel_floor_s == pytest.approx(1.5 * fast.kernel_floor_s)
    assert mean.bandwidth[0].seconds == pytest.approx(1.5 * fast.bandwidth[0].seconds)
    fewer = DeviceCalibration("cpu", 1, fast.curve_dtype, fast.matmuls[1:], fast.bandwidth,
                              kernel_floor_s=fast.kernel_floor_s)
    with pytest.raises(CalibrationError, match="different points"):
        average_rounds([fast, fewer])
