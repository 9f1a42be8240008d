"""The ``autopar`` command: plan, inspect, emit, cluster show, estimate, calibrate, export, demo.

    autopar plan llama3-70b --cluster 16x8xH100-80GB --json plan.json
    autopar inspect gpt2
    autopar cluster show 8xA100-80GB
    autopar emit gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32 --cluster 2xcpu --tp 2
    autopar estimate llama3-8b --cluster 8xH100-80GB --tp 1 --dp 8 --zero 3 --precision bf16
    autopar calibrate --out cpu-profile.json
    autopar demo
    autopar export ckpt/step-000100 --to model.safetensors

Errors on bad input print what, where and what to do, and exit with status 2 (argparse's
usage errors too); ``estimate`` exits with status 3 when the configuration does not fit;
Ctrl-C exits with status 130.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

from autopar.cli.arguments import COMMANDS, command
from autopar.core.errors import AutoparError
from autopar.core.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and a pointer to --help, not the whole usage
    block before the one line that says what was wrong."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n  ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (:mod:`autopar.cli.arguments`); the commands' modules,
    and torch with them, load only when one runs (:func:`_run`)."""
    parser = _Parser(prog="autopar", description=__doc__.split("\n")[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, summary, description, add_arguments in COMMANDS:
        add_arguments(command(sub, name, summary, description))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Bad input: status 2 and ``autopar: what / where /
    fix`` on stderr. Ctrl-C: status 130 and one line. A closed pipe (``| head``): status 0."""
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return code
    except AutoparError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autopar: interrupted (Ctrl-C) during {args.command}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "plan":
        from autopar.cli.plan_cmd import run_plan

        return run_plan(args)
    if args.command == "inspect":
        from autopar.cli.inspect_cmd import run_inspect

        return run_inspect(args)
    if args.command == "emit":
        from autopar.cli.emit_cmd import run_emit

        return run_emit(args)
    if args.command == "plugins":
        from autopar.cli.plugins_cmd import run_plugins

        return run_plugins(args)
    if args.command == "report":
        from autopar.cli.report_cmd import run_report

        return run_report(args)
    if args.command == "cluster":
        from autopar.core.cluster import format_cluster, load_cluster

        print(format_cluster(load_cluster(args.spec)))
        return 0
    if args.command == "estimate":
        from autopar.cli.estimate_cmd import run_estimate

        return run_estimate(args)
    if args.command == "calibrate":
        from autopar.cli.calibrate_cmd import run_calibrate

        return run_calibrate(args)
    if args.command == "export":
        from autopar.runtime.weights import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.to)
        print(f"wrote {out}")
        return 0
    from autopar.cli.demo import run_demo

    return run_demo(args)


def _silence_stdout() -> None:
    """Point stdout at devnull, so the flush at exit does not fail again on the closed pipe
    (what Python's signal docs recommend for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        sys.stdout = open(os.devnull, "w")


if __name__ == "__main__":
    sys.exit(main())
