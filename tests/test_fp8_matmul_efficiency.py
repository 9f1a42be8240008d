"""fp8 matmuls reach less of their peak than bf16's do of theirs (measured on an H200):
a device property, read from cluster files and presets, applied to fp8 matmuls alone."""

from __future__ import annotations

import pytest

from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError
from autopar.cost_models.compute import op_time

SHAPE = (8192, 14336, 4096)
FLOPS = 2.0 * 8192 * 14336 * 4096


def _cluster(**device):
    return load_cluster({"name": "c", "nodes": 1, "devices_per_node": 8,
                         "device": {"preset": "H100-80GB", **device}})


def test_fp8_matmuls_on_hopper_take_the_measured_efficiency():
    hopper, ideal = _cluster().device, _cluster(fp8_matmul_efficiency=1.0).device
    assert hopper.fp8_matmul_efficiency == 0.9
    fp8 = op_time(FLOPS, 0, hopper, "fp8", shape=SHAPE)
    assert fp8 == pytest.approx(op_time(FLOPS, 0, ideal, "fp8", shape=SHAPE) / 0.9, rel=1e-3)
    # bf16 matmuls are untouched
    assert op_time(FLOPS, 0, hopper, "bf16", shape=SHAPE) == op_time(FLOPS, 0, ideal, "bf16",
                                                                     shape=SHAPE)


def test_an_unmeasured_device_keeps_fp8_at_bf16s_efficiency():
    assert load_cluster("B200").device.fp8_matmul_efficiency == 1.0


def test_a_bad_fp8_matmul_efficiency_is_refused_naming_it():
    with pytest.raises(AutoparError, match="fp8_matmul_efficiency"):
        _cluster(fp8_matmul_efficiency=1.5)
