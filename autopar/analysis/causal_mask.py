"""Recognise a causal mask the model computes from positions (analysis only).

HF models build their attention mask in the graph: ``arange`` positions compared with
``le``, joined with a packed-sequence check, expanded to ``(batch, 1, seq, seq)``. Fused as
a tensor, that mask costs ``seq²`` bytes per sequence (128 GiB for 8 x 131,072 tokens), and
under context parallelism it cannot follow the sequence split. When it is causal, the
kernel's ``causal=True`` says the same with no tensor.

The check runs the mask's own subgraph — which must read no input and no parameter, only
sizes, and hold aten ops only (never a collective of a rank's program) — at the traced
length when that is short, else at two lengths beyond every other constant it holds (so a
sliding window shows), with every argument equal to the traced length replaced, and
compares the result with the lower triangle. The batch size (the first of the other sizes)
is replaced by 1, so a probe holds ``length²`` elements, not ``batch x length²`` (a mask
traced at batch 2048 would take tens of GiB); a constant that only equals the batch by
chance (a window) then distorts the probe, and the mask is not recognised, never wrongly
recognised. A mask that depends on data, on another size, or is not causal at either length
is not recognised (it stays a mask).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

MAX_MASK_NODES = 256
"""A mask's subgraph larger than this is not examined (masks are a few dozen ops)."""

PROBE_LENGTHS = (5, 8)
"""The shortest sequence lengths the subgraph is run at (not 1 or 2, so no size is confused
with a broadcast or a batch)."""

MAX_PROBE_LENGTH = 4160
"""The longest probe: a mask's other constants (a sliding window of 4096) must be exceeded
for the probe to see them, and a probe holds a few ``length²`` tensors."""

LARGEST_CONSTANT = 2**31
"""Integers from here up are sentinels (a slice's end at INT64_MAX), not sizes."""


def computed_causal(mask: fx.Node, kind: str, seq_len: int, other_sizes: tuple[int, ...]
                    ) -> bool:
    """Is ``mask`` (a term of ``kind`` "keep", "drop" or "add") the causal pattern over a
    ``seq_len``-token sequence, made from positions only? ``other_sizes`` (batch, heads...)
    must differ from ``seq_len`` so no argument is ambiguous; the first is the batch."""
    if seq_len in other_sizes:
        return False
    nodes = _subgraph(mask)
    if nodes is None:
        return False
    batch = other_sizes[0] if other_sizes else 1
    lengths = probe_lengths(nodes, seq_len, other_sizes)
    if not lengths:
        return False
    for n in lengths:
        try:
            value = _run(nodes, mask, {seq_len: n, batch: 1} if batch > 1 else {seq_len: n})
        except Exception:  # noqa: BLE001 - any failure means "not recognised"
            return False
        if not _is_causal(value, kind, n):
            return False
    return True


def probe_lengths(nodes: list[fx.Node], seq_len: int, other_sizes: tuple[int, ...]
                  ) -> tuple[int, ...]:
    """Lengths to run the mask at: the traced length itself when it is small enough (the
    exact answer), else two lengths beyond every other constant of the subgraph (a window,
    an offset), so the probe sees what they do; () when that is too long. The batch (the
    first of ``other_sizes``), run as 1, does not count."""
    if seq_len <= MAX_PROBE_LENGTH:
        return (seq_len,)
    batch = other_sizes[0] if other_sizes else None
    constants = [abs(a) for node in nodes for a in tree_flatten((node.args, node.kwargs))[0]
                 if isinstance(a, int) and not isinstance(a, bool) and a not in (seq_len, batch)
                 and abs(a) < LARGEST_CONSTANT]
    start = max([*constants, *PROBE_LENGTHS]) + 1
    lengths = tuple(n for n in range(start, start + 8) if n not in other_sizes)[:2]
    return lengths if lengths and lengths[-1] <= MAX_PROBE_LENGTH else ()


def _subgraph(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None if any reads an input or
    a tensor attribute (the mask would depend on data) or there are too many."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function" or len(seen) >= MAX_MASK_NODES:
            return None
        if not isinstance(node.target, torch._ops.OpOverload) and node.target is not (
                operator.getitem):
            return None  # only aten ops are run: never a collective or a user's function
        seen.add(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _run(nodes: list[fx.Node], mask: fx.Node, sizes: dict[int, int]) -> torch.Tensor:
    """The mask's subgraph run on CPU with every integer argument in ``sizes`` replaced."""
    env: dict[fx.Node, object] = {}

    def value(a: object) -> object:
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, int) and not isinstance(a, bool) and a in sizes:
            return sizes[a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    for node in nodes:
        args = tree_map(value, node.args)
        kwargs = tree_map(value, dict(node.kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        if node.target is operator.getitem:
            env[node] = args[0][args[1]]
        else:
            env[node] = node.target(*args, **kwargs)
    return env[mask]


def _is_causal(value: object, kind: str, n: int) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-2:] != (n, n):
        return False
    lower = torch.ones(n, n, dtype=torch.bool).tril()
    flat = value.reshape(-1, n, n)
    if kind == "keep":
        return value.dtype == torch.bool and bool((flat == lower).all())
    if kind == "drop":
        return value.dtype == torch.bool and bool((flat == ~lower).all())
    if not value.is_floating_point():
        return False
    hidden = flat[:, ~lower]
    return bool((flat[:, lower] == 0).all()) and bool(
        (hidden <= torch.finfo(value.dtype).min / 2).all() or torch.isinf(hidden).all())
