"""``autopar plan MODEL --cluster SPEC``: solve, explain, optionally write JSON."""

from __future__ import annotations

import argparse

from autopar.api.planning import plan
from autopar.cli import flags
from autopar.cli.arguments import PLAN_COMMAND_KNOBS
from autopar.cli.load import TracedModel, trace_model
from autopar.core import progress
from autopar.core.cluster import load_cluster
from autopar.core.knob_table import KNOBS
from autopar.core.plan import Plan
from autopar.core.plan_summary import format_plan


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, TracedModel]:
    """Trace and plan as the flags say, with live progress on a terminal (not --quiet)."""
    with progress.reporting(progress.for_terminal(getattr(args, "quiet", False))) as shown:
        cluster = load_cluster(args.cluster)  # a bad cluster fails before the model is traced
        shown.update(f"tracing {args.model}")
        traced = trace_model(args.model, args.global_batch, args.seq)
        shown.update(f"traced {args.model} in {traced.trace_s:.1f} s; planning for "
                     f"{cluster.name}")
        return _plan(args, cluster, traced), traced


def _plan(args: argparse.Namespace, cluster, traced: TracedModel) -> Plan:
    """``autopar.plan`` with every knob the flags set (:data:`PLAN_COMMAND_KNOBS`)."""
    knobs = {name: getattr(args, flags.dest(KNOBS[name])) for name in PLAN_COMMAND_KNOBS
             if name != "precision_overrides"}
    knobs["precision_overrides"] = dict(getattr(args, "precision_overrides", None) or [])
    return plan(traced.gm, cluster, global_batch=traced.batch, model_name=traced.spec.name,
                **knobs)


def run_plan(args: argparse.Namespace) -> int:
    result, traced = plan_from_args(args)
    if traced.note:
        print(f"note: {traced.note}\n")
    print(format_plan(result, traced.spec.name, traced.trace_s))
    if args.json:
        result.save(args.json)
        print(f"\nplan written to {args.json}")
    if getattr(args, "html", None):
        from autopar.report import write_report

        path = write_report(result, args.html)
        print(f"report written to {path}")
    # Ctrl-C: the best plan so far is printed and written, and the status says it was cut
    # short (as Ctrl-C anywhere else in the command line: 130)
    return 130 if result.solver.get("interrupted") else 0
