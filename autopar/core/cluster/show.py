"""``autopar cluster show``: every resolved value with its unit and where it came from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.core.cluster.compute_share import slowest_chip_delay
from autopar.core.cluster.presets import DTYPES, GB, GIB, TFLOPS
from autopar.core.cluster.spec import Cluster

if TYPE_CHECKING:
    pass

# ---- display ------------------------------------------------------------------------------


def _num(x: float) -> str:
    text = f"{x:.3f}".rstrip("0").rstrip(".")
    return text if text not in ("0", "-0") or x == 0 else f"{x:.3g}"


def format_cluster(cluster: Cluster) -> str:
    """Every resolved value with its unit and source: what ``autopar cluster show`` prints."""
    c, d = cluster, cluster.device

    def src(key: str) -> str:
        return c.sources.get(key, "-")

    rows: list[tuple[str, str, str | None, str]] = [  # label, value, unit (None: text), source
        ("name", c.name or "-", None, src("name")),
        ("nodes", str(c.nodes), "", src("nodes")),
        ("devices per node", str(c.devices_per_node), "", src("devices_per_node")),
        ("world size", str(c.world_size), "", "nodes x devices per node"),
        *([("cores per node", f"{c.cores_per_node} (each device gets "
            f"{_num(d.compute_share)} of its speed)", None, src("cores_per_node"))]
          if c.cores_per_node is not None else []),
        ("backend", c.backend, None, src("backend")),
        ("device", d.name, None, src("device.name")),
        ("  memory", _num(d.memory_bytes / GIB), "GiB", src("device.memory_bytes")),
    ]
    for dtype, flops in d.peak_flops.items():
        rows.append(
            (f"  peak {dtype}", _num(flops / TFLOPS), "TFLOP/s", src(f"device.peak_flops.{dtype}"))
        )
    unsupported = [k for k in DTYPES if k not in d.peak_flops]
    if unsupported:
        rows.append(("  unsupported", ", ".join(unsupported), None, "no peak FLOP/s given"))
    rows += [
        (
            "  memory bandwidth",
            _num(d.memory_bandwidth_bytes_per_s / GB),
            "GB/s",
            src("device.memory_bandwidth_bytes_per_s"),
        ),
        ("  matmul efficiency", _num(d.matmul_efficiency), "", src("device.matmul_efficiency")),
        (
            "  matmul curve",
            _curve(d.matmul_efficiency_curve),
            None,
            src("device.matmul_efficiency_curve"),
        ),
        ("  kernel floor", _num(d.kernel_floor_s * 1e6), "µs", src("device.kernel_floor_s")),
        ("  allocation", _num(d.allocation_s_per_byte * 1e9), "ns/B",
         src("device.allocation_s_per_byte")),
        ("  co-run slowdown/proc", _num(d.corun_slowdown), "", src("device.corun_slowdown")),
        ("  memory overlap", _num(d.memory_overlap), "", src("device.memory_overlap")),
        ("  chip speed spread", f"{_num(d.speed_spread)} (the slowest of {c.world_size}: "
         f"{slowest_chip_delay(d.speed_spread, c.world_size):.1%} slower)", None,
         src("device.speed_spread")),
        ("  fp8 matmul eff./bf16", _num(d.fp8_matmul_efficiency), "",
         src("device.fp8_matmul_efficiency")),
        ("  own attn fwd/SDPA", _num(d.generated_attention_forward), "",
         src("device.generated_attention_forward")),
        ("  own attn bwd/SDPA", _num(d.generated_attention_backward), "",
         src("device.generated_attention_backward")),
        ("  FSDP2 host/tensor", _num(d.sharded_host_s_per_tensor * 1e6), "µs",
         src("device.sharded_host_s_per_tensor")),
        ("  DTensor opt/tensor", _num(d.sharded_optimizer_s_per_tensor * 1e6), "µs",
         src("device.sharded_optimizer_s_per_tensor")),
        ("  view (no kernel)", _num(d.view_s * 1e6), "µs", src("device.view_s")),
        ("  memory efficiency", _num(d.memory_efficiency), "", src("device.memory_efficiency")),
        ("  attention efficiency", _num(d.attention_efficiency), "",
         src("device.attention_efficiency")),
    ]
    if d.attention_efficiency_curve:
        rows.append(("  attention curve", _curve(d.attention_efficiency_curve), None,
                     src("device.attention_efficiency_curve")))
    rows += [(f"  {op} fwd, bwd", f"{_num(fwd * 1e9)}, {_num(bwd * 1e9)}", "ns/element",
              src("device.op_s_per_element")) for op, (fwd, bwd) in d.op_s_per_element.items()]
    links = [("intra-node link", "intra_node", c.intra_node),
             ("inter-node link", "inter_node", c.inter_node)]
    if c.intra_node_uncontended is not None:
        links.append((f"intra-node link, at most {c.cores_per_node} processes"
                      if c.cores_per_node else "intra-node link, uncontended",
                      "intra_node_uncontended", c.intra_node_uncontended))
    for title, prefix, link in links:
        rows += [
            (title, "", None, ""),
            (
                "  bandwidth",
                _num(link.bandwidth_bytes_per_s / GB),
                "GB/s",
                src(f"{prefix}.bandwidth_bytes_per_s"),
            ),
            ("  latency", _num(link.latency_s * 1e6), "µs", src(f"{prefix}.latency_s")),
        ]
        if link.busy_latency_s:
            rows.append(("  busy latency", _num(link.busy_latency_s * 1e6), "µs",
                         src(f"{prefix}.busy_latency_s")))
        for kind, (bandwidth, latency) in link.per_kind.items():
            rows.append((f"  {kind.replace('_', '-')} (own fit)",
                         f"{_num(bandwidth / GB)} GB/s, {_num(latency * 1e6)}", "µs",
                         src(f"{prefix}.per_kind")))
    return _table(c, rows)


def _curve(curve: tuple[tuple[float, float], ...]) -> str:
    """A curve in one line: its size and ranges, not every point."""
    if not curve:
        return "parametric"
    effs = [e for _, e in curve]
    return (
        f"{_plural(len(curve), 'point')}, {_sci(curve[0][0])}-{_sci(curve[-1][0])} FLOP, "
        f"efficiency {_num(min(effs))}-{_num(max(effs))}"
    )


def _sci(x: float) -> str:
    """``8192`` -> ``8.2e3``: short scientific notation for wide-ranging counts."""
    mantissa, _, exponent = f"{x:.2g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _table(c: Cluster, rows: list[tuple[str, str, str | None, str]]) -> str:
    """Align labels, numbers on their decimal point, units and sources in columns."""
    split = {i: r[1].partition(".") for i, r in enumerate(rows) if r[2] is not None}
    w_int = max(len(whole) for whole, _, _ in split.values())
    w_frac = max(len(dot + frac) for _, dot, frac in split.values())
    w_unit = max(len(r[2]) for r in rows if r[2] is not None)
    w_label = max(len(r[0]) for r in rows)
    w_value = max([w_int + w_frac + 1 + w_unit] + [len(r[1]) for r in rows if r[2] is None])
    head = (
        f"cluster {c.name or '-'}: {_plural(c.nodes, 'node')} x "
        f"{_plural(c.devices_per_node, 'device')} per node ({c.device.name}), "
        f"world size {c.world_size}, backend {c.backend}"
    )
    lines = [head, "", f"{'field':<{w_label}}  {'value':<{w_value}}  source"]
    for i, (label, value, unit, source) in enumerate(rows):
        if i in split:
            whole, dot, frac = split[i]
            value = f"{whole:>{w_int}}{dot + frac:<{w_frac}} {unit}"
        lines.append(f"{label:<{w_label}}  {value:<{w_value}}  {source}".rstrip())
    return "\n".join(lines)
