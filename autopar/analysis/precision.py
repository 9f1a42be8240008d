"""Per-node compute precision: which dtype each op of a traced graph computes in, and why.

Mixed-precision training (Micikevicius et al., 2018) keeps fp32 master weights and computes
the matrix multiplies in a low precision. autopar writes that down per fx node, so the
cost model prices each op in its own dtype, the plan shows it (``plan.precision``), and the
casting pass (``passes/cast_precision.py``) executes exactly it. The default policy is
``torch.autocast``'s, made explicit:

- **lowered** ops (matmuls, convolutions, attention) compute in the plan's precision: their
  floating inputs are cast to it (weights included: the fp32 parameter is the master copy);
  under ``fp8`` the linear layers' matmuls take fp8 operands (tensorwise scaling, the
  torchao recipe) and everything else lowered runs in bf16;
- **kept fp32**: normalisations, softmax, losses and MoE router logits (a matmul whose output
  is ranked by ``topk``) cast their inputs up to fp32, where range and accuracy matter;
- **everything else** follows its inputs by PyTorch's type promotion, as under autocast (a
  bf16 matmul output added to the fp32 residual stream gives fp32).

``overrides`` (node name or module path -> dtype word) move nodes between these classes;
a key that names nothing in the graph is an error.

>>> import torch, autopar
>>> from autopar.models.gpt import GPT, GPTConfig
>>> m = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16))
>>> idx = torch.randint(0, 32, (2, 8))
>>> a = assign_precision(autopar.trace(m, (idx, idx)), "bf16")
>>> sorted(set(a.nodes.values()))
['bf16', 'fp32']
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.graph_facts import META_KEY, NodeFacts
from autopar.core.knobs import PRECISIONS

WORDS = PRECISIONS
"""Compute dtypes a node may be given (fp8: matmul operands only; see module doc)."""

LOW_WORDS = ("bf16", "fp16", "fp8")

TORCH_DTYPES = MappingProxyType({
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
})
"""The torch dtype a value of each word is stored in (fp8 matmuls output bf16)."""

WORD_OF_DTYPE = MappingProxyType({
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
    "torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
    "torch.float64": "fp64",
})

def stored_word(word: str) -> str:
    """The word a value computed in ``word`` is stored in: an fp8 matmul writes bf16, and
    fp8 training keeps its other activations and working weights in bf16."""
    return "bf16" if word == "fp8" else word


BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "fp64": 8})
"""Bytes of one element a node of each word writes (an fp8 matmul writes bf16)."""

LOWERED_TARGETS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.matmul.default", "aten.baddbmm.default", "aten.addbmm.default",
    "aten.einsum.default", "aten.conv1d.default", "aten.conv2d.default",
    "aten.conv3d.default", "aten.convolution.default", "aten.conv_transpose1d.default",
    "aten.conv_transpose2d.default", "aten.conv_transpose3d.default",
    "aten.scaled_dot_product_attention.default",
    # grouped matmuls of MoE experts (torchtitan's and Hugging Face's run them in bf16)
    "aten._grouped_mm.default", "autopar.grouped_mm.default",
    "transformers.grouped_mm_fallback.default",
})
"""Ops torch.autocast runs in the low precision (its CUDA and CPU lower-precision lists),
and MoE experts' grouped matmuls."""

FP8_TARGETS = frozenset({"aten.linear.default"})
"""Ops fp8 training converts: the linear layers (torchao's ``Float8Linear`` swaps
``nn.Linear`` only; attention and other matmuls stay bf16)."""

FP8_ALIGNMENT = 16
"""fp8 GEMMs (``torch._scaled_mm``) need both matrix dims divisible by 16; torchao skips
other linears, and so does autopar."""

