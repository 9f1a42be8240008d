"""``autopar.plan``: trace (if needed) and solve, with no process group."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from autopar.cluster import Cluster, load_cluster
from autopar.errors import AutoparError, TraceError
from autopar.graph_facts import META_KEY, graph_facts
from autopar.knobs import check_keywords, zero_stages
from autopar.models.spec import SPEC_LIMITS
from autopar.plan import Plan
from autopar.solver.options import ZERO_STAGES_RUNNABLE, PlanOptions
from autopar.solver.search import search
from autopar.solver.to_plan import make_plan
from autopar.trace import trace


def default_precision(cluster: Cluster) -> str:
    """bf16 mixed precision on accelerators, fp32 on CPU (gloo) clusters."""
    return "fp32" if cluster.backend == "gloo" else "bf16"


def plan(
    model: nn.Module | fx.GraphModule,
    cluster: Cluster | str | Path,
    example_inputs: Any = None,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    global_batch: int | None = None,
    microbatch: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    zero: int | tuple[int, ...] = ZERO_STAGES_RUNNABLE,
    recompute: str | tuple[str, ...] = ("none", "selective", "full"),
    tp_splits_batch: bool | None = None,
    fuse_attention: bool = True,
    memory_fraction: float = 0.9,
    time_limit_s: float = 20.0,
    model_name: str | None = None,
    **old_spellings: Any,
) -> Plan:
    """Plan ``model`` for ``cluster`` without starting any process.

    ``model`` is a module (traced with ``example_inputs``, which may be TensorSpecs) or a
    GraphModule from :func:`autopar.trace`. ``cluster`` is a Cluster, a shorthand such as
    ``"8xH100-80GB"`` or ``"2xcpu"``, or a YAML/JSON file. ``dp``/``tp``/``pp``,
    ``microbatch`` (size) or ``microbatches`` (count), ``schedule`` ("gpipe", "1f1b",
    "interleaved", "zb_v"), ``virtual_stages`` (chunks per pipeline rank) and ``zero`` (a
    ZeRO stage, or a tuple of stages to choose from) pin what they name; the solver chooses
    the rest. Keyword names are those of :mod:`autopar.knobs`. A pinned ``tp`` is Megatron's
    tensor parallelism: it does not split the batch unless ``tp_splits_batch=True``; the
    plan says how tp is used and, if it shards no weight, why (``plan.explanation``).

    >>> import torch, autopar
    >>> from autopar.models import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    >>> idx = torch.randint(0, 64, (4, 16))
    >>> autopar.plan(gpt, "2xcpu", (idx, idx), dp=2).mesh
    {'dp': 2, 'tp': 1}
    """
    if old_spellings:
        given = locals()
        explicit = [k for k in PLAN_KEYWORDS if given[k] is not _DEFAULTS[k]]
        given.update(check_keywords(old_spellings, PLAN_KEYWORDS, "autopar.plan", explicit))
        virtual_stages, precision, zero = (given["virtual_stages"], given["precision"],
                                           given["zero"])
    if not isinstance(model, nn.Module):
        raise AutoparError(
            f"autopar.plan() plans an nn.Module, got {type(model).__name__}",
            where="autopar.plan(model=...)",
            fix="pass the model object (or a graph from autopar.trace); for a model name such "
            "as 'gpt2', use `autopar plan gpt2 --cluster ...` or autopar.models.resolve_model",
        )
    cluster = load_cluster(cluster)
    gm = model if isinstance(model, fx.GraphModule) and META_KEY in model.meta else None
    if gm is None:
        gm = trace(model, example_inputs)
    check_returns_loss(gm)
    check_batch_size(global_batch or graph_facts(gm).batch_size or 1)
    options = PlanOptions(
        global_batch=global_batch,
        dp=dp,
        tp=tp,
        pp=pp,
        microbatch=microbatch,
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        precision=precision or default_precision(cluster),
        optimizer=optimizer,
        zero=zero_stages(zero),
        recompute=(recompute,) if isinstance(recompute, str) else tuple(recompute),
        tp_splits_batch=tp_splits_batch,
        fuse_attention=fuse_attention,
        memory_fraction=memory_fraction,
        time_limit_s=time_limit_s,
    )
    result = search(gm, cluster, options)
    name = model_name or type(model).__name__
    return make_plan(gm, result, cluster, options, name)


def check_batch_size(batch: int) -> None:
    """The search tries the batch's divisors as microbatch sizes: bound it (as model specs
    are bounded) so that a stray 10**12 fails at once instead of searching for hours."""
    limit = SPEC_LIMITS["batch"]
    if isinstance(batch, int) and batch > limit:
        raise AutoparError(f"global batch {batch} is above autopar's limit of {limit} sequences",
                           where="global_batch (or the example inputs' batch)",
                           fix=f"plan for at most {limit} sequences per step")


def check_returns_loss(gm: fx.GraphModule) -> None:
    """Training needs a scalar loss among the outputs (a 0-dim floating tensor: alone, in a
    tuple or dict, or as ``.loss``); refuse now rather than plan a step that cannot run."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    shown = []
    for value in tree_leaves(output.args):
        val = value.meta.get("val") if isinstance(value, fx.Node) else value
        if isinstance(val, torch.Tensor):
            if val.ndim == 0 and val.is_floating_point():
                return
            shown.append(f"{str(val.dtype).removeprefix('torch.')} tensor {tuple(val.shape)}")
        else:
            shown.append(repr(val) if val is None or isinstance(val, (int, float)) else
                         type(val).__name__)
    raise TraceError(
        f"the model returns no scalar loss to train on; its outputs are: "
        f"{', '.join(shown) or 'nothing'}",
        where="model.forward outputs",
        fix="make forward compute and return the loss as a 0-dim float tensor (alone, in a "
        "tuple, or as .loss), e.g. pass the targets too: model(tokens, targets) returning "
        "(logits, F.cross_entropy(...)); for Hugging Face models pass labels=",
    )


PLAN_KEYWORDS = tuple(name for name, p in inspect.signature(plan).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY)
"""The keywords ``autopar.plan`` takes (``parallelize`` passes them through)."""
_DEFAULTS = {name: p.default for name, p in inspect.signature(plan).parameters.items()}
