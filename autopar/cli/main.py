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

from autopar.cli import flags
from autopar.cli.estimate_cmd import DESCRIPTION
from autopar.core.errors import AutoparError
from autopar.core.knobs import MASTER_WEIGHTS, SEARCHED_RECOMPUTE_MODES, ZERO_STAGES_RUNNABLE


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    """What ``plan`` and ``emit`` pin; every flag left out is chosen by the solver."""
    flags.add_cluster(p)
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        flags.add_degree(p, axis)
    flags.add_dp_replicate(p)
    flags.add_batch_coupling(p)
    flags.add_cp_algorithm(p)
    flags.add_cp_layout(p)
    flags.add_devices(p)
    flags.add_microbatch(p)
    flags.add_microbatches(p)
    flags.add_schedule(p)
    flags.add_virtual_stages(p)
    flags.add_recompute(p, default=",".join(SEARCHED_RECOMPUTE_MODES))
    flags.add_precision(p, overrides=True)
    flags.add_zero(p, default=",".join(map(str, ZERO_STAGES_RUNNABLE)))
    flags.add_optimizer(p)
    flags.add_time_limit(p)
    flags.add_extrapolation_margin(p)
    flags.add_fuse_attention(p)
    flags.add_chunked_loss(p)
    flags.add_constraint(p)
    flags.add_quiet(p)