KEPT_FP32 = MappingProxyType({
    "aten.layer_norm.default": "normalisation", "aten.native_layer_norm.default":
    "normalisation", "aten.rms_norm.default": "normalisation",
    "aten.group_norm.default": "normalisation", "aten.batch_norm.default": "normalisation",
    "aten.instance_norm.default": "normalisation",
    "aten.softmax.int": "softmax", "aten._softmax.default": "softmax",
    "aten.log_softmax.int": "softmax", "aten._log_softmax.default": "softmax",
    "aten.cross_entropy_loss.default": "loss", "aten.nll_loss.default": "loss",
    "aten.nll_loss_nd.default": "loss", "aten.nll_loss_forward.default": "loss",
    "aten.mse_loss.default": "loss", "aten.l1_loss.default": "loss",
    "aten.smooth_l1_loss.default": "loss", "aten.huber_loss.default": "loss",
    "aten.kl_div.default": "loss", "aten.binary_cross_entropy.default": "loss",
    "aten.binary_cross_entropy_with_logits.default": "loss",
})
"""Op target -> why the default policy keeps it fp32 (autocast's fp32 list, plus the
normalisations and softmax it keeps fp32 on CUDA)."""

NORM_MODULE_SUFFIXES = ("Norm", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d",
                        "BatchNorm2d", "BatchNorm3d")
"""A module whose class name ends so is a normalisation, written out of elementwise ops
(HF's ``LlamaRMSNorm`` is ``pow``, ``mean``, ``rsqrt``, ``mul``): kept fp32."""

_CAST_TARGETS = frozenset({"aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default",
                           "aten.to.device", "aten.type_as.default"})
_ROUTER_HOPS = 4  # views/softmax between a router's matmul and its topk
_PASS_THROUGH = ("view", "reshape", "softmax", "_to_copy", "to.", "float", "sigmoid")


@dataclass(frozen=True)
class PrecisionAssignment:
    """The dtype of every floating node, and which nodes are made to compute in one.

    - ``compute``: the plan's precision word (``fp32`` means no casts at all);
    - ``nodes``: node name -> the word it computes in (every node that makes a float);
    - ``enforced``: node name -> the word its floating inputs are cast to (the casting pass
      inserts exactly these casts; every other node follows promotion);
    - ``kept_fp32``: node name -> why it stays fp32 (normalisation, softmax, loss, router,
      override);
    - ``stored``: node name -> the word its output is stored in (parameters included: fp32,
      or the low precision where ZeRO-3 gathers them so);
    - ``params``: the word parameters are read in;
    - ``cast_back``: node name -> the word its output is cast back to: a normalisation
      computes in fp32 and hands on its input's dtype (HF's ``.to(input_dtype)``,
      torchtitan's ``type_as``), so a 16-bit residual stream stays 16-bit.
    """

    compute: str
    nodes: Mapping[str, str]
    enforced: Mapping[str, str]
    kept_fp32: Mapping[str, str] = field(default_factory=dict)
    overrides: Mapping[str, str] = field(default_factory=dict)
    stored: Mapping[str, str] = field(default_factory=dict)
    params: str = "fp32"
    cast_back: Mapping[str, str] = field(default_factory=dict)

    def word(self, name: str) -> str:
        """The word node ``name`` computes in (fp32 when it makes no float)."""
        return self.nodes.get(name, "fp32")

    def bytes_per_element(self, name: str) -> int:
        """Bytes of one element node ``name`` writes (stores)."""
        return BYTES[self.stored.get(name, "fp32")]

    def counts(self) -> dict[str, int]:
        """Nodes per word."""
        return dict(Counter(self.nodes.values()))

    def policy(self) -> dict[str, object]:
        """The policy as plan data: what was lowered, what was kept fp32 and why."""
        return {"compute": self.compute, "source": "overrides" if self.overrides else "default",
                "params": self.params, "overrides": dict(self.overrides),
                "cast_back": dict(self.cast_back),
                "kept_fp32": {why: sorted(n for n, w in self.kept_fp32.items() if w == why)
                              for why in sorted(set(self.kept_fp32.values()))}}


def check_word(word: str, where: str) -> str:
    """``word`` if it names a compute dtype, else an error listing them."""
    if word not in WORDS:
        raise AutoparError(f"unknown precision {word!r}", where=where,
                           fix=f"use one of {', '.join(WORDS)}")
    return word


