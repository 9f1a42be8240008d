"""The ``autopar`` command: plan, inspect, emit, cluster show, demo.

    autopar plan llama3-70b --cluster 16x8xH100-80GB --json plan.json
    autopar inspect gpt2
    autopar cluster show 8xA100-80GB
    autopar emit gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32 --cluster 2xcpu --tp 2
    autopar estimate llama3-8b --cluster 8xH100-80GB --tp 1 --dp 8 --zero 3 --dtype bf16
    autopar calibrate --out cpu-profile.json
    autopar demo

Errors on bad input print what, where and what to do, and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from autopar.errors import AutoparError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="built-in name (gpt2, gpt2-xl, gpt-125m, llama3-8b, llama3-70b, gpt3-175b, "
        "mixtral-8x7b), a spec such as gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024, "
        "or path/to/file.py:factory",
    )
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences")
    p.add_argument("--seq", type=int, default=None, help="sequence length")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="e.g. 8xH100-80GB, 16x8xA100-80GB, c.yaml")
    p.add_argument("--dp", type=int, default=None, help="pin the data-parallel degree")
    p.add_argument("--tp", type=int, default=None, help="pin the tensor-parallel degree")
    p.add_argument("--pp", type=int, default=None, help="pin the pipeline-parallel degree")
    p.add_argument("--microbatch", type=int, default=None, help="pin sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pin microbatches per step (instead of --microbatch)")
    p.add_argument("--schedule", default=None,
                   help="pin the pipeline schedule: gpipe, 1f1b, interleaved, zb_v (zero-bubble)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="pin chunks per pipeline rank (interleaved schedule)")
    p.add_argument("--recompute", default="none,selective,full",
                   help="recomputation modes the solver may use (default none,selective,full)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    p.add_argument("--zero", default="0,3", help="ZeRO stages the solver may use (default 0,3)")
    p.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per mesh")
    p.add_argument("--no-fuse-attention", dest="fuse_attention", action="store_false",
                   help="keep attention as traced (default: generated fused kernels)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="solve a placement plan and explain it")
    _add_model_args(p)
    _add_plan_args(p)
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")

    p = sub.add_parser("inspect", help="per-layer parameters, FLOPs and activation bytes")
    _add_model_args(p)

    p = sub.add_parser("emit", help="print one rank's distributed program as Python")
    _add_model_args(p)
    _add_plan_args(p)
    p.add_argument("--rank", type=int, default=0, help="which rank's program (default 0)")
    p.add_argument("--plan", metavar="FILE", help="use this plan instead of solving")

    p = sub.add_parser("cluster", help="cluster descriptions")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    show = csub.add_parser("show", help="print a cluster's resolved values and their sources")
    show.add_argument("spec", help="e.g. 8xH100-80GB or path/to/cluster.yaml")

    p = sub.add_parser("estimate", help="memory and step time of one pinned configuration")
    _add_model_args(p)
    p.add_argument("--cluster", required=True, help="e.g. 8xH100-80GB or c.yaml")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="default: devices / (tp x pp x cp)")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism with tp")
    p.add_argument("--microbatch", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "momentum", "adafactor",
                                          "adam8bit"), default="adamw")
    p.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters only")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zero-bubble"),
                   default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=1, help="interleaving degree v")
    p.add_argument("--no-fuse-attention", dest="fuse_attention", action="store_false",
                   help="model eager attention op by op (default: as the fused kernel)")
    p.add_argument("--json", metavar="FILE", help="also write the estimate as JSON")

    p = sub.add_parser("calibrate", help="measure this machine and write a cluster profile")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--nproc", type=int, default=2, help="processes for the collective tests")
    p.add_argument("--quick", action="store_true", help="fewer sizes (about a minute)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process (torchrun gives each process 1)")

    p = sub.add_parser("demo", help="plan a small GPT for 2 CPU processes, train it, compare")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            from autopar.cli.plan_cmd import run_plan

            return run_plan(args)
        if args.command == "inspect":
            from autopar.cli.inspect_cmd import run_inspect

            return run_inspect(args)
        if args.command == "emit":
            from autopar.cli.emit_cmd import run_emit

            return run_emit(args)
        if args.command == "cluster":
            from autopar.cluster import format_cluster, load_cluster

            print(format_cluster(load_cluster(args.spec)))
            return 0
        if args.command == "estimate":
            from autopar.cli.estimate_cmd import run_estimate

            return run_estimate(args)
        if args.command == "calibrate":
            from autopar.cli.calibrate_cmd import run_calibrate

            return run_calibrate(args)
        if args.command == "demo":
            from autopar.cli.demo import run_demo

            return run_demo(args)
    except AutoparError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
