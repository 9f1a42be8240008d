"""The plan JSON schema: a table of every field and its rule, then the cross-field rules.

Plans are written by ``autopar plan --json`` and read back by ``emit``, ``parallelize`` and
the runtime; a hand edit must never reach them as a ``KeyError`` or as silently wrong
training. :func:`validate` checks a parsed plan (plain JSON data, nothing is executed) and
raises :class:`PlanError` whose ``where`` is the field's path (``batch.microbatch``,
``pipeline.chunks[2].layers``).

The field table is :mod:`autopar.core.plan_fields` (written in the rules of
:mod:`autopar.core.plan_checks`); this module holds the cross-field rules and
:func:`validate`, which runs both.

Cross-field rules, under the conventions :mod:`autopar.solver.explain.to_plan` writes:

- the mesh is ``[pp,] dp, tp`` in that order (tp innermost) and its product is
  ``cluster.devices`` (= nodes x devices per node), or fewer devices when
  ``explanation.devices.used`` says so (whole nodes, or part of one node: the first ranks);
- ``batch.global = dp x batch.microbatch x batch.microbatches``: ``microbatch`` is the
  sequences of one microbatch on one data-parallel rank (tensor parallelism may split it
  further, but never changes the count);
- with ``pp > 1`` the pipeline section is present: its microbatches are the batch's, at
  least pp of them (any number for ``gpipe``, a multiple of pp for ``interleaved``); ``virtual_stages`` is 1 for
  gpipe/1f1b, 2 for zb_v and at least 2 for interleaved; ``pp x virtual_stages`` chunks cut
  the layers contiguously from layer 0, each on the rank ``torch.distributed.pipelining``
  runs it on; one stage entry per pipeline rank. Without pp the section is empty.
"""

from __future__ import annotations

import math
from typing import Any

from autopar.core.errors import PlanError
from autopar.core.knobs import rank_of_chunk
from autopar.core.plan_checks import REPLAN, fail, show
from autopar.core.plan_fields import PLAN, SCHEMA_VERSION

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
"""Axes the runtime builds, outer to inner (tp innermost: the fastest links)."""
# ``ep`` (expert parallelism) is carved out of ``dp``: it divides dp and adds no ranks.
CARVED_AXES = ("ep",)


# --- cross-field rules ---------------------------------------------------------------------
def _mesh_rules(plan: dict) -> None:
    mesh, cluster = plan["mesh"], plan["cluster"]
    order = [a for a in MESH_AXES if a in mesh]
    if list(mesh) != order:
        fail("mesh", f"ordered {', '.join(order)} (outer to inner)", list(mesh))
    devices = cluster["nodes"] * cluster["devices_per_node"]
    if cluster["devices"] != devices:
        fail("cluster.devices", f"nodes x devices_per_node = {devices}", cluster["devices"])
    product = math.prod(n for a, n in mesh.items() if a not in CARVED_AXES)
    if mesh.get("ep", 1) > 1 and mesh["dp"] % mesh["ep"]:
        fail("mesh.ep", f"a divisor of mesh.dp ({mesh['dp']}): experts are spread over part "
             "of the data-parallel ranks", mesh["ep"])
    used = plan.get("explanation", {}).get("devices")
    if used is not None and (used["cluster"] != devices or used["used"] != product):
        fail("explanation.devices", f"used = the mesh's {product} ranks and cluster = "
             f"cluster.devices ({devices})", {k: used[k] for k in ("used", "cluster")})
    per_node = cluster["devices_per_node"]
    fewer = used is not None and product < devices and (
        product <= per_node or product % per_node == 0)  # part of one node, or whole nodes
    if product != devices and not fewer:
        text_ = " x ".join(f"{a}={n}" for a, n in mesh.items())
        raise PlanError(f"the mesh {text_} has {product} ranks, but the plan's cluster "
                        f"{cluster.get('name')!r} has {devices} devices"
                        + ("" if used is None or product > devices else
                           " and they are neither whole nodes nor part of one node"),
                        where="mesh", fix=REPLAN)