# MASTER_WEIGHTS (autopar.core.knobs): where the fp32 master weights live under mixed
# precision. ``optimizer`` -- the model computes with 16-bit parameters and the fp32 masters
# are the shards FSDP2 keeps (``MixedPrecisionPolicy``: ZeRO 1-3 gather the 16-bit working
# weights, reduce fp32 gradients and step the fp32 shards, as Megatron-LM's distributed
# optimizer does). ``params`` -- the parameters are fp32 and each is cast to 16 bits once a
# step (:mod:`autopar.ops.step_copies`). At ZeRO-0 both hold whole fp32 masters beside a
# 16-bit working weight and fp32 gradients (18 B per parameter with Adam), so ZeRO-0 always
# runs ``params``.


def params_word(compute: str, zero: int, master_weights: str = "optimizer") -> str:
    """The dtype the program reads parameters in: fp32 (cast once a step), except where
    FSDP2 gathers 16-bit working weights from fp32 shards (ZeRO-3; ZeRO 1-2 with the
    masters in the optimizer)."""
    if compute == "fp32" or zero == 0 or (zero < 3 and master_weights == "params"):
        return "fp32"
    return stored_word(compute)


def params_are_masters(params: str, zero: int) -> bool:
    """Are the stored parameters the fp32 masters themselves? Where the program reads them
    in fp32 (``params`` is :func:`params_word`'s), and under ZeRO-3, whose fp32 shards FSDP2
    keeps (it gathers 16-bit copies): then no separate master copy is counted."""
    return params == "fp32" or zero == 3


def assign_precision(gm: fx.GraphModule, compute: str,
                     overrides: Mapping[str, str] | None = None,
                     params: str = "fp32",
                     fused: frozenset[str] = frozenset()) -> PrecisionAssignment:
    """Give every node of ``gm`` a compute dtype under the default policy for ``compute``,
    with ``overrides`` (node name or module path -> word) applied on top; parameters are
    read in ``params`` (:func:`params_word`). ``fused``: nodes of attention chains one fused
    kernel runs; they take the kernel's operand dtype (it keeps its softmax statistics in
    fp32 itself, and never writes the chain's tensors)."""
    check_word(compute, "precision")
    overrides = dict(overrides or {})
    for key, word in overrides.items():
        check_word(word, f"precision_overrides[{key!r}]")
    matched = _override_targets(gm, overrides)
    enforced: dict[str, str] = {}
    kept: dict[str, str] = {}
    routers = _router_matmuls(gm) if compute != "fp32" else set()
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is None or node.op not in ("call_function", "call_method", "call_module"):
            continue
        word, why = _policy_word(node, facts, compute, routers)
        if node.name in fused and compute != "fp32":
            word, why = stored_word(compute), ""
        if node.name in matched:
            word, why = matched[node.name], "override"
        if word is None:
            continue
        enforced[node.name] = word
        if word == "fp32" and compute != "fp32":
            kept[node.name] = why
    outputs, affine = _norm_outputs(gm, kept) if compute != "fp32" else ({}, [])
    for name in affine:  # a norm's weight and bias apply in its input's dtype
        enforced.pop(name, None)
        kept.pop(name, None)
    nodes, stored, cast_back = _propagate(gm, enforced, params, outputs)
    if compute == "fp32" and not overrides:
        enforced = {}
    return PrecisionAssignment(compute, MappingProxyType(nodes), MappingProxyType(enforced),
                               MappingProxyType(kept), MappingProxyType(overrides),
                               MappingProxyType(stored), params, MappingProxyType(cast_back))


_AFFINE = ("aten.mul.Tensor", "aten.add.Tensor")


