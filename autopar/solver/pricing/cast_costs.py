"""The casts autopar's program inserts for its per-node precision: which, so they are priced.

``passes/cast_precision.py`` makes every planned node's floating inputs arrive in the dtype
it computes in: a cast before it wherever an input is stored in another dtype (one per
value and dtype, however many nodes read it), and a normalisation computed in fp32 hands
its output back in its input's dtype (``cast_back``). Under bf16 a Llama layer gets four:
each RMSNorm's input up to fp32 and its output back. Each is a kernel that reads the value
in one dtype and writes it in the other, and its backward casts the gradient back: about
2% of a Llama 3 8B step on H100 (modelled). Parameters' casts are priced with the op that
reads them (``CostTables._weight_cast_bytes``); fp8 linears and chunked losses cast their
own inputs inside their kernels.

A program that fuses its elementwise ops (``PinnedConfig.fuse_elementwise``: Transformer
Engine, ``torch.compile``) folds a cast into the fused kernel next to it: there a cast
beside an elementwise op costs nothing (``elementwise_fusion.fusable``).

This is an analysis of the traced graph; :class:`autopar.solver.pricing.costs.CostTables` prices it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.analysis.precision import PrecisionAssignment, stored_word
from autopar.core.values import tensor_inputs
from autopar.solver.pricing.elementwise_fusion import fusable, through_views

_CASTS_ITSELF = ("cross_entropy", "nll_loss")
"""Losses the program computes chunked, upcasting one block of logits at a time."""


@dataclass(frozen=True)
class Cast:
    """One cast the program runs, priced with the node it precedes (or follows)."""

    value: str  # the node whose output is cast
    position: int  # that value's position among the node's tensor inputs (-1: its output)
    have: str  # the dtype word it is stored in
    want: str  # the dtype word it is cast to


def inserted_casts(gm: fx.GraphModule, precision: PrecisionAssignment,
                   fused: bool = False) -> dict[str, tuple[Cast, ...]]:
    """Node name -> the casts the program runs for it, as ``passes/cast_precision.py``
    inserts them; ``fused``: the program fuses elementwise ops (casts beside one are free).

    >>> import torch
    >>> from autopar.trace import trace
    >>> from autopar.analysis.precision import assign_precision
    >>> class Norm(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.proj = torch.nn.Linear(8, 8)
    ...         self.norm = torch.nn.LayerNorm(8)
    ...     def forward(self, x):
    ...         return self.norm(self.proj(x))
    >>> gm = trace(Norm(), (torch.randn(2, 8),))
    >>> casts = inserted_casts(gm, assign_precision(gm, "bf16"))
    >>> [(c.have, c.want) for c in casts["layer_norm"]]
    [('bf16', 'fp32'), ('fp32', 'bf16')]
    """
    if precision.compute == "fp32" and not precision.overrides:
        return {}
    out: dict[str, list[Cast]] = {}
    done: set[tuple[str, str]] = set()
    for node in gm.graph.nodes:
        word = precision.nodes.get(node.name)
        if node.op != "call_function" or word is None:
            continue
        target = str(node.target)
        if any(k in target for k in _CASTS_ITSELF) or (word == "fp8" and "linear" in target):
            continue
        want = stored_word(word)
        for position, arg in enumerate(tensor_inputs(node)):
            have = precision.stored.get(arg.name)
            if (have in (None, want) or arg.op != "call_function" or (arg.name, want) in done
                    or (fused and (fusable(node) or fusable(through_views(arg))))):
                continue
            done.add((arg.name, want))
            out.setdefault(node.name, []).append(Cast(arg.name, position, have, want))
        back = precision.cast_back.get(node.name)
        if back is not None and not (fused and fusable(node)):
            out.setdefault(node.name, []).append(Cast(node.name, -1, want, back))
    return {name: tuple(casts) for name, casts in out.items()}


# --- fp8 linears' quantization ------------------------------------------------------------
FP8_EAGER_BYTES = (2.0, 1.0)
"""(reads of the value, bytes written) per element of an eager tensorwise quantization
(``fp8_ops.quantize``, torchao's eager ``Float8Linear``): the value read twice (the amax
pass, then the scaled cast) and its one-byte fp8 copy written."""
FP8_FUSED_BYTES = (1.0, 2.0)
"""The same for a fusing program's cast-transpose kernel (Transformer Engine's
``cast_transpose``; Inductor's fused amax and cast): the value read once, the fp8 copy and
its transpose (which the backward's matmuls read) written, a byte each."""


def fp8_quantize_bytes(elements: float, element_bytes: int, fused: bool) -> float:
    """Bytes moved quantizing a value of ``elements`` stored in ``element_bytes`` bytes to
    fp8 (tensorwise), eager or in a fusing program.

    >>> fp8_quantize_bytes(1e6, 2, fused=False), fp8_quantize_bytes(1e6, 2, fused=True)
    (5000000.0, 4000000.0)
    """
    reads, writes = FP8_FUSED_BYTES if fused else FP8_EAGER_BYTES
    return elements * (element_bytes * reads + writes)
