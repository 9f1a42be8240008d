"""Compute time of one op on one device: the roofline of FLOPs and bytes moved.

An op takes the longer of its FLOPs at the device's achievable rate (peak for the compute
dtype times the matmul efficiency) and its bytes at the memory bandwidth. Ops without FLOPs
(elementwise, norms) are memory-bound. This is cost model v0; a shape-aware efficiency and a
per-kernel floor are the next refinement, behind the same function.

>>> from autopar.cluster import load_cluster
>>> dev = load_cluster("8xA100-80GB").device
>>> op_time(2 * 4096**3, 3 * 4096**2 * 2, dev, "bf16") > 0
True
"""

from __future__ import annotations

from autopar.cluster import DeviceSpec


def op_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: str) -> float:
    """Seconds for an op doing ``flops`` and moving ``bytes_moved`` on ``device``."""
    compute = flops / (device.peak(dtype) * device.matmul_efficiency) if flops else 0.0
    memory = bytes_moved / device.memory_bandwidth_bytes_per_s if bytes_moved else 0.0
    return max(compute, memory)
