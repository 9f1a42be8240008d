"""Per-node FLOPs and saved-for-backward tensors, measured by running each op on fake tensors.

Each distinct op call (target, shapes, dtypes, arguments) is run once under a
``FakeTensorMode`` — no memory, no compute — with ``FlopCounterMode`` counting forward and
backward FLOPs, and ``saved_tensors_hooks`` recording what autograd keeps for backward. This
is the same autograd the real run uses, so the activation memory the cost model predicts is
the memory the run holds. Identical layers share one measurement through the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from autopar.trace.backward_kernels import BackwardKernels

_aten = torch.ops.aten


def _register_cpu_attention_flops() -> None:
    """FlopCounterMode knows the CUDA attention kernels only; teach it the CPU flash kernel.

    Same formulas (``sdpa_flop``/``sdpa_backward_flop``), so CPU and GPU traces agree.
    """
    forward = _aten._scaled_dot_product_flash_attention_for_cpu
    backward = _aten._scaled_dot_product_flash_attention_for_cpu_backward
    if forward in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(forward, get_raw=True)
    def _forward(query, key, value, *args, out_val=None, **kwargs) -> int:
        return flop_counter.sdpa_flop(query.shape, key.shape, value.shape)

    @flop_counter.register_flop_formula(backward, get_raw=True)
    def _backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop(
            grad_out.shape, query.shape, key.shape, value.shape
        )


_register_cpu_attention_flops()


def register_custom_op_flops() -> None:
    """FLOP formulas for custom ops that models bring (registered once they exist).

    ``transformers::grouped_mm_fallback(input (S, in), weight (E, in, out), offs)``: every
    token goes through one expert's matmul, so 2 * S * in * out (Hugging Face MoE layers).
    """
    ns = getattr(torch.ops, "transformers", None)
    op = getattr(ns, "grouped_mm_fallback", None) if ns is not None else None
    if op is None:
        return
    if op in flop_counter.flop_registry or op.default in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(op)
    def _grouped_mm(input_shape, weight_shape, offs_shape, *args, out_shape=None, **kw) -> int:
        return 2 * input_shape[0] * weight_shape[1] * weight_shape[2]


@dataclass(frozen=True)
class OpMeasure:
    fwd_flops: int = 0
    bwd_flops: int = 0
    # the kernels autograd runs for its backward and the bytes they move (backward_kernels);
    # None where the backward was not replayed
    bwd_bytes: int | None = None
    bwd_kernels: int = 0
    saved_inputs: tuple[int, ...] = ()  # indices into the node's flattened tensor inputs
    saves_output: bool = False
    extra_saved_bytes: int = 0
    extra_saved_float_numel: int = 0  # elements of those buffers that are floating point
    extra_saved_other_bytes: int = 0  # bytes of those buffers that are not floating point


NOTHING = OpMeasure()


# {unbacked symbol: expected value} of the graph being annotated (autopar.trace.expected_rows)
EXPECTED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("autopar_expected",
                                                                     default=None)


def concrete(size: Any) -> int:
    """An int for a possibly symbolic size: its hint; for an unbacked size (rows ``nonzero``
    picks), the expected value :data:`EXPECTED` gives, else 1."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None) if node is not None else None
    if hint is not None:
        return int(hint)
    expr = getattr(node, "expr", None)
    expected = EXPECTED.get()
    if expr is not None and expected and expr.free_symbols <= expected.keys():
        return max(1, int(expr.subs(expected)))
    try:
        return int(size)
    except Exception:  # noqa: BLE001 - unbacked symbol without a hint
        return 1


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - tensors without storage (e.g. some subclasses)
        return None


