"""``autopar emit``: print one rank's distributed program as Python.

The model is traced on the meta device and the plan's passes run for the chosen rank
without starting any process, so even a 70B model's per-rank program prints in seconds.
"""

from __future__ import annotations

import argparse

import autopar
from autopar.cli.load import trace_model
from autopar.cli.plan_cmd import plan_from_args
from autopar.errors import AutoparError
from autopar.passes import PassContext, PassManager, program_passes
from autopar.plan import Plan
from autopar.runtime.parallel_module import rank_code
from autopar.trace.align import rename_like


def rank_coords(plan: Plan, rank: int) -> dict[str, int]:
    """Mesh coordinates of ``rank`` (axes in plan order, the last one innermost)."""
    if not 0 <= rank < plan.world_size:
        raise AutoparError(
            f"rank {rank} is outside the plan's {plan.world_size} ranks",
            where="--rank",
            fix=f"pick a rank from 0 to {plan.world_size - 1}",
        )
    coords = {}
    for axis in reversed(list(plan.mesh)):
        coords[axis] = rank % plan.mesh[axis]
        rank //= plan.mesh[axis]
    return dict(reversed(list(coords.items())))


def run_emit(args: argparse.Namespace) -> int:
    if args.plan:
        plan = Plan.load(args.plan)
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
    program, results = PassManager(program_passes(plan)).run(gm, PassContext(plan, coords))
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    print(f"# autopar {autopar.__version__} (plan schema {plan.schema_version}): rank "
          f"{args.rank} of {plan.world_size}, mesh {mesh}, coordinates {coords}")
    print(f"# model {plan.model['name']} (fingerprint {plan.model['fingerprint']}); "
          f"microbatch {plan.batch['microbatch']} x {plan.batch['microbatches']} per rank; "
          f"ZeRO-{plan.training['zero']}; recompute {plan.training['recompute']}")
    for result in results:
        print(f"# pass {result.pass_name}: {len(result.changes)} change(s)")
    print(rank_code(program, plan, coords))
    return 0
