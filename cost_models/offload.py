"""What CPU offload costs: the host link and the optimizer step on the host.

With FSDP2's ``CPUOffloadPolicy`` (offload "optimizer+params") each rank keeps its ZeRO-3
shards of the parameters, gradients and optimizer states in host memory: every all-gather
first copies the rank's parameter shard to the device, every reduce-scatter's result is
copied back, and the optimizer steps on the host.

Figures, both **measured** on one H100 SXM host through ``benchmarks/host_offload.py``
(2026-11-26, ``benchmarks/results/h100_2026-11-26.md``), used where a device description
does not give its own (``host_link_bytes_per_s``, ``host_optimizer_params_per_s``):

- pinned host<->device copies: 54.8 GB/s (PCIe Gen5 x16; pageable memory got 16-21 GB/s);
- fp32 AdamW on the host, torch's foreach implementation, 16 threads: 1.2e9 parameters/s.
  A host that shares its cores among 8 GPUs gives each a share of that; the figure is the
  one measured, not divided.

Outside the validated ground: one host, one GPU, no other traffic on the PCIe switch.
"""

from __future__ import annotations

HOST_LINK_BYTES_PER_S = 54.8e9
HOST_OPTIMIZER_PARAMS_PER_S = 1.2e9


def host_link_bytes_per_s(device: object) -> float:
    return float(getattr(device, "host_link_bytes_per_s", None) or HOST_LINK_BYTES_PER_S)


def host_copy_s(nbytes: float, device: object) -> float:
    """Seconds to move ``nbytes`` between host and device memory (pinned)."""
    return nbytes / host_link_bytes_per_s(device)


def host_optimizer_s(numel: float, device: object) -> float:
    """Seconds of one optimizer step over ``numel`` parameters on the host."""
    rate = getattr(device, "host_optimizer_params_per_s", None) or HOST_OPTIMIZER_PARAMS_PER_S
    return numel / float(rate)