class OpCostMeter:
    """Measures nodes, caching by op signature."""

    def __init__(self, fake_mode: Any, root: fx.GraphModule):
        register_custom_op_flops()
        self.fake_mode = fake_mode
        self.root = root
        self._cache: dict[Any, OpMeasure] = {}

    def measure(self, node: fx.Node, grad_inputs: list[bool]) -> OpMeasure:
        """``grad_inputs[i]``: does flattened tensor input ``i`` require grad."""
        if node.op != "call_function" or node.target is operator.getitem:
            return NOTHING
        key = self._key(node, grad_inputs)
        if key is None:
            return NOTHING
        if key not in self._cache:
            try:
                with _quiet("torch._subclasses.fake_tensor"):
                    self._cache[key] = self._run(node, grad_inputs)
            except Exception:  # noqa: BLE001 - an op we cannot replay costs nothing extra
                self._cache[key] = NOTHING
        return self._cache[key]

    def _key(self, node: fx.Node, grad_inputs: list[bool]) -> Any:
        def describe(a: Any) -> Any:
            if isinstance(a, fx.Node):
                val = a.meta.get("val")
                if isinstance(val, torch.Tensor):
                    return ("T", tuple(concrete(s) for s in val.shape), val.dtype)
                if a.op == "get_attr":
                    return ("attr", str(a.target))
                return ("N", repr(val) if isinstance(val, (int, float, bool)) else None)
            if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
                return str(a)
            return a

        try:
            args = tree_map(describe, (node.args, node.kwargs))
            key = (node.target, repr(args), tuple(grad_inputs))
            hash(key)
            return key
        except Exception:  # noqa: BLE001 - unhashable arguments: do not measure
            return None

    def _run(self, node: fx.Node, grad_inputs: list[bool]) -> OpMeasure:
        inputs: list[torch.Tensor] = []

        # Grad mode must be on whatever the caller's state (a meta-device trace may leave it off).
        with self.fake_mode, torch.enable_grad():

            def build(a: Any) -> Any:
                if isinstance(a, fx.Node):
                    val = a.meta.get("val")
                    if isinstance(val, torch.Tensor):
                        shape = [concrete(s) for s in val.shape]
                        t = torch.empty(shape, dtype=val.dtype, device=_device(val.device))
                        if grad_inputs[len(inputs)] and t.is_floating_point():
                            t.requires_grad_(True)
                        inputs.append(t)
                        return t
                    if a.op == "get_attr":
                        return getattr(self.root, str(a.target))
                    return val
                if isinstance(a, torch.device):
                    return _device(a)
                return a

            args, kwargs = tree_map(build, (node.args, node.kwargs))
            saved: list[torch.Tensor] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with FlopCounterMode(display=False) as fwd_counter:
                    out = _measured_target(node.target, args, kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            bwd_flops = 0
            bwd_bytes, bwd_kernels = None, 0
            diff_outs = [t for t in outs if t.requires_grad]
            diff_ins = [t for t in inputs if t.requires_grad]
            if diff_outs and diff_ins:
                grads = [torch.empty_like(t) for t in diff_outs]
                with FlopCounterMode(display=False) as bwd_counter, BackwardKernels() as run:
                    torch.autograd.grad(diff_outs, diff_ins, grads, allow_unused=True)
                bwd_flops = bwd_counter.get_total_flops()
                bwd_bytes, bwd_kernels = run.bytes_moved, run.kernels
                if bwd_flops == 0 and fwd_counter.get_total_flops() > 0:
                    # An opaque backward (a custom op's): a matmul's backward costs twice
                    # its forward (input and weight gradients).
                    bwd_flops = 2 * fwd_counter.get_total_flops()

        return OpMeasure(
            fwd_flops=fwd_counter.get_total_flops(),
            bwd_flops=bwd_flops,
            bwd_bytes=bwd_bytes,
            bwd_kernels=bwd_kernels,
            **_classify_saved(saved, inputs, outs),
        )


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Data-dependent ops (``histc``, ``nonzero``) cannot run on fake tensors; torch logs
    each failure at ERROR level. They cost nothing here, so silence that logger meanwhile."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _measured_target(target: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``target``, except that attention with narrower values runs as a fused kernel
    would (see below), and ``dropout`` in training runs as ``native_dropout``: on CPU
    ``dropout`` keeps its mask as a float tensor, while the GPU kernels (and native_dropout
    everywhere) keep one byte per element, which is what a training cluster holds."""
    if target is _aten.scaled_dot_product_attention.default and len(args) >= 3:
        q, v = args[0], args[2]
        pad = q.shape[-1] - v.shape[-1] if isinstance(v, torch.Tensor) else 0
        if pad > 0:
            # Values narrower than queries and keys (DeepSeek's MLA: 192 vs 128): CUDA runs
            # them in a fused kernel (memory-efficient attention), CPU's flash kernel refuses
            # them and math attention would keep every score. Measure the fused kernel on
            # values padded to the key width (a slight overestimate), and cut the output.
            padded = torch.nn.functional.pad(v, (0, pad))
            out = target(q, args[1], padded, *args[3:], **kwargs)
            return out[..., : v.shape[-1]]
    if target is _aten.dropout.default:
        x, p, train = (list(args) + [kwargs.get("p"), kwargs.get("train")])[:3]
        if train and p and p > 0:
            out, _mask = _aten.native_dropout.default(x, p, train)
            return out
    return target(*args, **kwargs)


def _device(device: torch.device) -> torch.device:
    """Meta models are measured as fake CPU tensors: meta would pick the math attention
    kernel (which saves the full score matrix); CPU and CUDA pick flash-style kernels that
    save only the log-sum-exp. Fake CPU tensors allocate nothing either."""
    return torch.device("cpu") if device.type == "meta" else device


def _classify_saved(
    saved: list[torch.Tensor], inputs: list[torch.Tensor], outs: list[torch.Tensor]
) -> dict:
    input_keys = {}
    for i, t in enumerate(inputs):
        input_keys.setdefault(_storage_key(t), i)
    output_keys = {_storage_key(t) for t in outs}
    saved_inputs: set[int] = set()
    saves_output = False
    extra = 0
    extra_float = 0
    extra_other = 0
    counted: set[int | None] = set()
    for s in saved:
        k = _storage_key(s)
        if k in input_keys and k is not None:
            saved_inputs.add(input_keys[k])
        elif k in output_keys and k is not None:
            saves_output = True
        elif k not in counted or k is None:
            counted.add(k)
            extra += s.numel() * s.element_size()
            if s.is_floating_point():
                extra_float += s.numel()
            else:
                extra_other += s.numel() * s.element_size()
    return {
        "saved_inputs": tuple(sorted(saved_inputs)),
        "saves_output": saves_output,
        "extra_saved_bytes": extra,
        "extra_saved_float_numel": extra_float,
        "extra_saved_other_bytes": extra_other,
    }
