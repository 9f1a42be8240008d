"""The plan JSON schema: a table of every field and its rule, then the cross-field rules.

Plans are written by ``autopar plan --json`` and read back by ``emit``, ``parallelize`` and
the runtime; a hand edit must never reach them as a ``KeyError`` or as silently wrong
training. :func:`validate` checks a parsed plan (plain JSON data, nothing is executed) and
raises :class:`PlanError` whose ``where`` is the field's path (``batch.microbatch``,
``pipeline.chunks[2].layers``).

Sections the runtime acts on are closed (an unknown key is an error); the descriptive
ones that other parts of autopar extend (the modelled memory breakdown, the solver's
candidate log) accept added keys holding plain numbers or text. The cluster is checked by
the cluster loader itself, so both read the same rules.

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

import difflib
import math
import reprlib
from collections.abc import Callable
from typing import Any, NoReturn

from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError, PlanError
from autopar.core.knobs import (
    BATCH_COUPLING_MODES,
    CP_ALGORITHMS,
    CP_LAYOUTS,
    LOCAL_IMPL_NAMES,
    OFFLOADS_RUNNABLE,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    ZERO_STAGES_RUNNABLE,
    rank_of_chunk,
)
from autopar.core.placements import parse_placement

SCHEMA_VERSION = 6
MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
# ``ep`` (expert parallelism) is carved out of ``dp``: it divides dp and adds no ranks.
CARVED_AXES = ("ep",)
"""Axes the runtime builds, outer to inner (tp innermost: the fastest links)."""
MAX_INT = 2**53  # JSON numbers beyond this are not exact in most readers
MAX_DIM = 64  # tensor dimensions a Shard placement may name
REPLAN = "re-plan with autopar plan MODEL --cluster ... --json FILE rather than editing a plan"

Check = Callable[[Any, str], None]
"""A rule: raises PlanError naming ``where`` unless the value satisfies it."""


def _show(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


def _fail(where: str, expected: str, value: Any, fix: str = REPLAN) -> NoReturn:
    raise PlanError(f"{where} must be {expected}, got {_show(value)}", where=where, fix=fix)


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


# --- field rules ---------------------------------------------------------------------------
def _range(kind: str, lo: float, hi: float, limit: float) -> str:
    if hi < limit:
        return f"{kind} from {lo:g} to {hi:g}"
    return {0: f"{kind} >= 0", 1: f"a positive {kind.split()[-1]}"}.get(lo, f"{kind} >= {lo:g}")


def integer(lo: int = 0, hi: int = MAX_INT, fix: str = REPLAN) -> Check:
    def check(value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            expected = _range("an integer", lo, hi, MAX_INT)
            if isinstance(value, int) and value > hi:
                expected += f" and at most {hi:,}"
            _fail(where, expected, value, fix)
    return check


def number(lo: float = 0.0, hi: float = math.inf) -> Check:
    def check(value: Any, where: str) -> None:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or not lo <= value <= hi):
            _fail(where, _range("a finite number", lo, hi, math.inf), value)
    return check


def text(empty: bool = False) -> Check:
    def check(value: Any, where: str) -> None:
        if isinstance(value, str) and (empty or value.strip()):
            try:
                value.encode("utf-8")  # a lone surrogate ("\ud800") cannot be printed
                return
            except UnicodeEncodeError:
                pass
        _fail(where, "a string" if empty else "a non-empty string", value)
    return check


def one_of(values: tuple, fix: str = REPLAN) -> Check:
    def check(value: Any, where: str) -> None:
        if not any(type(value) is type(v) and value == v for v in values):  # 3.0 is not 3
            _fail(where, f"one of {', '.join(map(repr, values))}", value, fix)
    return check


def flag(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        _fail(where, "true or false", value)


def nullable(rule: Check) -> Check:
    def check(value: Any, where: str) -> None:
        if value is not None:
            rule(value, where)
    return check


def plain(value: Any, where: str) -> None:
    """Text, a flag, null, a finite number, or a list of them (descriptive entries)."""
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        at = f"{where}[{i}]" if isinstance(value, list) else where
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            text(empty=True)(item, at)
        else:
            number(-math.inf)(item, at)


def list_of(rule: Check, length: int | None = None) -> Check:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, list):
            _fail(where, "a list", value)
        if length is not None and len(value) != length:
            _fail(where, f"a list of {length} items", value)
        for i, item in enumerate(value):
            rule(item, f"{where}[{i}]")
    return check


def map_of(rule: Check) -> Check:
    """An object from names (node names, parameter FQNs) to ``rule``."""
    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for key, item in value.items():
            text()(key, f"{where} key")
            rule(item, _at(where, key))
    return check


def obj(required: dict[str, Check], optional: dict[str, Check] | None = None,
        extra: Check | None = None) -> Check:
    """An object with ``required`` keys, maybe ``optional`` ones, and other keys only when
    ``extra`` says what they hold."""
    optional = optional or {}

    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, "a JSON object", value)
        for key, rule in required.items():
            if key not in value:
                at = _at(where, key)
                raise PlanError(f"the plan lacks field {at!r}", where=at, fix=REPLAN)
            rule(value[key], _at(where, key))
        for key, item in value.items():
            if key in required:
                continue
            rule = optional.get(key, extra)
            if rule is None:
                known = [*required, *optional]
                close = difflib.get_close_matches(str(key), known, n=1)
                raise PlanError(
                    f"unknown field {_at(where, str(key))!r} in the plan",
                    where=_at(where, str(key)),
                    fix=(f"did you mean {close[0]!r}? " if close else "")
                    + f"fields here: {', '.join(known)}; {REPLAN}")
            text()(key, f"{where} key")
            rule(item, _at(where, key))
    return check


def placement(value: Any, where: str) -> None:
    """A placement in the canonical form ``str(placement)`` writes (R, P, S(0), S(2)g3)."""
    expected = "a placement: R, P, P(avg), S(dim) or S(dim)gK"
    if not isinstance(value, str) or len(value) > 32:
        _fail(where, expected, value)
    try:
        parsed = parse_placement(value)
        ok = str(parsed) == value and getattr(parsed, "dim", 0) < MAX_DIM
    except (AutoparError, ValueError):
        ok = False
    if not ok:
        _fail(where, expected, value)


def empty_or(rule: Check) -> Check:
    def check(value: Any, where: str) -> None:
        if value != {}:
            rule(value, where)
    return check


def anything(value: Any, where: str) -> None:
    """Checked elsewhere (the cluster's other fields, by the cluster loader)."""


CLUSTER = obj({"name": text(empty=True), "nodes": integer(1), "devices_per_node": integer(1),
               "backend": text(), "device": obj({"name": text()}, extra=anything),
               "devices": integer(1)}, extra=anything)


def cluster_entry(value: Any, where: str) -> None:
    """The resolved cluster the plan was made for (what ``Cluster.to_dict`` writes, plus
    ``devices``), checked by the cluster loader itself."""
    CLUSTER(value, where)
    if "profile" in value:
        _fail(f"{where}.profile", "absent (a plan records the resolved cluster)",
              value["profile"])
    try:
        load_cluster({k: v for k, v in value.items() if k != "devices"})
    except AutoparError as e:
        raise PlanError(f"in {where}: {e.what}", where=_at(where, e.where or ""), fix=REPLAN
                        ) from None


COUNT = integer(1)
SIZE = integer(0)
SECONDS = number()
# autopar.solver.model.cpsat.solve_stats: one CP-SAT solve (objective and bound in ``unit``)
SOLVE = obj({"what": text(), "status": text(), "objective": nullable(number(-math.inf)),
             "bound": nullable(number(-math.inf)), "unit": text(),
             "gap": nullable(number(0.0, 1.0)), "wall_s": SECONDS,
             "time_limit_s": nullable(SECONDS), "outcome": text()}, {"reused": flag})
MEMORY = obj({"total": SIZE}, extra=SIZE)
STRATEGY = obj({"in": list_of(placement), "out": list_of(placement)},
               {"impl": one_of(LOCAL_IMPL_NAMES)})

PIPELINE = obj({
    "label": text(),
    "schedule": one_of(SCHEDULES),
    "virtual_stages": COUNT,
    "microbatches": COUNT,
    "bubble_fraction": number(0, 1),
    "bubble_s": SECONDS,
    "p2p_s": SECONDS,
    "chunks": list_of(obj({"chunk": SIZE, "rank": SIZE, "layers": list_of(SIZE, length=2)})),
    "stages": list_of(obj({
        "rank": SIZE, "layers": text(empty=True), "forward_s": SECONDS, "backward_s": SECONDS,
        "tp_comm_s": SECONDS, "p2p_s": SECONDS, "time_per_microbatch_s": SECONDS,
        "in_flight": number(), "memory_bytes": SIZE, "memory": MEMORY,
    })),
})

EXPLANATION = obj({}, {
    # autopar.api.planning: how many of the cluster's devices the plan uses (the mesh's), and why
    "devices": obj({"used": COUNT, "cluster": COUNT, "pinned": flag, "why": text()},
                   {"alternatives": list_of(obj(
                       {"devices": COUNT, "step_time_s": nullable(SECONDS), "status": text()},
                       {"mesh": map_of(COUNT)}))}),
    # autopar.solver.explain.explain_tp: how the plan uses tensor parallelism, and why
    "tp": empty_or(obj({
        "tp": COUNT, "pinned": flag, "splits_batch_allowed": flag, "weights_sharded": SIZE,
        "weights": SIZE, "weight_bytes_sharded": number(0, 1), "work_split": number(0, 1),
        "batch_split_work": number(0, 1), "unexpected": list_of(text()),
        "why": text(empty=True),
    }, {"alternatives": list_of(obj(
        {"what": text(), "step_time_s": nullable(SECONDS)},
        {"status": text(empty=True), "peak_memory_bytes": SIZE, "mesh": map_of(COUNT)}))})),
    # autopar.solver.explain.explain_experts: the MoE layers, how their experts are spread, and the
    # modelled token all-to-all
    "experts": obj({"layers": COUNT, "experts": plain, "ep": COUNT, "per_rank": plain,
                    "all_to_all_bytes_per_step": SIZE, "all_to_all_s": SECONDS,
                    "why": text()},
                   # cost_models.expert_load: imbalance by chance, capacity drops (modelled)
                   {"load": obj({"basis": text(), "busiest_rank_excess": number()},
                                {"capacity_slots": COUNT,
                                 "dropped_fraction": number(0, 1)})}),
})

CONTEXT = obj({
    "label": text(), "cp": COUNT, "algorithm": one_of(CP_ALGORITHMS),
    "layout": one_of(CP_LAYOUTS), "pinned": flag,
    "algorithms": map_of(obj({"status": text()}, {"comm_s": SECONDS})), "why": text(),
})

PLAN = obj(
    required={
        "schema_version": one_of((SCHEMA_VERSION,)),
        "model": obj({"name": text(), "fingerprint": text(), "params": SIZE,
                      "trainable_params": SIZE}, {"tracer": text()}),
        "cluster": cluster_entry,
        "mesh": obj({"dp": COUNT, "tp": COUNT}, {"pp": COUNT, "ep": COUNT, "cp": COUNT}),
        "batch": obj({"global": COUNT, "microbatch": COUNT, "microbatches": COUNT,
                      "seq": COUNT, "traced": COUNT}),
        "training": obj({
            "precision": one_of(PRECISIONS),
            "optimizer": one_of(OPTIMIZERS),
            "zero": one_of(ZERO_STAGES_RUNNABLE, fix="the runtime executes ZeRO stages "
                           f"{' and '.join(map(str, ZERO_STAGES_RUNNABLE))} (DDP, FSDP2); "
                           "re-plan with --zero 0,3"),
            "recompute": one_of((*RECOMPUTE_MODES, "mixed")),
        }, {"chunked_loss": one_of((True, False)),
            "batch_coupling": one_of(BATCH_COUPLING_MODES),
            # with recompute "mixed": each repeated layer's mode, in the order they run
            "recompute_layers": list_of(one_of(RECOMPUTE_MODES)),
            # "optimizer+params": ZeRO-3's shards in host memory (FSDP2's CPUOffloadPolicy)
            "offload": one_of(OFFLOADS_RUNNABLE),
            # HSDP: ZeRO shards within dp/dp_replicate ranks, replicated across the groups
            "dp_replicate": COUNT}),
        "strategies": map_of(obj({"dp": STRATEGY, "tp": STRATEGY}, {"cp": STRATEGY})),
        "params": map_of(obj({"dp": placement, "tp": placement},
                             {"cp": placement, "ep": placement})),
        "predicted": obj({
            "label": text(), "step_time_s": SECONDS, "peak_memory_bytes": SIZE,
            "tflops_per_device": number(), "tokens_per_s": number(), "mfu": number(),
            "model_flops_per_step": number(), "memory": MEMORY, "memory_capacity_bytes": COUNT,
            "compute_s": SECONDS, "tp_comm_s": SECONDS, "dp_comm_s": SECONDS,
            "dp_exposed_s": SECONDS, "bubble_s": SECONDS, "p2p_s": SECONDS,
            "optimizer_s": SECONDS,
        }, {
            # autopar.cost_models.ground: was the cost model checked where this plan runs?
            "ground": list_of(obj(
                {"scheme": text(), "degree": COUNT, "validated": flag, "text": text()},
                {"sources": list_of(text()), "validated_up_to": COUNT,
                 "median_error": number(), "worst_error": number(),
                 "median_signed_error": number(-1.0), "lowest_signed_error": number(-1.0)})),
            "ground_margin": number(),
            # bytes at each peak of the step: forward_end, backward_start, optimizer_step
            "memory_phases": map_of(SIZE),
        }),
        "solver": obj({"status": text(), "wall_s": SECONDS, "decisions": SIZE, "nodes": SIZE,
                       "candidates": list_of(obj({}, {"solve_stats": list_of(SOLVE)},
                                                 extra=plain))},
                      {"solves": SIZE, "max_solves": nullable(COUNT), "budget_reached": flag,
                       # autopar.solver.explain.to_plan.optimality: the solves that chose this plan
                       "plan_solves": list_of(SOLVE), "proved_optimal": flag,
                       "gap": nullable(number(0.0, 1.0)), "interrupted": flag}),
    },
    optional={
        "layers": list_of(obj({"block": text(), "layers": text(),
                               "strategies": map_of(text())},
                              {"recompute": one_of(RECOMPUTE_MODES)})),
        "pipeline": empty_or(PIPELINE),
        "unruled_ops": map_of(COUNT),
        "explanation": EXPLANATION,
        "attention": list_of(obj({"node": text(), "pattern": text(), "layer": nullable(SIZE),
                                  "what": text(), "fused": flag, "reason": text(empty=True)},
                                 {"causal": flag, "kernel": text()})),
        # context parallelism (mesh.cp > 1): the attention algorithm, the sequence layout,
        # each algorithm's modelled seconds per step (or why it cannot run), and why
        "context": empty_or(CONTEXT),
        "precision": map_of(one_of(PRECISIONS)),
        "constraints": list_of(text()),
        "batch_coupled": list_of(obj({"node": text(), "op": text(),
                                      "kind": one_of(("statistic", "input_statistic",
                                                      "mixes_batch")),
                                      "exact": flag, "where": text(empty=True)})),
        "precision_policy": empty_or(obj(
            {"compute": one_of(PRECISIONS), "source": one_of(("default", "overrides")),
             "params": one_of(PRECISIONS), "overrides": map_of(one_of(PRECISIONS)),
             "kept_fp32": map_of(list_of(text()))},
            {"cast_back": map_of(one_of(PRECISIONS))})),
    },
)


# --- cross-field rules ---------------------------------------------------------------------
def _mesh_rules(plan: dict) -> None:
    mesh, cluster = plan["mesh"], plan["cluster"]
    order = [a for a in MESH_AXES if a in mesh]
    if list(mesh) != order:
        _fail("mesh", f"ordered {', '.join(order)} (outer to inner)", list(mesh))
    devices = cluster["nodes"] * cluster["devices_per_node"]
    if cluster["devices"] != devices:
        _fail("cluster.devices", f"nodes x devices_per_node = {devices}", cluster["devices"])
    product = math.prod(n for a, n in mesh.items() if a not in CARVED_AXES)
    if mesh.get("ep", 1) > 1 and mesh["dp"] % mesh["ep"]:
        _fail("mesh.ep", f"a divisor of mesh.dp ({mesh['dp']}): experts are spread over part "
              "of the data-parallel ranks", mesh["ep"])
    used = plan.get("explanation", {}).get("devices")
    if used is not None and (used["cluster"] != devices or used["used"] != product):
        _fail("explanation.devices", f"used = the mesh's {product} ranks and cluster = "
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
            _fail("pipeline", "empty ({}) without a pp axis in the mesh", "a pipeline")
        return
    if not pipe:
        raise PlanError(f"the mesh has pp={pp} but the plan has no pipeline section",
                        where="pipeline", fix=REPLAN)
    m, v, schedule = pipe["microbatches"], pipe["virtual_stages"], pipe["schedule"]
    if m != plan["batch"]["microbatches"]:
        _fail("pipeline.microbatches", f"batch.microbatches ({plan['batch']['microbatches']})", m)
    if (m < pp and schedule != "gpipe") or (schedule == "interleaved" and m % pp):
        what = "a multiple of" if schedule == "interleaved" else "at least"
        _fail("batch.microbatches", f"{what} pp={pp} (schedule {schedule})", m)
    allowed = {"gpipe": (1,), "1f1b": (1,), "zb_v": (2,)}.get(schedule)
    if (v not in allowed) if allowed else v < 2:
        _fail("pipeline.virtual_stages", f"{allowed[0] if allowed else 'at least 2'} for "
              f"schedule {schedule}", v)
    chunks = pipe["chunks"]
    if len(chunks) != pp * v:
        _fail("pipeline.chunks", f"{pp * v} chunks (pp {pp} x virtual_stages {v})",
              f"{len(chunks)} chunks")
    first = 0
    for c, chunk in enumerate(chunks):
        at = f"pipeline.chunks[{c}]"
        if chunk["chunk"] != c:
            _fail(f"{at}.chunk", str(c), chunk["chunk"])
        if chunk["rank"] != rank_of_chunk(c, pp, schedule):
            _fail(f"{at}.rank", f"{rank_of_chunk(c, pp, schedule)} (where {schedule} runs "
                  f"chunk {c})", chunk["rank"])
        lo, hi = chunk["layers"]
        if lo != first or hi < lo:
            _fail(f"{at}.layers", f"[{first}, last >= {first}] (chunks cut the layers "
                  "contiguously, in order)", chunk["layers"])
        first = hi + 1
    ranks = [s["rank"] for s in pipe["stages"]]
    if ranks != list(range(pp)):
        _fail("pipeline.stages", f"one entry per pipeline rank 0-{pp - 1}, in order", ranks)


def _count_rules(plan: dict) -> None:
    model = plan["model"]
    if model["trainable_params"] > model["params"]:
        _fail("model.trainable_params", f"at most model.params ({model['params']})",
              model["trainable_params"])


def _recompute_rules(plan: dict) -> None:
    """``recompute_layers`` is there exactly when ``recompute`` is "mixed"."""
    training = plan["training"]
    mixed = training["recompute"] == "mixed"
    if mixed != ("recompute_layers" in training):
        _fail("training.recompute_layers", "a mode per layer exactly when training.recompute "
              "is 'mixed'", training.get("recompute_layers"))


def _precision_rules(plan: dict) -> None:
    """Per-node precision names nodes of the plan, and follows ``training.precision``."""
    words, policy = plan.get("precision", {}), plan.get("precision_policy", {})
    unknown = [name for name in words if name not in plan["strategies"]]
    if unknown:
        _fail(f"precision.{unknown[0]}", "a node of the plan (a key of strategies)",
              unknown[0])
    compute = plan["training"]["precision"]
    if policy and policy["compute"] != compute:
        _fail("precision_policy.compute", f"training.precision ({compute})", policy["compute"])
    if compute == "fp32" and any(w != "fp32" for w in words.values()) and not (
            policy and policy["overrides"]):
        _fail("precision", "fp32 everywhere under training.precision fp32 (no overrides)",
              sorted(set(words.values())))


def _offload_rules(plan: dict) -> None:
    """Offload moves ZeRO-3's shards: it needs ZeRO-3 and more than one data-parallel rank."""
    training, mesh = plan["training"], plan["mesh"]
    if training.get("offload", "none") == "none":
        return
    if training["zero"] != 3 or mesh["dp"] * mesh.get("cp", 1) < 2:
        _fail("training.offload", "used only with ZeRO-3 over 2 or more data-parallel ranks "
              f"(this plan: ZeRO-{training['zero']}, dp={mesh['dp']})", training["offload"])


def _hsdp_rules(plan: dict) -> None:
    """HSDP splits dp into replica groups that ZeRO shards within: dp_replicate divides dp,
    under ZeRO 1-3 and without experts."""
    training, mesh = plan["training"], plan["mesh"]
    replicate = training.get("dp_replicate", 1)
    if replicate == 1:
        return
    if mesh["dp"] % replicate or training["zero"] == 0 or mesh.get("ep", 1) > 1:
        _fail("training.dp_replicate", "a divisor of mesh.dp (groups that ZeRO 1-3 shards "
              f"within; no ep) (this plan: dp={mesh['dp']}, ZeRO-{training['zero']}, "
              f"ep={mesh.get('ep', 1)})", replicate)


CROSS_FIELD_RULES = (_mesh_rules, _batch_rules, _pipeline_rules, _count_rules,
                     _precision_rules, _recompute_rules, _offload_rules, _hsdp_rules)


def validate(data: Any, source: str = "plan") -> None:
    """Raise PlanError (its message starting with ``source``) unless ``data`` is a plan
    this autopar writes and runs."""
    try:
        if not isinstance(data, dict):
            _fail("the plan", "a JSON object", data, fix="pass a plan file written by "
                  "autopar plan --json")
        version = data.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise PlanError(f"schema version {_show(version)}; this autopar reads version "
                            f"{SCHEMA_VERSION}", where="schema_version", fix=REPLAN)
        PLAN(data, "")
        for rule in CROSS_FIELD_RULES:
            rule(data)
    except PlanError as e:
        raise PlanError(f"{source}: {e.what}", where=e.where, fix=e.fix) from None
