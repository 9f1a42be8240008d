"""Calibration: profiles (format, precedence, errors), the link fit, and real measurements."""

from __future__ import annotations

import json
import random

import pytest

from autopar.calibrate import (
    CalibrationError,
    CollectivePoint,
    calibrate_device,
    fit_link,
    make_profile,
    ring_factors,
)
from autopar.cli.main import main
from autopar.cluster import format_cluster, load_cluster
from autopar.cluster.profile import Profile, read_profile, write_profile
from autopar.errors import ClusterError

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
    assert f"where: {prof}: {where}" in text


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


def test_quick_matmul_calibration_is_sane_and_reproduces_itself(tmp_path):
    device = calibrate_device("cpu", quick=True, threads=1)
    peak = device.peak_flops["fp32"]
    assert 1e9 < peak < 1e13
    curve = device.matmul_efficiency_curve
    flops = [f for f, _ in curve]
    effs = [e for _, e in curve]
    assert flops == sorted(set(flops)) and len(curve) >= 6
    assert all(0 < e <= 1 for e in effs)
    # the largest matmul is not slower per FLOP than the smallest (timing noise on a busy
    # machine allowed: both are often near the peak on a CPU)
    assert effs[-1] > 0.9 * effs[0] and max(effs) == pytest.approx(1.0, abs=0.05)
    # monotone-ish: no size is much slower per FLOP than a smaller one
    assert all(later > 0.4 * max(effs[:i]) for i, later in enumerate(effs) if i)
    # the convention: flops / (peak * efficiency) + floor gives back each measured time
    floor = device.kernel_floor_s
    in_curve = [p for p in device.matmuls if p.in_curve(floor)]
    assert not any(p.skinny for p in in_curve) and any(p.skinny for p in device.matmuls)
    for point in in_curve:
        if sum(p.flops == point.flops for p in in_curve) == 1:
            eff = dict(curve)[float(point.flops)]
            assert point.flops / (peak * eff) + floor == pytest.approx(point.seconds, rel=1e-9)
    bandwidth = device.memory_bandwidth_bytes_per_s
    middle = sorted(device.bandwidth, key=lambda b: b.rate(floor))[len(device.bandwidth) // 2]
    assert middle.bytes_moved / bandwidth + floor == pytest.approx(middle.seconds, rel=1e-9)
    assert 1e8 < device.memory_bandwidth_bytes_per_s < 1e12
    assert 1e-8 < device.kernel_floor_s < 1e-3
    # the profile it makes loads into a cluster
    points = [CollectivePoint("all_reduce", b, 2, 1e-4 + b / 1e9) for b in (2**10, 2**20)]
    host = {"hostname": "test", "threads_per_process": 1}
    prof = write_profile(make_profile(device, points, host), tmp_path / "p.json")
    c = load_cluster({"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": str(prof)})
    assert c.device.peak("fp32") == peak and c.device.matmul_efficiency_curve == curve
    assert c.intra_node.latency_s == pytest.approx(5e-5, rel=1e-6)  # 2 ring steps share 1e-4


def test_calibrate_cli_rejects_bad_arguments_before_measuring(tmp_path, capsys):
    assert main(["calibrate", "--nproc", "1", "--out", str(tmp_path / "p.json")]) == 2
    assert "at least 2 processes" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "profiles" / "cpu.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "matmul fp32 (measured" in text and "intra-node link (fitted" in text
    assert f"wrote {out}" in text
    profile = read_profile(out)
    assert profile.host["backend"] == "gloo" and profile.host["threads_per_process"] == 1
    kinds = {p["kind"] for p in profile.measurements["collectives"]["points"]}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("nodes: 1\ndevices_per_node: 2\ndevice: cpu\nprofile: profiles/cpu.json\n")
    c = load_cluster(cluster)
    link = profile.intra_node_link
    assert c.intra_node.bandwidth_bytes_per_s == link["bandwidth_bytes_per_s"]
    assert c.device.peak("fp32") == profile.device["peak_flops"]["fp32"]
    assert c.sources["intra_node.latency_s"] == f"profile {tmp_path / 'profiles' / 'cpu.json'}"
    assert "profile " in format_cluster(c)
