"""Cluster descriptions: shorthands, files, round trips, and the text of every bad input."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch

from autopar.core.cluster import Cluster, DeviceSpec, LinkSpec, format_cluster, load_cluster
from autopar.core.cluster.presets import PRESETS
from autopar.core.errors import ClusterError

GIB = 2**30

OVERRIDE_YAML = """\
name: my-cluster
nodes: 16
devices_per_node: 8
device:
  preset: H100-80GB
  memory_gib: 79
  peak_tflops: {bf16: 900}
intra_node_link: {bandwidth_gb_per_s: 400}
"""

FULL_DEVICE = {
    "name": "custom",
    "nodes": 2,
    "devices_per_node": 4,
    "device": {
        "name": "X1",
        "memory_gib": 24,
        "peak_tflops": {"fp32": 10, "bf16": 100},
        "memory_bandwidth_gb_per_s": 1000,
        "matmul_efficiency": 0.5,
    },
    "intra_node_link": {"bandwidth_gb_per_s": 100, "latency_us": 4},
    "inter_node_link": {"bandwidth_gb_per_s": 10, "latency_us": 20},
}


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(spec) -> str:
    with pytest.raises(ClusterError) as info:
        load_cluster(spec)
    return str(info.value)


@pytest.mark.parametrize(
    "spec, nodes, per_node, device",
    [
        ("8xH100-80GB", 1, 8, "H100-80GB"),
        ("16x8xA100-80GB", 16, 8, "A100-80GB"),
        ("H100-80GB", 1, 1, "H100-80GB"),
        ("2xcpu", 1, 2, "cpu"),
        ("4xcpu", 1, 4, "cpu"),
        ("8xmi300x", 1, 8, "MI300X"),
        ("h200", 1, 1, "H200"),
    ],
)
def test_shorthands(spec, nodes, per_node, device):
    c = load_cluster(spec)
    assert (c.nodes, c.devices_per_node, c.world_size) == (nodes, per_node, nodes * per_node)
    assert c.device.name == device
    assert c.sources["nodes"] == f"shorthand {spec}"
    assert c.sources["device.memory_bytes"] == f"preset {device}"


def test_preset_values():
    h100 = load_cluster("8xH100-80GB")
    assert h100.device.memory_bytes == 80 * GIB
    assert h100.device.peak("bf16") == pytest.approx(989.4e12)
    assert h100.device.peak(torch.bfloat16) == h100.device.peak("bf16")
    assert h100.device.peak(torch.float32) == pytest.approx(66.9e12)
    assert h100.intra_node.bandwidth_bytes_per_s == 450e9
    assert h100.inter_node.bandwidth_bytes_per_s == 50e9
    assert h100.backend == "nccl"
    assert "fp8" not in load_cluster("A100-80GB").device.peak_flops
    assert "bf16" not in load_cluster("V100-32GB").device.peak_flops
    cpu = load_cluster("2xcpu")
    assert (cpu.backend, cpu.device.memory_bytes) == ("gloo", 8 * GIB)
    assert cpu.intra_node.latency_s == pytest.approx(440e-6)
    assert cpu.intra_node.busy_latency_s == pytest.approx(1e-3)  # measured: see presets.py
    assert load_cluster("8xH100-80GB").intra_node.busy_latency_s == 0.0
    assert {
        "A100-40GB",
        "A100-80GB",
        "H100-80GB",
        "H200",
        "B200",
        "MI300X",
        "V100-32GB",
        "cpu",
    } <= set(PRESETS)


def test_yaml_override_beats_preset_and_sources_say_so(tmp_path):
    path = write(tmp_path, "c.yaml", OVERRIDE_YAML)
    c = load_cluster(str(path))
    base = load_cluster("H100-80GB")
    assert (c.name, c.nodes, c.devices_per_node) == ("my-cluster", 16, 8)
    assert c.device.memory_bytes == 79 * GIB
    assert c.device.peak("bf16") == 900e12
    assert c.device.peak("fp8") == base.device.peak("fp8")  # dtypes not listed keep the preset's
    assert c.intra_node == LinkSpec(400e9, base.intra_node.latency_s)
    assert c.sources["device.memory_bytes"] == f"file {path}"
    assert c.sources["device.peak_flops.bf16"] == f"file {path}"
    assert c.sources["device.peak_flops.fp8"] == "preset H100-80GB"
    assert c.sources["intra_node.latency_s"] == "preset H100-80GB"
    text = format_cluster(c)
    assert "world size 128" in text
    assert re.search(rf"79 +GiB +file {re.escape(str(path))}", text)
    assert "µs" in text and "TFLOP/s" in text and "GB/s" in text


def test_json_file_without_preset(tmp_path):
    path = write(tmp_path, "c.json", json.dumps(FULL_DEVICE))
    c = load_cluster(path)
    assert c.world_size == 8
    assert c.device == DeviceSpec("X1", 24 * GIB, {"fp32": 10e12, "bf16": 100e12}, 1e12, 0.5)
    assert c.inter_node == LinkSpec(10e9, 20e-6)
    assert c.backend == "nccl" and c.sources["backend"] == "default"


@pytest.mark.parametrize("spec", ["16x8xH100-80GB", "2xcpu", "V100-32GB", FULL_DEVICE])
def test_round_trip(spec):
    c = load_cluster(spec)
    again = load_cluster(json.loads(json.dumps(c.to_dict())))
    assert again == c
    assert again.sources == c.sources
    assert hash(again) == hash(c)
    assert pickle.loads(pickle.dumps(c)) == c


def test_round_trip_of_constructed_cluster():
    link = LinkSpec(1e9, 0.0)
    c = Cluster(1, 2, DeviceSpec("d", GIB, {"fp32": 1e12}, 1e11, 0.9), link, link)
    assert load_cluster(c.to_dict()) == c
    assert load_cluster(c) is c


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "bad.yaml", "nodes: 2\ndevice: {preset: H100-80GB\nx: 1\n")
    text = error_of(path)
    assert "not valid YAML" in text and f"{path}, line 3" in text


def test_malformed_json_names_the_line(tmp_path):
    path = write(tmp_path, "bad.json", '{"nodes": 2,\n "device": }')
    assert f"{path}, line 2" in error_of(path)


def test_unknown_key_suggests_and_lists(tmp_path):
    path = write(tmp_path, "c.yaml", "nodes: 1\ndevices_per_node: 8\ndevice:\n  memroy_gib: 80\n")
    text = error_of(path)
    assert "unknown key 'memroy_gib' in device" in text
    assert f"where: {path}: device.memroy_gib" in text
    assert "did you mean 'memory_gib'?" in text
    assert "preset, name, memory_gib" in text


def test_unknown_top_level_and_link_keys():
    assert "did you mean 'devices_per_node'?" in error_of({"nodes": 1, "device_per_node": 8})
    text = error_of({"nodes": 1, "inter_node_link": {"latency_ms": 1}})
    assert "where: inter_node_link.latency_ms" in text and "latency_us" in text


def test_unknown_preset_lists_every_preset(tmp_path):
    for spec in ("8xH1000", {"nodes": 1, "devices_per_node": 1, "device": {"preset": "H1000"}}):
        text = error_of(spec)
        assert "unknown device preset 'H1000'" in text
        assert all(name in text for name in PRESETS)
        assert "did you mean H100-80GB?" in text


@pytest.mark.parametrize("spec", ["8x", "2x8", "8*H100-80GB", "8x8x8xH100-80GB", "0xcpu", ""])
def test_bad_shorthand_shows_forms(spec):
    text = error_of(spec)
    assert "NxDxNAME" in text and "16x8xA100-80GB" in text


def test_unsupported_dtype():
    with pytest.raises(ClusterError) as info:
        load_cluster("V100-32GB").device.peak(torch.bfloat16)
    text = str(info.value)
    assert "V100-32GB does not support bf16" in text and "fp32, fp16" in text
    with pytest.raises(ClusterError, match="fp32, tf32, bf16, fp16, fp8"):
        load_cluster("H100-80GB").device.peak(torch.float64)


def test_unknown_dtype_key_in_file():
    spec = {
        "nodes": 1,
        "devices_per_node": 1,
        "device": {"preset": "cpu", "peak_tflops": {"int8": 1}},
    }
    text = error_of(spec)
    assert "device.peak_tflops.int8" in text and "fp32, tf32, bf16, fp16, fp8" in text


def test_negative_memory(tmp_path):
    path = write(
        tmp_path, "c.yaml", "nodes: 1\ndevices_per_node: 1\ndevice: {preset: cpu, memory_gib: -8}\n"
    )
    text = error_of(path)
    assert "device.memory_gib must be a number > 0, got -8" in text
    assert f"where: {path}: device.memory_gib" in text
    with pytest.raises(ClusterError, match="memory_bytes must be an integer > 0"):
        DeviceSpec("d", -1, {"fp32": 1.0}, 1.0, 0.5)


@pytest.mark.parametrize(
    "patch, field, allowed",
    [
        ({"nodes": 0}, "nodes", "an integer >= 1"),
        ({"nodes": 1.5}, "nodes", "an integer >= 1"),
        ({"backend": "mpi"}, "backend", "nccl, gloo"),
        ({"device": {"preset": "cpu", "matmul_efficiency": 1.5}}, "matmul_efficiency", "(0, 1]"),
        ({"device": {"preset": "cpu", "peak_flops": {"fp32": "1e12"}}}, "fp32", "write 1.0e+12"),
    ],
)
def test_bad_values_name_field_and_allowed_values(patch, field, allowed):
    text = error_of({"nodes": 1, "devices_per_node": 1, "device": "cpu", **patch})
    assert field in text and allowed in text


def test_missing_values_without_preset():
    spec = {
        **FULL_DEVICE,
        "device": {k: v for k, v in FULL_DEVICE["device"].items() if k != "name"},
    }
    text = error_of(spec)
    assert "missing device.name" in text and "device.preset" in text
    assert "missing nodes" in error_of({"devices_per_node": 8, "device": "cpu"})


def test_conflicting_unit_keys():
    spec = {
        "nodes": 1,
        "devices_per_node": 1,
        "device": {"preset": "cpu", "memory_gib": 1, "memory_bytes": 1},
    }
    assert "keep one of memory_gib, memory_bytes" in error_of(spec)


def test_missing_file(tmp_path):
    text = error_of(str(tmp_path / "nope.yaml"))
    assert "not found" in text and "nope.yaml" in text


def test_empty_file_and_non_mapping(tmp_path):
    assert "is empty" in error_of(write(tmp_path, "e.yaml", ""))
    assert "must be a mapping" in error_of(write(tmp_path, "l.yaml", "- 1\n- 2\n"))


def test_kernel_floor_memory_efficiency_and_curve_presets_and_defaults():
    h100, cpu = load_cluster("H100-80GB").device, load_cluster("2xcpu").device
    assert (h100.kernel_floor_s, h100.memory_efficiency) == (5e-6, 0.8)
    assert (cpu.kernel_floor_s, cpu.memory_efficiency) == (3e-6, 0.5)
    assert h100.matmul_efficiency_curve == ()  # GPUs: the parametric tile/wave curve
    effs = [e for _, e in cpu.matmul_efficiency_curve]  # cpu: a measured size curve
    assert len(effs) >= 3 and effs == sorted(effs) and 0 < effs[0] < effs[-1] <= 1
    c = load_cluster(FULL_DEVICE)  # no preset: the documented defaults
    assert (c.device.kernel_floor_s, c.device.memory_efficiency) == (5e-6, 0.8)
    assert c.sources["device.kernel_floor_s"] == "default"
    assert c.sources["device.matmul_efficiency_curve"] == "default"


CURVE_YAML = """\
nodes: 1
devices_per_node: 8
device:
  preset: A100-80GB
  kernel_floor_us: 4.5
  memory_efficiency: 0.85
  matmul_efficiency_curve: [[1.0e+6, 0.2], [1.0e+9, 0.7], [1.0e+12, 0.8]]
