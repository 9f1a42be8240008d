"""Facts about a traced graph that every later stage reads: shapes, FLOPs, bytes, owners.

The tracer stores a :class:`NodeFacts` in ``node.meta["autopar"]`` for every node and a
:class:`GraphFacts` in ``graph_module.meta["autopar"]``. Cost models, strategies, the solver
and the passes read these and never re-run the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

META_KEY = "autopar"


@dataclass(frozen=True)
class ParamFacts:
    """A parameter or buffer that a ``get_attr`` node reads."""

    fqn: str  # fully qualified name in the original model, e.g. "model.layers.0.mlp.up_proj.weight"
    shape: tuple[int, ...]
    dtype: str
    trainable: bool  # False for frozen parameters and for buffers
    is_buffer: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class NodeFacts:
    """What is known of one fx node. Byte and FLOP counts are for the whole (global) tensor.

    ``saved_inputs`` are the positions (in flattened tensor-input order, as strategies count
    them) of the inputs autograd keeps for this node's backward; ``saves_output`` says whether
    it keeps its own output; ``extra_saved_bytes`` counts buffers it keeps that are neither
    (dropout masks, softmax statistics, log-sum-exps).
    """

    name: str
    op: str
    target: str
    shapes: tuple[tuple[int, ...], ...] = ()  # one per tensor output
    dtypes: tuple[str, ...] = ()
    fwd_flops: int = 0
    bwd_flops: int = 0
    # what autograd's backward of this op runs, measured on fake tensors: bytes its kernels
    # move (None: not measured) and how many kernels
    bwd_bytes: int | None = None
    bwd_kernels: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    is_view: bool = False
    requires_grad: bool = False  # the output depends on a trainable parameter
    saved_inputs: tuple[int, ...] = ()
    saves_output: bool = False
    extra_saved_bytes: int = 0
    extra_saved_float_numel: int = 0  # of which floating point (kept in the compute dtype)
    extra_saved_other_bytes: int = 0  # of which not floating point (masks, indices)
    param: ParamFacts | None = None  # for get_attr nodes of parameters and buffers
    params: tuple[str, ...] = ()  # FQNs of the parameters this node reads directly
    module_path: str = ""
    module_type: str = ""
    source: str = ""  # "file.py:line" of the user code that made this node
    block: str | None = None  # the repeated-block container, e.g. "model.layers"
    layer: int | None = None  # index of the repeated block this node belongs to
    position: int | None = None  # position of the node inside its block (same for every layer)

    @property
    def out_bytes(self) -> int:
        return self.bytes_written


@dataclass
class BlockFacts:
    """A container of repeated blocks (e.g. ``model.layers``) and which layers share a shape."""

    container: str
    layers: tuple[int, ...]
    # layer index -> signature id; layers with the same id are structurally identical, and
    # the solver gives them one set of decision variables.
    signature_of: dict[int, int] = field(default_factory=dict)


@dataclass
class GraphFacts:
    """Model-level facts: parameter count, fingerprint, repeated blocks, how it was traced."""

    params: int  # total parameters (trainable and frozen)
    trainable_params: int
    fingerprint: str  # stable hash of the graph structure and shapes (plans record it)
    blocks: list[BlockFacts]
    tracer: str  # "torch.export" or "symbolic_trace"
    input_names: tuple[str, ...]
    batch_size: int | None  # size of the batch dim of the inputs, when one was found
    seq_len: int | None
    tokens: int | None  # tokens per step (batch x sequence), for throughput
    fwd_flops: int = 0
    bwd_flops: int = 0


def graph_facts(gm: fx.GraphModule) -> GraphFacts:
    facts = gm.meta.get(META_KEY)
    if facts is None:
        raise KeyError("graph has no autopar facts; trace it with autopar.trace first")
    return facts
