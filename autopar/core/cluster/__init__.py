"""Cluster descriptions: all the cost models and the solver know of the hardware.

A cluster is ``nodes`` identical nodes of ``devices_per_node`` identical devices, with one
link model inside a node and one between nodes. Name one by shorthand or preset, or describe
it in a YAML/JSON file or dict whose values override a preset's:

>>> c = load_cluster("16x8xH100-80GB")
>>> c.world_size, c.device.peak("bf16") / 1e12, c.sources["device.memory_bytes"]
(128, 989.4, 'preset H100-80GB')
>>> load_cluster(c.to_dict()) == c
True

Every value remembers where it came from (``Cluster.sources``, keyed by dotted field name
such as ``intra_node.latency_s``); ``format_cluster`` prints values with units and sources
for ``autopar cluster show SPEC``. Files carry their units in key names (``memory_gib``,
``bandwidth_gb_per_s``, ``latency_us``; GB = 1e9 bytes, GiB = 2**30); ``to_dict`` writes
base units (``memory_bytes``, ``bandwidth_bytes_per_s``, ``latency_s``) so that plans
round-trip exactly. Files are read with ``yaml.safe_load``/``json``: loading never runs code.
"""

from autopar.core.cluster.checks import BACKENDS, dtype_key
from autopar.core.cluster.compute_share import usable_cores
from autopar.core.cluster.load import SHORTHAND_FORMS, load_cluster
from autopar.core.cluster.show import format_cluster
from autopar.core.cluster.spec import Cluster, DeviceSpec, LinkSpec

__all__ = [
    "BACKENDS",
    "SHORTHAND_FORMS",
    "Cluster",
    "DeviceSpec",
    "LinkSpec",
    "dtype_key",
    "format_cluster",
    "load_cluster",
    "usable_cores",
]