def _batch_rules(plan: dict) -> None:
    b, dp = plan["batch"], plan["mesh"]["dp"]
    if b["global"] == dp * b["microbatch"] * b["microbatches"]:
        return
    if b["global"] % dp:
        where = "batch.global"
    elif (b["global"] // dp) % b["microbatch"]:
        where = "batch.microbatch"
    else:
        where = "batch.microbatches"
    raise PlanError(
        f"batch.global {b['global']} is not dp {dp} x batch.microbatch {b['microbatch']} "
        f"x batch.microbatches {b['microbatches']}", where=where,
        fix="each data-parallel rank runs global / dp sequences as microbatches of "
        f"microbatch sequences; {REPLAN}")


def _pipeline_rules(plan: dict) -> None:
    pipe, pp = plan.get("pipeline", {}), plan["mesh"].get("pp", 1)
    if pp == 1:
        if pipe:
            fail("pipeline", "empty ({}) without a pp axis in the mesh", "a pipeline")
        return
    if not pipe:
        raise PlanError(f"the mesh has pp={pp} but the plan has no pipeline section",
                        where="pipeline", fix=REPLAN)
    m, v, schedule = pipe["microbatches"], pipe["virtual_stages"], pipe["schedule"]
    if m != plan["batch"]["microbatches"]:
        fail("pipeline.microbatches", f"batch.microbatches ({plan['batch']['microbatches']})", m)
    if (m < pp and schedule != "gpipe") or (schedule == "interleaved" and m % pp):
        what = "a multiple of" if schedule == "interleaved" else "at least"
        fail("batch.microbatches", f"{what} pp={pp} (schedule {schedule})", m)
    allowed = {"gpipe": (1,), "1f1b": (1,), "zb_v": (2,)}.get(schedule)
    if (v not in allowed) if allowed else v < 2:
        fail("pipeline.virtual_stages", f"{allowed[0] if allowed else 'at least 2'} for "
             f"schedule {schedule}", v)
    chunks = pipe["chunks"]
    if len(chunks) != pp * v:
        fail("pipeline.chunks", f"{pp * v} chunks (pp {pp} x virtual_stages {v})",
             f"{len(chunks)} chunks")
    first = 0
    for c, chunk in enumerate(chunks):
        at = f"pipeline.chunks[{c}]"
        if chunk["chunk"] != c:
            fail(f"{at}.chunk", str(c), chunk["chunk"])
        if chunk["rank"] != rank_of_chunk(c, pp, schedule):
            fail(f"{at}.rank", f"{rank_of_chunk(c, pp, schedule)} (where {schedule} runs "
                 f"chunk {c})", chunk["rank"])
        lo, hi = chunk["layers"]
        if lo != first or hi < lo:
            fail(f"{at}.layers", f"[{first}, last >= {first}] (chunks cut the layers "
                 "contiguously, in order)", chunk["layers"])
        first = hi + 1
    ranks = [s["rank"] for s in pipe["stages"]]
    if ranks != list(range(pp)):
        fail("pipeline.stages", f"one entry per pipeline rank 0-{pp - 1}, in order", ranks)


def _count_rules(plan: dict) -> None:
    model = plan["model"]
    if model["trainable_params"] > model["params"]:
        fail("model.trainable_params", f"at most model.params ({model['params']})",
             model["trainable_params"])


def _recompute_rules(plan: dict) -> None:
    """``recompute_layers`` is there exactly when ``recompute`` is "mixed"."""
    training = plan["training"]
    mixed = training["recompute"] == "mixed"
    if mixed != ("recompute_layers" in training):
        fail("training.recompute_layers", "a mode per layer exactly when training.recompute "
             "is 'mixed'", training.get("recompute_layers"))


def _precision_rules(plan: dict) -> None:
    """Per-node precision names nodes of the plan, and follows ``training.precision``."""
    words, policy = plan.get("precision", {}), plan.get("precision_policy", {})
    unknown = [name for name in words if name not in plan["strategies"]]
    if unknown:
        fail(f"precision.{unknown[0]}", "a node of the plan (a key of strategies)",
             unknown[0])
    compute = plan["training"]["precision"]
    if policy and policy["compute"] != compute:
        fail("precision_policy.compute", f"training.precision ({compute})", policy["compute"])
    if compute == "fp32" and any(w != "fp32" for w in words.values()) and not (
            policy and policy["overrides"]):
        fail("precision", "fp32 everywhere under training.precision fp32 (no overrides)",
             sorted(set(words.values())))


def _offload_rules(plan: dict) -> None:
    """Offload moves ZeRO-3's shards: it needs ZeRO-3 and more than one data-parallel rank."""
    training, mesh = plan["training"], plan["mesh"]
    if training.get("offload", "none") == "none":
        return
    if training["zero"] != 3 or mesh["dp"] * mesh.get("cp", 1) < 2:
        fail("training.offload", "used only with ZeRO-3 over 2 or more data-parallel ranks "
             f"(this plan: ZeRO-{training['zero']}, dp={mesh['dp']})", training["offload"])


def _hsdp_rules(plan: dict) -> None:
    """HSDP splits dp into replica groups that ZeRO shards within: dp_replicate divides dp,
    under ZeRO 1-3 and without experts."""
    training, mesh = plan["training"], plan["mesh"]
    replicate = training.get("dp_replicate", 1)
    if replicate == 1:
        return
    if mesh["dp"] % replicate or training["zero"] == 0 or mesh.get("ep", 1) > 1:
        fail("training.dp_replicate", "a divisor of mesh.dp (groups that ZeRO 1-3 shards "
             f"within; no ep) (this plan: dp={mesh['dp']}, ZeRO-{training['zero']}, "
             f"ep={mesh.get('ep', 1)})", replicate)


CROSS_FIELD_RULES = (_mesh_rules, _batch_rules, _pipeline_rules, _count_rules,
                     _precision_rules, _recompute_rules, _offload_rules, _hsdp_rules)


def validate(data: Any, source: str = "plan") -> None:
    """Raise PlanError (its message starting with ``source``) unless ``data`` is a plan
    this autopar writes and runs."""
    try:
        if not isinstance(data, dict):
            fail("the plan", "a JSON object", data, fix="pass a plan file written by "
                 "autopar plan --json")
        version = data.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise PlanError(f"schema version {show(version)}; this autopar reads version "
                            f"{SCHEMA_VERSION}", where="schema_version", fix=REPLAN)
        PLAN(data, "")
        for rule in CROSS_FIELD_RULES:
            rule(data)
    except PlanError as e:
        raise PlanError(f"{source}: {e.what}", where=e.where, fix=e.fix) from None