"""


def test_new_device_fields_from_file_round_trip_and_show(tmp_path):
    path = write(tmp_path, "c.yaml", CURVE_YAML)
    c = load_cluster(path)
    d = c.device
    assert d.kernel_floor_s == pytest.approx(4.5e-6) and d.memory_efficiency == 0.85
    assert d.matmul_efficiency_curve == ((1e6, 0.2), (1e9, 0.7), (1e12, 0.8))
    assert c.sources["device.matmul_efficiency_curve"] == f"file {path}"
    saved = c.to_dict()["device"]
    assert saved["matmul_efficiency_curve"] == [[1e6, 0.2], [1e9, 0.7], [1e12, 0.8]]
    assert saved["kernel_floor_s"] == d.kernel_floor_s
    again = load_cluster(json.loads(json.dumps(c.to_dict())))
    assert again == c and hash(again) == hash(c) and again.sources == c.sources
    assert pickle.loads(pickle.dumps(c)) == c
    text = format_cluster(c)
    rows = {line[:20].strip(): line[20:].split() for line in text.splitlines()[3:]}
    assert rows["kernel floor"][:3] == ["4.5", "µs", "file"]
    assert rows["memory efficiency"][:2] == ["0.85", "file"]
    assert "3 points, 1e6-1e12 FLOP, efficiency 0.2-0.8" in text
    assert "parametric" in format_cluster(load_cluster("A100-80GB"))


def test_constructed_device_normalizes_the_curve():
    d = DeviceSpec("d", GIB, {"fp32": 1e12}, 1e11, 0.9, 1e-6, 0.7, [[1000, 0.5], (2000, 1)])
    assert d.matmul_efficiency_curve == ((1000.0, 0.5), (2000.0, 1.0))
    assert hash(d) == hash(
        DeviceSpec("d", GIB, {"fp32": 1e12}, 1e11, 0.9, 1e-6, 0.7, d.matmul_efficiency_curve)
    )


@pytest.mark.parametrize(
    "device, says",
    [
        ({"kernel_floor_us": -1}, "device.kernel_floor_us must be a number >= 0"),
        ({"kernel_floor_us": 1, "kernel_floor_s": 1e-6}, "keep one of kernel_floor_us"),
        ({"memory_efficiency": 0}, "device.memory_efficiency must be a number in (0, 1]"),
        ({"matmul_efficiency_curve": "fast"}, "list of [flops, efficiency] pairs"),
        ({"matmul_efficiency_curve": [[1e6, 0.5, 1]]}, "must be a [flops, efficiency] pair"),
        ({"matmul_efficiency_curve": [[1e6, 1.5]]}, "efficiency must be a number in (0, 1]"),
        ({"matmul_efficiency_curve": [["1e6", 0.5]]}, "write 1.0e+12"),
        ({"matmul_efficiency_curve": [[1e6, 0.5], [1e6, 0.6]]}, "FLOPs must rise"),
    ],
)
def test_bad_new_device_fields(device, says):
    text = error_of({"nodes": 1, "devices_per_node": 1, "device": {"preset": "cpu", **device}})
    assert says in text
    assert "where: device." in text


def test_bad_constructed_device_fields():
    with pytest.raises(ClusterError, match="kernel_floor_s must be a number >= 0"):
        DeviceSpec("d", GIB, {"fp32": 1e12}, 1e11, 0.9, kernel_floor_s=-1.0)
    with pytest.raises(ClusterError, match="FLOPs must rise"):
        DeviceSpec("d", GIB, {"fp32": 1e12}, 1e11, 0.9, matmul_efficiency_curve=((2, 1), (1, 1)))


def test_cores_per_node_shares_compute_among_a_nodes_devices(tmp_path) -> None:
    """Local CPU processes outnumbering the cores each get ``cores / processes`` of their
    speed; a sub-cluster of fewer devices gets more; the field round-trips and is shown."""
    import dataclasses

    from cost_models.compute import op_time

    path = tmp_path / "c.yaml"
    path.write_text("nodes: 1\ndevices_per_node: 4\ncores_per_node: 2\ndevice: {preset: cpu}\n")
    shared = load_cluster(path)
    alone = load_cluster("4xcpu")
    assert shared.device.compute_share == 0.5 and alone.device.compute_share == 1.0
    assert op_time(1e9, 1e6, shared.device, "fp32") == pytest.approx(
        2 * op_time(1e9, 1e6, alone.device, "fp32"))
    assert dataclasses.replace(shared, devices_per_node=2).device.compute_share == 1.0
    assert load_cluster(shared.to_dict()) == shared
    assert "cores per node" in format_cluster(shared)
    path.write_text("nodes: 1\ndevices_per_node: 4\ncores_per_node: 0\ndevice: {preset: cpu}\n")
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    assert "cores_per_node" in err.value.where


def test_example_cluster_files_load() -> None:
    """The cluster files the README and benchmarks point to stay valid."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "examples" / "clusters").glob("*.yaml"))
    assert files
    for path in files:
        cluster = load_cluster(str(path))
        assert cluster.sources["device.attention_efficiency"] == f"file {path}"