def _sub(sub: argparse._SubParsersAction, name: str, summary: str,
         description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=description or summary,
                          formatter_class=flags.HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = _sub(sub, "plan", "solve a placement plan and explain it",
             "Solve a placement plan and explain it. Flags pin what they name; the solver "
             "chooses everything left out.")
    flags.add_model(p)
    _add_plan_args(p)
    flags.add_json(p)
    p.add_argument("--html", type=flags.output_file, default=None, metavar="FILE",
                   help="also write the plan as one self-contained HTML report with charts "
                   "(what autopar report writes)")

    p = _sub(sub, "inspect", "per-layer parameters, FLOPs and activation bytes")
    flags.add_model(p)

    p = _sub(sub, "emit", "print one rank's distributed program as Python")
    flags.add_model(p)
    _add_plan_args(p)
    p.add_argument("--rank", type=int, default=0, help="which rank's program")
    p.add_argument("--plan", metavar="FILE", help="use this plan instead of solving")
    p.add_argument("--disable-pass", action="append", metavar="NAME", default=None,
                   help="leave out a plugin pass (or an optional built-in: chunked-loss, "
                   "fuse-attention) by name; repeatable")

    p = _sub(sub, "plugins", "list the plugins installed packages add (entry points)",
             "List what installed packages add through the entry-point groups autopar.passes, "
             "autopar.rules, autopar.cost_models and autopar.constraints: group, name, "
             "package, version, where a pass runs, and whether it loaded (and why not).")

    p = _sub(sub, "report", "write a plan as one self-contained HTML report with charts")
    p.add_argument("plan", help="a plan JSON (autopar plan ... --json FILE)")
    p.add_argument("-o", "--out", required=True, type=flags.output_file,
                   help="the HTML file to write")
    p.add_argument("--run", metavar="DIR", default=None,
                   help="a recorded run (pm.record_run(DIR)) to compare predicted with measured")

    p = _sub(sub, "cluster", "cluster descriptions")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    show = _sub(csub, "show", "print a cluster's resolved values and their sources")
    show.add_argument("spec", help="e.g. 8xH100-80GB or path/to/cluster.yaml")

    p = _sub(sub, "estimate", "memory and step time of one pinned configuration", DESCRIPTION)
    flags.add_model(p)
    flags.add_cluster(p)
    flags.add_degree(p, "tp", default=1)
    flags.add_degree(p, "pp", default=1)
    flags.add_degree(p, "dp")
    flags.add_degree(p, "cp", default=1)
    flags.add_degree(p, "ep", default=1)
    flags.add_dp_replicate(p, default=1)
    flags.add_cp_algorithm(p)
    flags.add_cp_layout(p)
    p.add_argument("--sp", action="store_true", help="sequence parallelism with tp")
    p.add_argument("--layout", choices=("auto", "megatron"), default="auto",
                   help="tensor-parallel layout: the solver's fastest ('auto', what `autopar "
                   "plan` would run), or Megatron-LM's (every weight matrix split, norms and "
                   "residuals whole or sequence-split with --sp), to compare with runs that used it")
    p.add_argument("--fuse-elementwise", action="store_true",
                   help="price a program that fuses its elementwise ops (Transformer Engine's "
                   "kernels, torch.compile): chains between matmuls run as one kernel, their "
                   "middle values never written; autopar's own programs run them eagerly")
    p.add_argument("--tp-overlap", action="store_true",
                   help="price a program that pipelines its tensor-parallel all-gathers and "
                   "reduce-scatters with the matmuls beside them (Transformer Engine's "
                   "userbuffers, PyTorch's async TP); autopar's own programs issue them whole")
    p.add_argument("--p2p-overlap", action="store_true",
                   help="price a pipeline whose sends and receives run beside the compute "
                   "(Megatron-Core's overlap_p2p_comm under interleaving); autopar's own "
                   "stages wait for theirs")
    flags.add_microbatch(p, default=1)
    flags.add_recompute(p, default="none")
    flags.add_precision(p)
    p.add_argument("--master-weights", choices=MASTER_WEIGHTS, default="params",
                   help="where mixed precision keeps the fp32 master weights: 'params' (the "
                   "parameters are fp32, cast per use; what autopar runs) or 'optimizer' "
                   "(16-bit parameters, fp32 masters beside the optimizer states: Megatron-LM, "
                   "DeepSpeed; ZeRO's 2 + 2 + 12 bytes per parameter)")
    flags.add_zero(p, default="0")
    flags.add_optimizer(p)
    p.add_argument("--lora-rank", type=flags.positive_int, default=None, metavar="R",
                   help="train LoRA adapters of rank R only (base weights frozen)")
    flags.add_schedule(p, default="1f1b")
    flags.add_virtual_stages(p, default=1)
    flags.add_fuse_attention(p)
    flags.add_chunked_loss(p)
    flags.add_json(p)

    p = _sub(sub, "calibrate", "measure this machine and write a cluster profile")
    p.add_argument("--out", required=True, type=flags.output_file, help="profile JSON to write")
    p.add_argument("--from-run", nargs="+", metavar="DIR", default=None,
                   help="refit from recorded training runs (pm.record_run(DIR), or "
                   "autopar demo --record-run DIR) instead of measuring")
    p.add_argument("--nproc", type=flags.positive_int, default=2,
                   help="processes for the collective tests")
    p.add_argument("--quick", action="store_true", help="fewer sizes (about 80 s on 2 cores)")
    p.add_argument("--default-dtype-only", action="store_true",
                   help="time matmuls in the device's default dtype only (fp32 on a CPU, "
                   "whose 16-bit matmuls take minutes); the other dtypes keep the preset's "
                   "figures")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=flags.positive_int, default=1,
                   help="CPU threads per process (torchrun gives each process 1)")

    p = _sub(sub, "export", "write a checkpoint's weights as one ordinary state dict",
             "Write a checkpoint (autopar.save_checkpoint) as single-device weights under the "
             "model's own names (Hugging Face's for an HF model): .safetensors, or torch.save "
             "for another suffix. Load them with model.load_state_dict(..., strict=True).")
    p.add_argument("checkpoint", help="the checkpoint directory")
    p.add_argument("--to", required=True, metavar="FILE", help="e.g. model.safetensors")

    p = _sub(sub, "demo", "plan a small GPT for 2 CPU processes, train it, compare")
    p.add_argument("--steps", type=flags.positive_int_up_to(DEMO_MAX_STEPS, "a demo"),
                   default=DEMO_STEPS, help="AdamW steps (the first 2 are warm-up)")
    p.add_argument("--nproc", type=int, choices=DEMO_NPROC, default=2,
                   help="gloo processes (divisors of the demo's batch of 8)")
    p.add_argument("--record-run", metavar="DIR", default=None,
                   help="keep the run's recording here (for autopar calibrate --from-run)")
    p.add_argument("--profile", metavar="PROFILE", default=None,
                   help="plan with this profile (default: the one the last demo refitted, "
                   "else one measured now: about 80 s)")
    p.add_argument("--preset", action="store_true",
                   help="plan with the cpu preset (another machine's numbers) where no profile "
                   "is kept, instead of measuring this machine first")
    return parser


DEMO_MAX_STEPS = 1000
DEMO_STEPS = 12
"""The demo's default: 10 steps past the recording's warm-up for the measured median."""
DEMO_NPROC = (1, 2, 4, 8)


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
