"""The plan schema's table: every field of a plan, and the rule its value must satisfy.

Sections the runtime acts on are closed (an unknown key is an error); the descriptive
ones that other parts of autopar extend (the modelled memory breakdown, the solver's
candidate log) accept added keys holding plain numbers or text. The cluster is checked by
the cluster loader itself, so both read the same rules.
"""

from __future__ import annotations

import math
from typing import Any

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
)
from autopar.core.plan_checks import (
    REPLAN,
    anything,
    empty_or,
    fail,
    field_path,
    flag,
    integer,
    list_of,
    map_of,
    nullable,
    number,
    obj,
    one_of,
    placement,
    plain,
    text,
)

SCHEMA_VERSION = 6

CLUSTER = obj({"name": text(empty=True), "nodes": integer(1), "devices_per_node": integer(1),
               "backend": text(), "device": obj({"name": text()}, extra=anything),
               "devices": integer(1)}, extra=anything)


def cluster_entry(value: Any, where: str) -> None:
    """The resolved cluster the plan was made for (what ``Cluster.to_dict`` writes, plus
    ``devices``), checked by the cluster loader itself."""
    CLUSTER(value, where)
    if "profile" in value:
        fail(f"{where}.profile", "absent (a plan records the resolved cluster)",
             value["profile"])
    try:
        load_cluster({k: v for k, v in value.items() if k != "devices"})
    except AutoparError as e:
        raise PlanError(f"in {where}: {e.what}", where=field_path(where, e.where or ""), fix=REPLAN
                        ) from None


COUNT = integer(1)
SIZE = integer(0)
SECONDS = number()
# autopar.solver.model.cpsat.solve_stats: one CP-SAT solve (objective and bound in ``unit``)
SOLVE = obj({"what": text(), "status": text(), "objective": nullable(number(-math.inf)),
             "bound": nullable(number(-math.inf)), "unit": text(),
             "gap": nullable(number(0.0, 1.0)), "wall_s": SECONDS,
             "time_limit_s": nullable(SECONDS), "outcome": text()}, {"reused": flag, "stand_in": flag})
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
    }, {"memory_phases": map_of(SIZE)})),
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
            "compile": one_of((True, False)),  # torch.compile (autopar.runtime.compiled)
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
            # bytes by kind at the forward/backward peak (activations), when "memory" is
            # the optimizer step's
            "memory_training": MEMORY,
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