def _norm_outputs(gm: fx.GraphModule, kept: Mapping[str, str]
                  ) -> tuple[dict[str, str], list[str]]:
    """Where each kept-fp32 normalisation hands back its input's dtype: (node name -> name
    of the node whose dtype it takes, the affine steps after it). A norm module written out
    of ops (HF's ``LlamaRMSNorm``, torchtitan's) normalises in fp32, casts back, and applies
    its weight in the input's dtype: the cast goes before the trailing multiply/add by a
    parameter, which then follows promotion. A norm op of its own casts back its output."""
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is None or node.op == "get_attr":
            continue
        if facts.module_type.endswith(NORM_MODULE_SUFFIXES):  # every node of the module
            groups.setdefault(facts.module_path, []).append(node)
        elif kept.get(node.name) == "normalisation":  # a norm op of its own
            groups.setdefault(node.name, []).append(node)
    out: dict[str, str] = {}
    affine: list[str] = []
    for members in groups.values():
        inside = set(members)
        entry = next((a for n in members for a in n.all_input_nodes
                      if a not in inside and a.op != "get_attr"), None)
        last = members[-1]
        if kept.get(last.name) != "normalisation" or entry is None:
            continue  # computed as overridden: as it is
        if not any(u not in inside for u in last.users):
            continue
        node, tail = last, []
        while node in inside and (node.meta[META_KEY].target in _AFFINE
                                  or node.meta[META_KEY].target in _CAST_TARGETS):
            rest = [a for a in node.all_input_nodes if a.op != "get_attr"]
            if len(rest) != 1 or rest[0] not in inside:
                break
            tail.append(node.name)
            node = rest[0]
        if node is entry or node not in inside:
            node, tail = last, []
        out[node.name] = entry.name
        affine += tail
    return out, affine


def _policy_word(node: fx.Node, facts: NodeFacts, compute: str,
                 routers: set[str]) -> tuple[str | None, str]:
    """(the word the default policy makes ``node`` compute in, why), or (None, "") for a
    node that follows its inputs."""
    target = facts.target
    if target in _CAST_TARGETS:  # the model's own casts stay as written
        return None, ""
    if target in KEPT_FP32:
        return "fp32", KEPT_FP32[target]
    if facts.module_type.endswith(NORM_MODULE_SUFFIXES) and _makes_float(facts):
        return "fp32", "normalisation"
    if target in LOWERED_TARGETS:
        if node.name in routers:
            return "fp32", "router"
        if compute == "fp8":
            return ("fp8" if _fp8_linear(node, facts) else "bf16"), ""
        return compute, ""
    return None, ""


def _fp8_linear(node: fx.Node, facts: NodeFacts) -> bool:
    """A linear layer whose matmul fp8 can run: a 2-d weight with both dims aligned."""
    if facts.target not in FP8_TARGETS or len(node.args) < 2:
        return False
    weight = node.args[1]
    w_facts = weight.meta.get(META_KEY) if isinstance(weight, fx.Node) else None
    shape = w_facts.shapes[0] if w_facts is not None and w_facts.shapes else ()
    return len(shape) == 2 and all(d % FP8_ALIGNMENT == 0 for d in shape)


def _makes_float(facts: NodeFacts) -> bool:
    return any(_word(d) in ("fp32", "bf16", "fp16", "fp64") for d in facts.dtypes[:1])


def _word(dtype: str) -> str | None:
    return WORD_OF_DTYPE.get(str(dtype))


def _router_matmuls(gm: fx.GraphModule) -> set[str]:
    """Matmuls whose output a ``topk`` ranks within a few views or a softmax: MoE router
    logits, which the policy keeps fp32 (a bf16 logit flips which expert a token goes to)."""
    out = set()
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is None or "topk" not in facts.target:
            continue
        frontier, hops = [a for a in node.all_input_nodes], 0
        while frontier and hops < _ROUTER_HOPS:
            nxt = []
            for n in frontier:
                f = n.meta.get(META_KEY)
                if f is None:
                    continue
                if f.target in LOWERED_TARGETS:
                    out.add(n.name)
                elif any(p in f.target for p in _PASS_THROUGH):
                    nxt.extend(n.all_input_nodes)
            frontier, hops = nxt, hops + 1
    return out


def _override_targets(gm: fx.GraphModule, overrides: Mapping[str, str]) -> dict[str, str]:
    """Node name -> word for every override: a key is a node name or a module path (every
    node made inside that module); a key matching nothing is an error naming it."""
    if not overrides:
        return {}
    names = {n.name: n for n in gm.graph.nodes}
    paths: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is not None and facts.module_path and node.op != "get_attr":
            parts = facts.module_path.split(".")
            for i in range(1, len(parts) + 1):
                paths.setdefault(".".join(parts[:i]), []).append(node.name)
    out: dict[str, str] = {}
    for key, word in overrides.items():
        if key in names:
            out[key] = word
        elif key in paths:
            out.update(dict.fromkeys(paths[key], word))
        else:
            close = difflib.get_close_matches(key, [*names, *paths], n=3)
            raise AutoparError(
                f"precision override {key!r} names no node or module of the traced graph",
                where=f"precision_overrides[{key!r}]",
                fix=(f"did you mean {', '.join(map(repr, close))}? " if close else "")
                + "keys are fx node names (autopar plan --json lists them under "
                "'precision') or module paths such as 'model.layers.0.mlp'")
    return out


