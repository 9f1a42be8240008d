"""The keys a cluster description may hold: their units and conversions to base units, the
defaults and required fields, and the order ``Cluster.sources`` lists fields in."""

from __future__ import annotations

from autopar.core.cluster.presets import (
    DEFAULT_ATTENTION_EFFICIENCY,
    DEFAULT_KERNEL_FLOOR_S,
    DEFAULT_MEMORY_EFFICIENCY,
    DTYPES,
    GB,
    GIB,
    TFLOPS,
)

_LINKS = {"intra_node_link": "intra_node", "inter_node_link": "inter_node",
          "intra_node_link_uncontended": "intra_node_uncontended"}

# Unit-carrying user keys -> (field, check kind, conversion to base units).
_DEVICE_UNITS = {
    "memory_gib": ("memory_bytes", "positive", lambda v: round(v * GIB)),
    "memory_bytes": ("memory_bytes", "bytes", None),
    "memory_bandwidth_gb_per_s": ("memory_bandwidth_bytes_per_s", "positive", lambda v: v * GB),
    "memory_bandwidth_bytes_per_s": ("memory_bandwidth_bytes_per_s", "positive", None),
    "matmul_efficiency": ("matmul_efficiency", "fraction", None),
    "kernel_floor_us": ("kernel_floor_s", "nonnegative", lambda v: v / 1e6),
    "kernel_floor_s": ("kernel_floor_s", "nonnegative", None),
    "allocation_ns_per_byte": ("allocation_s_per_byte", "nonnegative", lambda v: v / 1e9),
    "allocation_s_per_byte": ("allocation_s_per_byte", "nonnegative", None),
    "memory_efficiency": ("memory_efficiency", "fraction", None),
    "attention_efficiency": ("attention_efficiency", "fraction", None),
    "corun_slowdown": ("corun_slowdown", "nonnegative", None),
    "memory_overlap": ("memory_overlap", "share", None),
    "fp8_matmul_efficiency": ("fp8_matmul_efficiency", "fraction", None),
    "generated_attention_forward": ("generated_attention_forward", "positive", None),
    "generated_attention_backward": ("generated_attention_backward", "positive", None),
    "sharded_host_us_per_tensor": ("sharded_host_s_per_tensor", "nonnegative",
                                   lambda v: v / 1e6),
    "sharded_host_s_per_tensor": ("sharded_host_s_per_tensor", "nonnegative", None),
    "sharded_optimizer_us_per_tensor": ("sharded_optimizer_s_per_tensor", "nonnegative",
                                        lambda v: v / 1e6),
    "sharded_optimizer_s_per_tensor": ("sharded_optimizer_s_per_tensor", "nonnegative", None),
    "view_us": ("view_s", "nonnegative", lambda v: v / 1e6),
    "view_s": ("view_s", "nonnegative", None),
    "speed_spread": ("speed_spread", "share", None),
}
_CURVE = "matmul_efficiency_curve"
_CURVES = (_CURVE, "attention_efficiency_curve")
_OP_RATES = {"op_s_per_element": 1.0, "op_ns_per_element": 1e-9}  # key -> to seconds
_PEAK_UNITS = {"peak_tflops": lambda v: v * TFLOPS, "peak_flops": None}
_LINK_UNITS = {
    "bandwidth_gb_per_s": ("bandwidth_bytes_per_s", "positive", lambda v: v * GB),
    "bandwidth_bytes_per_s": ("bandwidth_bytes_per_s", "positive", None),
    "latency_us": ("latency_s", "nonnegative", lambda v: v / 1e6),
    "latency_s": ("latency_s", "nonnegative", None),
    "busy_latency_us": ("busy_latency_s", "nonnegative", lambda v: v / 1e6),
    "busy_latency_s": ("busy_latency_s", "nonnegative", None),
}
_TOP_KEYS = (
    "name", "nodes", "devices_per_node", "cores_per_node", "backend", "profile", "device",
    *_LINKS, "sources", "constraints"
)  # fmt: skip
_DEVICE_KEYS = ("preset", "name", *_DEVICE_UNITS, *_PEAK_UNITS, *_CURVES, *_OP_RATES)

# Fields with a default when neither the description nor its preset sets them.
_DEFAULTS = {
    "backend": "nccl",
    "device.kernel_floor_s": DEFAULT_KERNEL_FLOOR_S,
    "device.memory_efficiency": DEFAULT_MEMORY_EFFICIENCY,
    "device.attention_efficiency": DEFAULT_ATTENTION_EFFICIENCY,
    "device.allocation_s_per_byte": 0.0,
    "device.corun_slowdown": 0.0,
    "device.memory_overlap": 1.0,
    "device.fp8_matmul_efficiency": 1.0,
    "device.generated_attention_forward": 1.0,
    "device.generated_attention_backward": 1.0,
    "device.sharded_host_s_per_tensor": 0.0,
    "device.sharded_optimizer_s_per_tensor": 0.0,
    f"device.{_CURVE}": (),
    "device.attention_efficiency_curve": (),
    "device.op_s_per_element": {},
    "device.view_s": 0.0,
    "device.speed_spread": 0.0,
    "intra_node.busy_latency_s": 0.0,
    "inter_node.busy_latency_s": 0.0,
}

# Fields a description must end up with (from the user or a preset) -> the key to add.
_REQUIRED = {
    "nodes": "nodes",
    "devices_per_node": "devices_per_node",
    "device.name": "device.name",
    "device.memory_bytes": "device.memory_gib",
    "device.peak_flops": "device.peak_tflops",
    "device.memory_bandwidth_bytes_per_s": "device.memory_bandwidth_gb_per_s",
    "device.matmul_efficiency": "device.matmul_efficiency",
    "intra_node.bandwidth_bytes_per_s": "intra_node_link.bandwidth_gb_per_s",
    "intra_node.latency_s": "intra_node_link.latency_us",
    "inter_node.bandwidth_bytes_per_s": "inter_node_link.bandwidth_gb_per_s",
    "inter_node.latency_s": "inter_node_link.latency_us",
}

_ORDER = ["name", "nodes", "devices_per_node", "cores_per_node", "backend", "device.name",
          "device.memory_bytes"]
_ORDER += [f"device.peak_flops.{k}" for k in DTYPES]
_ORDER += ["device.memory_bandwidth_bytes_per_s", "device.matmul_efficiency"]
_ORDER += ["device.matmul_efficiency_curve", "device.kernel_floor_s", "device.memory_efficiency",
           "device.allocation_s_per_byte", "device.corun_slowdown", "device.memory_overlap",
           "device.fp8_matmul_efficiency", "device.generated_attention_forward",
           "device.generated_attention_backward",
           "device.sharded_host_s_per_tensor", "device.sharded_optimizer_s_per_tensor",
           "device.op_s_per_element", "device.attention_efficiency_curve", "device.view_s",
           "device.speed_spread"]
_ORDER += [f"{p}.{f}" for p in _LINKS.values() for f in ("bandwidth_bytes_per_s", "latency_s",
                                                     "busy_latency_s")]


def _field_order(key: str) -> int:
    """Where ``key`` sorts among a cluster's sources: ``_ORDER``'s fields first, in order."""
    return _ORDER.index(key) if key in _ORDER else len(_ORDER)
