"""``autopar emit``: print one rank's distributed program as Python.

The model is traced on the meta device and the plan's passes run for the chosen rank
without starting any process, so even a 70B model's per-rank program prints in seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from autopar.cli.load import trace_model
from autopar.cli.plan_cmd import plan_from_args
from autopar.core.cluster import load_cluster
from autopar.core.constraints import parse_constraint
from autopar.core.errors import AutoparError
from autopar.core.knobs import schedule_name
from autopar.core.plan import Plan
from autopar.core.version import __version__
from autopar.passes import PassContext, PassManager
from autopar.passes.program import program_for
from autopar.runtime.parallel_module import rank_code
from autopar.trace.align import rename_like


def rank_coords(plan: Plan, rank: int) -> dict[str, int]:
    """Mesh coordinates of ``rank`` (axes in plan order, the last one innermost)."""
    if not 0 <= rank < plan.world_size:
        raise AutoparError(
            f"rank {rank} is outside the plan's {plan.world_size} "
            f"rank{'s' if plan.world_size != 1 else ''}",
            where="--rank",
            fix=(f"pick a rank from 0 to {plan.world_size - 1}" if plan.world_size > 1
                 else "the plan has one rank: 0"),
        )
    coords = {}
    for axis in reversed(list(plan.mesh)):
        if axis == "ep":
            continue  # carved out of dp: its coordinate is dp's, modulo ep
        coords[axis] = rank % plan.mesh[axis]
        rank //= plan.mesh[axis]
    if "ep" in plan.mesh:
        coords["ep"] = coords["dp"] % plan.mesh["ep"]
    return {axis: coords[axis] for axis in plan.mesh}


def _same(given: Any, planned: Any) -> bool:
    return given == planned


def _never(given: Any, planned: Any) -> bool:
    return False


def _master_weights(plan: Plan) -> str:
    """Where the plan keeps the fp32 masters: 'params' (fp32 parameters under ZeRO 1-2),
    'optimizer' (16-bit ones), or 'either' (ZeRO-0, ZeRO-3 and fp32 run both alike)."""
    zero = plan.training["zero"]
    if zero in (0, 3) or plan.training["precision"] == "fp32":
        return "either"
    return "params" if plan.precision_policy.get("params", "fp32") == "fp32" else "optimizer"


# Flag dest -> (flag, what the plan chose, whether the flag's value agrees with it). A flag
# at its default is not checked; one that agrees with the plan changes nothing. A planning
# flag missing here (added later) is refused whenever it is given.
_PLAN_FLAGS: dict[str, tuple[str, Callable[[Plan], Any], Callable[[Any, Any], bool]]] = {
    "global_batch": ("--global-batch", lambda p: p.batch["global"], _same),
    "seq": ("--seq", lambda p: p.batch["seq"], _same),
    "dp": ("--dp", lambda p: p.mesh.get("dp", 1), _same),
    "tp": ("--tp", lambda p: p.mesh.get("tp", 1), _same),
    "pp": ("--pp", lambda p: p.mesh.get("pp", 1), _same),
    "ep": ("--ep", lambda p: p.mesh.get("ep", 1), _same),
    "dp_replicate": ("--dp-replicate", lambda p: p.training.get("dp_replicate", 1), _same),
    "batch_coupling": ("--batch-coupling",
                       lambda p: p.training.get("batch_coupling", "exact"), _same),
    "microbatch": ("--microbatch", lambda p: p.batch["microbatch"], _same),
    "microbatches": ("--microbatches", lambda p: p.batch["microbatches"], _same),
    "schedule": ("--schedule", lambda p: p.pipeline.get("schedule", "none (no pipeline)"),
                 lambda v, s: schedule_name(v, "--schedule") == s),
    "virtual_stages": ("--virtual-stages", lambda p: p.pipeline.get("virtual_stages", 1), _same),
    "precision": ("--precision", lambda p: p.training["precision"], _same),
    "optimizer": ("--optimizer", lambda p: p.training["optimizer"], _same),
    "zero": ("--zero", lambda p: p.training["zero"], lambda stages, z: z in stages),
    "recompute": ("--recompute", lambda p: ",".join(
        dict.fromkeys(p.training.get("recompute_layers") or [p.training["recompute"]])),
        lambda modes, used: set(used.split(",")) <= set(modes)),
    "recompute_layers": ("--recompute-layers",
                         lambda p: ",".join(p.training.get("recompute_layers") or []),
                         lambda modes, chosen: ",".join(modes) == chosen),
    "precision_overrides": ("--precision-override",
                            lambda p: p.precision_policy.get("overrides", {}),
                            lambda given, chosen: dict(given) == chosen),
    "constraint": ("--constraint", lambda p: ", ".join(p.constraints) or "none",
                   lambda given, obeyed: all(str(parse_constraint(g)) in obeyed.split(", ")
                                             for g in given)),
    "fuse_attention": ("--no-fuse-attention",
                       lambda p: f"{sum(e['fused'] for e in p.attention)} attention site(s) fused",
                       lambda v, fused: fused.startswith("0 ")),
    "chunked_loss": ("--no-chunked-loss",
                     lambda p: f"chunked_loss={p.training.get('chunked_loss', True)}",
                     lambda v, shown: shown == f"chunked_loss={v}"),
    "compile": ("--compile", lambda p: f"compile={p.training.get('compile', False)}",
                lambda v, shown: shown == f"compile={v}"),
    "master_weights": ("--master-weights", _master_weights,
                       lambda v, shown: shown in (v, "either")),
    "time_limit": ("--time-limit", lambda p: "nothing to solve", _never),
    "max_solves": ("--max-solves", lambda p: "nothing to solve", _never),
}
_EMIT_OWN = ("command", "model", "cluster", "plan", "rank", "disable_pass")  # not planning choices


def check_flags_against_plan(args: argparse.Namespace, plan: Plan) -> None:
    """With ``--plan`` the plan fixes every planning choice: a flag that would change one
    is an error naming it (never silently ignored), and ``--cluster`` must be the cluster
    the plan was made for (:meth:`Plan.check_cluster`)."""
    plan.check_cluster(load_cluster(args.cluster))
    from autopar.cli.main import build_parser

    defaults = vars(build_parser().parse_args(["emit", args.model, "--cluster", args.cluster]))
    for dest, default in defaults.items():
        value = getattr(args, dest, default)
        if dest in _EMIT_OWN or value == default:
            continue
        flag, chosen, agrees = _PLAN_FLAGS.get(
            dest, (f"--{dest.replace('_', '-')}", lambda p: "not a plan field", _never))
        if agrees(value, chosen(plan)):
            continue
        shown = "" if isinstance(value, bool) else f" {value}"
        raise AutoparError(
            f"{flag}{shown} disagrees with the plan {args.plan} ({dest}: {chosen(plan)}); "
            "with --plan, the plan fixes every planning choice",
            where=flag,
            fix=f"drop {flag}, or re-plan with it: autopar plan {args.model} --cluster "
            f"{args.cluster} {flag}{shown} --json FILE",
        )


def run_emit(args: argparse.Namespace) -> int:
    if args.plan:
        plan = Plan.load(args.plan)
        check_flags_against_plan(args, plan)
        planned = trace_model(args.model, plan.batch["traced"], plan.batch["seq"]).gm
        plan.check_model(planned.meta["autopar"].fingerprint, args.model)
    else:
        plan, traced = plan_from_args(args)
        planned = traced.gm
    # Each rank's program is rewritten from the model traced on one of its microbatches,
    # its nodes named as in the planned graph.
    gm = planned
    if plan.batch["microbatch"] != plan.batch["traced"]:
        gm = rename_like(trace_model(args.model, plan.batch["microbatch"], plan.batch["seq"]).gm,
                         planned)
    coords = rank_coords(plan, args.rank)
    device = "cuda" if plan.cluster.get("backend") == "nccl" else "cpu"  # where it would run
    passes = program_for(plan, disable=args.disable_pass or ())
    program, results = PassManager(passes).run(gm, PassContext(plan, coords, device))
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    print(f"# autopar {__version__} (plan schema {plan.schema_version}): rank "
          f"{args.rank} of {plan.world_size}, mesh {mesh}, coordinates {coords}")
    print(f"# model {plan.model['name']} (fingerprint {plan.model['fingerprint']}); "
          f"microbatch {plan.batch['microbatch']} x {plan.batch['microbatches']} per rank; "
          f"ZeRO-{plan.training['zero']}; recompute {plan.training['recompute']}")
    for result in results:
        print(f"# pass {result.pass_name}: {len(result.changes)} change(s)")
    print(rank_code(program, plan, coords))
    return 0