def _propagate(gm: fx.GraphModule, enforced: Mapping[str, str], params: str,
               hand_on: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str],
                                                    dict[str, str]]:
    """The word each float-making node computes in: its enforced word, else its inputs'
    promoted dtype (dimensioned tensors win over 0-d ones, as in PyTorch), else (no float
    input: an explicit cast, a factory, a parameter read) the dtype it was traced with.
    A node in ``hand_on`` stores its output in the dtype of the node it names (a norm's
    output cast back to its input's dtype); those that differ are returned too."""
    out: dict[str, str] = {}
    stored: dict[str, str] = {}  # node name -> the word its output is stored in
    cast_back: dict[str, str] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is None or not _makes_float(facts):
            continue
        traced = _word(facts.dtypes[0]) or "fp32"
        if node.name in enforced:
            word = enforced[node.name]
            stored[node.name] = stored_word(word)
        elif node.op == "get_attr" and traced in ("fp32", "bf16", "fp16"):
            buffer = facts.param is not None and facts.param.is_buffer
            word = stored[node.name] = traced if buffer else params
        elif facts.target in _CAST_TARGETS and (source := traced_noop_cast(node)) is not None:
            word = stored[node.name] = stored.get(source.name, traced)
        elif node.op == "placeholder" or facts.target in _CAST_TARGETS:
            word = stored[node.name] = traced
        else:
            word = stored[node.name] = _promote(node, stored) or traced
        if node.op not in ("placeholder", "get_attr", "output"):
            out[node.name] = word
        source = hand_on.get(node.name)
        if source is not None and stored.get(source, word) != stored[node.name]:
            stored[node.name] = cast_back[node.name] = stored[source]
    return out, stored, cast_back


def _promote(node: fx.Node, stored: Mapping[str, str]) -> str | None:
    """PyTorch's type promotion over the inputs' words (dimensioned tensors win over 0-d
    ones), with one exception: fp32 constants (no gradient flows to them: rotary tables,
    masks) meeting a 16-bit activation take the activation's dtype, as models write
    ``cos.to(x.dtype)`` -- the trace froze such casts at fp32, the dtype of everything then."""
    args = [a for a in node.all_input_nodes if a.name in stored]
    dims = [a for a in args if not _zero_dim(a)] or args
    words = {stored[a.name] for a in dims}
    if not words:
        return None
    if "fp64" in words:
        return "fp64"
    low = words - {"fp32"}
    constants = all(not a.meta[META_KEY].requires_grad for a in dims
                    if stored[a.name] == "fp32" and META_KEY in a.meta)
    if len(low) == 1 and ("fp32" not in words or constants):
        return low.pop()
    return "fp32"


def traced_noop_cast(node: fx.Node) -> fx.Node | None:
    """The input of a cast that changed nothing while tracing (a float cast to the dtype it
    had), else None. Everything is fp32 while tracing, so such a cast cannot say whether it
    meant "upcast" (``.float()``) or "to the input's dtype" (``.to(x.dtype)``); it follows
    its input, and the ops that need fp32 get it from the policy. (The trace also reuses
    such a cast's result wherever the uncast value was read: HF Llama's residual stream
    reads its norm's ``.to(torch.float32)``.)"""
    facts = node.meta.get(META_KEY)
    source = node.args[0] if node.args else None
    if facts is None or not isinstance(source, fx.Node) or META_KEY not in source.meta:
        return None
    before, after = source.meta[META_KEY].dtypes[:1], facts.dtypes[:1]
    if before and before == after and _word(after[0]) in ("fp32", "bf16", "fp16"):
        return source
    return None


def _zero_dim(node: fx.Node) -> bool:
    facts = node.meta.get(META_KEY)
    return facts is not None and bool(facts.shapes) and facts.shapes[0] == ()
