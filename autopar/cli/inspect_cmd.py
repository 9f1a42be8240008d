"""``autopar inspect MODEL``: per-layer parameters, FLOPs and activation bytes (from the
trace: FLOPs counted by FlopCounterMode, activations = what autograd saves)."""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch.fx as fx

from autopar.cli.load import trace_model
from autopar.core.graph_facts import META_KEY, graph_facts
from autopar.core.units import format_bytes, format_count
from autopar.core.values import tensor_inputs, value_of


def _nbytes(node: fx.Node, index: int) -> int:
    facts = node.meta[META_KEY]
    n = 1
    for s in facts.shapes[index]:
        n *= s
    item = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2}
    return n * item.get(facts.dtypes[index], 1)


def layer_table(gm: fx.GraphModule) -> list[dict]:
    """One row per layer (and one for everything outside the repeated layers)."""
    rows: dict[object, dict] = defaultdict(lambda: {"params": 0, "fwd": 0, "bwd": 0, "act": 0})
    saved: set[tuple[str, int]] = set()
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is None:
            continue
        key = (facts.block, facts.layer) if facts.layer is not None else ("outside layers", None)
        row = rows[key]
        if facts.param is not None:
            row["params"] += facts.param.numel
        row["fwd"] += facts.fwd_flops
        row["bwd"] += facts.bwd_flops
        row["act"] += facts.extra_saved_bytes
        if facts.saves_output and (node.name, 0) not in saved:
            saved.add((node.name, 0))
            row["act"] += _nbytes(node, 0)
        inputs = tensor_inputs(node)
        for slot in facts.saved_inputs:
            producer, index = value_of(inputs[slot])
            if producer.op == "get_attr" or (producer.name, index) in saved:
                continue
            saved.add((producer.name, index))
            row["act"] += _nbytes(producer, index)
    out = []
    for (block, layer), row in rows.items():
        out.append({"name": block if layer is None else f"{block}.{layer}", **row})
    return out


def run_inspect(args: argparse.Namespace) -> int:
    traced = trace_model(args.model, args.global_batch, args.seq)
    facts = graph_facts(traced.gm)
    print(f"autopar inspect: {traced.spec.name}, batch {traced.batch} x seq {traced.seq}, "
          f"{format_count(facts.params)} parameters, traced with {facts.tracer} in "
          f"{traced.trace_s:.1f} s (measured)\n")
    header = f"{'layer':<28} {'params':>10} {'fwd FLOPs':>12} {'bwd FLOPs':>12} {'activations':>12}"
    print(header)
    print("-" * len(header))
    rows = layer_table(traced.gm)
    previous = None
    repeats = 0
    for row in rows + [None]:
        values = None if row is None else (row["params"], row["fwd"], row["bwd"], row["act"])
        if previous is not None and values == previous[1]:
            repeats += 1
            continue
        if repeats:
            print(f"{'  ... ' + str(repeats) + ' more identical':<28}")
            repeats = 0
        if row is None:
            break
        print(f"{row['name']:<28} {format_count(row['params']):>10} {format_count(row['fwd']):>12} "
              f"{format_count(row['bwd']):>12} {format_bytes(row['act']):>12}")
        previous = (row["name"], values)
    total = {k: sum(r[k] for r in rows) for k in ("params", "fwd", "bwd", "act")}
    print("-" * len(header))
    print(f"{'total':<28} {format_count(total['params']):>10} {format_count(total['fwd']):>12} "
          f"{format_count(total['bwd']):>12} {format_bytes(total['act']):>12}")
    print("\nFLOPs from FlopCounterMode on the traced shapes; activations are the bytes autograd "
          "saves for backward at the traced dtype, no parallelism, no recomputation.")
    return 0
