"""``autopar plan MODEL --cluster SPEC``: solve, explain, optionally write JSON."""

from __future__ import annotations

import argparse

from autopar.cli.load import TracedModel, recompute_modes, trace_model, zero_stages
from autopar.cli.summary import format_plan
from autopar.plan import Plan
from autopar.planning import plan


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, TracedModel]:
    traced = trace_model(args.model, args.batch, args.seq)
    result = plan(
        traced.gm,
        args.cluster,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        global_batch=traced.batch,
        microbatch=args.microbatch,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        recompute=recompute_modes(args.recompute),
        precision=args.precision,
        zero=zero_stages(args.zero),
        time_limit_s=args.time_limit,
        fuse_attention=args.fuse_attention,
        model_name=traced.spec.name,
    )
    return result, traced


def run_plan(args: argparse.Namespace) -> int:
    result, traced = plan_from_args(args)
    print(format_plan(result, traced.spec.name, traced.trace_s))
    if args.json:
        result.save(args.json)
        print(f"\nplan written to {args.json}")
    return 0
