"""Where a model couples the samples of its batch, and whether splitting the batch stays exact.

Data parallelism and microbatching both run the graph on part of the batch. That equals
training on the whole batch only where every op treats samples independently, or reduces
over them linearly into the loss. The batch-axis placements (:mod:`.batch_axis`) say
where each value's batch dim is; an edge where a consumer needs something else than its
producer gives is a *coupling*:

- ``statistic``: a value reduced over the batch (``Partial``: a mean of router
  probabilities, tokens per expert) that a consumer needs whole (a product of two batch
  means in a balancing loss). Data parallelism makes it exact by an all-reduce
  (``passes/sync_batch_statistics``); microbatches of one step cannot (they run one after
  another), so it is exact only with one microbatch per data-parallel rank.
- ``input_statistic``: such a value computed from the batch's inputs alone (the count of
  labelled tokens a mean loss divides by): taken over the whole step before it runs
  (:mod:`autopar.analysis.step_statistics`), so it is exact under any split.
  A batch norm in training is one too: its statistics are taken over every data-parallel
  rank's samples (``sync_batch_norm``).
- ``mixes_batch``: an op that needs the samples of other ranks themselves (a cumulative sum
  or sort over the batch, a contrastive loss's similarity matrix): exact only when the
  batch is not split at all.

With ``batch_coupling="local"`` the planner splits anyway and each rank's statistics are its
own (what DDP and Megatron do); the plan names every coupled op either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.analysis.step_statistics import from_inputs
from autopar.core.graph_facts import META_KEY
from autopar.core.placements import Partial, Replicate, Shard
from autopar.core.values import tensor_inputs, value_of
from autopar.ops.local_ops import SYNC_BATCH_NORM
from autopar.strategies import Strategy


@dataclass(frozen=True)
class Coupling:
    """One op whose result depends on how the batch is split."""

    node: str
    op: str
    kind: str  # "statistic", "input_statistic" or "mixes_batch"
    where: str  # module path and source line, for messages

    def describe(self) -> str:
        return f"{self.node} ({self.op}{', ' + self.where if self.where else ''})"

    def to_json(self, exact: bool) -> dict:
        return {"node": self.node, "op": self.op, "kind": self.kind, "exact": exact,
                "where": self.where}


def batch_couplings(gm: fx.GraphModule, batch: dict[str, Strategy]) -> list[Coupling]:
    """Every coupling of ``gm`` under its batch-axis strategies ``batch``, in graph order."""
    found: list[Coupling] = []
    data = _batch_data(gm, batch)
    inputs_only: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        strategy = batch.get(node.name)
        if node.op != "call_function" or strategy is None:
            continue
        kinds = set()
        if strategy.local_impl == SYNC_BATCH_NORM:  # statistics taken over the whole batch
            kinds.add("statistic")
        for slot, a in enumerate(tensor_inputs(node)):
            producer, index = value_of(a)
            made = batch.get(producer.name)
            if made is None or index >= len(made.outputs):
                continue
            have, need = made.outputs[index], strategy.inputs[slot]
            if have == need or isinstance(have, Replicate) or producer not in data:
                # a slice of a whole tensor, a no-op view of it as partial, or a value the
                # same for every sample (positions expanded over the batch)
                continue
            if isinstance(have, Partial):
                if not isinstance(need, Partial):
                    kinds.add("input_statistic" if from_inputs(producer, inputs_only)
                              else "statistic")
            elif isinstance(have, Shard):
                kinds.add("mixes_batch")
        for kind in sorted(kinds):
            found.append(Coupling(node.name, _op_name(node), kind, _where(node)))
    return found


def _batch_data(gm: fx.GraphModule, batch: dict[str, Strategy]) -> set[fx.Node]:
    """Nodes whose value depends on the batch's inputs (an input split on the batch)."""
    data: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            s = batch.get(node.name)
            if s is not None and any(not isinstance(p, Replicate) for p in s.outputs):
                data.add(node)
        elif any(a in data for a in node.all_input_nodes):
            data.add(node)
    return data


def splitting(couplings: list[Coupling]) -> list[Coupling]:
    """The couplings that may make a split of the batch inexact (an input statistic never
    does)."""
    return [c for c in couplings if c.kind != "input_statistic"]


def splits_exactly(couplings: list[Coupling], dp: int, microbatches: int) -> bool:
    """Does running the batch as ``dp`` ranks x ``microbatches`` keep training exact?"""
    kinds = {c.kind for c in splitting(couplings)}
    if "mixes_batch" in kinds and dp * microbatches > 1:
        return False
    return not ("statistic" in kinds and microbatches > 1)


def coupling_exact(coupling: Coupling, dp: int, microbatches: int, mode: str) -> bool:
    """Does ``coupling`` stay exact when the batch runs as ``dp`` ranks x ``microbatches``
    under ``batch_coupling`` ``mode``? With "local" each part keeps its own statistics (an
    input statistic, the count of labelled tokens, is still taken over the whole step)."""
    if mode == "local" and coupling.kind != "input_statistic":
        return dp * microbatches == 1
    return splits_exactly([coupling], dp, microbatches)


def coupling_refusal(couplings: list[Coupling], dp: int, microbatches: int) -> str | None:
    """Why this split of the batch would train differently from the whole batch, or None."""
    if splits_exactly(couplings, dp, microbatches):
        return None
    if any(c.kind == "mixes_batch" for c in couplings) and dp * microbatches > 1:
        named = [c for c in couplings if c.kind == "mixes_batch"]
        how = f"dp={dp}" if dp > 1 else f"{microbatches} microbatches"
        return (f"{how} splits the batch, and {_names(named)} computes over the samples of "
                "the whole batch (each part would get its own result)")
    named = [c for c in couplings if c.kind == "statistic"]
    return (f"{microbatches} microbatches per data-parallel rank run one after another, and "
            f"{_names(named)} uses a statistic of the whole batch")


def _names(couplings: list[Coupling]) -> str:
    shown = ", ".join(c.describe() for c in couplings[:3])
    return shown + (f" and {len(couplings) - 3} more" if len(couplings) > 3 else "")


def _op_name(node: fx.Node) -> str:
    facts = node.meta.get(META_KEY)
    return facts.target if facts is not None else str(node.target)


def _where(node: fx.Node) -> str:
    facts = node.meta.get(META_KEY)
    if facts is None:
        return ""
    module = f"module '{facts.module_path}' ({facts.module_type})" if facts.module_path else ""
    return " at ".join(part for part in (module, facts.source) if part)
