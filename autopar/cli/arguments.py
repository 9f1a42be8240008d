"""What each ``autopar`` command takes: its flags (the knobs' from the knob table, through
:mod:`autopar.cli.flags`) and the ones only it has.

Nothing here imports torch, the solver or a command's module, so ``autopar --help`` and a
usage error answer at once; :func:`autopar.cli.main.build_parser` assembles the commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from autopar.cli import flags

PLAN_COMMAND_KNOBS = (
    "dp", "tp", "pp", "cp", "ep", "dp_replicate", "batch_coupling", "cp_algorithm", "cp_layout",
    "devices", "microbatch", "microbatches", "schedule", "virtual_stages", "recompute",
    "recompute_layers", "precision", "precision_overrides", "master_weights", "zero", "optimizer",
    "time_limit_s", "max_solves", "extrapolation_margin", "fuse_attention", "chunked_loss",
    "compile", "constraints",
)
"""The knobs ``plan`` and ``emit`` read from their flags, in the order ``--help`` lists
them; every one left out is chosen by the solver."""

EXIT_DOES_NOT_FIT = 3
"""Exit status of ``autopar estimate`` when the configuration does not fit in memory."""

ESTIMATE_DESCRIPTION = (
    "Memory and step time of one pinned configuration; every number is modelled. --dp "
    "defaults to the devices left by tp x pp x cp. Exit "
    f"status 0 if it fits in device memory, {EXIT_DOES_NOT_FIT} if it does not (the report is "
    "printed all the same), 2 on bad input."
)

DEMO_MAX_STEPS = 1000
DEMO_STEPS = 12
"""The demo's default: 10 steps past the recording's warm-up for the measured median."""
DEMO_NPROC = (1, 2, 4, 8)


def command(sub: argparse._SubParsersAction, name: str, summary: str,
            description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser, showing each flag's default in its help."""
    return sub.add_parser(name, help=summary, description=description or summary,
                          formatter_class=flags.HelpFormatter)


def _planning(p: argparse.ArgumentParser) -> None:
    """MODEL, ``--cluster`` and what ``plan`` and ``emit`` pin."""
    flags.add_model(p)
    flags.add_cluster(p)
    flags.add_knobs(p, *PLAN_COMMAND_KNOBS)
    flags.add_quiet(p)


def plan_arguments(p: argparse.ArgumentParser) -> None:
    _planning(p)
    flags.add_json(p)
    p.add_argument("--html", type=flags.output_file, default=None, metavar="FILE",
                   help="also write the plan as one self-contained HTML report with charts "
                   "(what autopar report writes)")


def emit_arguments(p: argparse.ArgumentParser) -> None:
    _planning(p)
    p.add_argument("--rank", type=int, default=0, help="which rank's program")
    p.add_argument("--plan", metavar="FILE", help="use this plan instead of solving")
    p.add_argument("--disable-pass", action="append", metavar="NAME", default=None,
                   help="leave out a plugin pass (or an optional built-in: chunked-loss, "
                   "fuse-attention) by name; repeatable")


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a plan JSON (autopar plan ... --json FILE), or a recorded "
                   "run (its directory or a rank file): its plan, compared with the run")
    p.add_argument("-o", "--out", required=True, type=flags.output_file,
                   help="the HTML file to write")
    p.add_argument("--run", metavar="DIR", default=None,
                   help="a recorded run (pm.record_run(DIR)) to compare predicted with measured")


def cluster_arguments(p: argparse.ArgumentParser) -> None:
    csub = p.add_subparsers(dest="cluster_command", required=True)
    show = command(csub, "show", "print a cluster's resolved values and their sources")
    show.add_argument("spec", help="e.g. 8xH100-80GB or path/to/cluster.yaml")


def _estimate_only(p: argparse.ArgumentParser) -> None:
    """What ``estimate`` prices that ``plan`` never chooses: another framework's program."""
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


def estimate_arguments(p: argparse.ArgumentParser) -> None:
    """One configuration, every degree pinned (``--dp``: the devices left)."""
    flags.add_model(p)
    flags.add_cluster(p)
    flags.add_knobs(p, "tp", "pp", "dp", "cp", "ep", "dp_replicate", "cp_algorithm",
                    "cp_layout", tp=1, pp=1, cp=1, ep=1, dp_replicate=1)
    _estimate_only(p)
    flags.add_knobs(p, "microbatch", "recompute", "recompute_layers", "precision",
                    "master_weights", "zero", "optimizer", microbatch=1, recompute="none",
                    zero="0")
    p.add_argument("--lora-rank", type=flags.positive_int, default=None, metavar="R",
                   help="train LoRA adapters of rank R only (base weights frozen)")
    flags.add_knobs(p, "schedule", "virtual_stages", "fuse_attention", "chunked_loss",
                    schedule="1f1b", virtual_stages=1)
    flags.add_json(p)


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
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


def export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="the checkpoint directory")
    p.add_argument("--to", required=True, metavar="FILE", help="e.g. model.safetensors")


def demo_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--remeasure", action="store_true",
                   help="measure this machine again (40-80 s) instead of planning with the "
                   "profile the last demo refitted (say, once a busy machine is quiet again)")


def _none(p: argparse.ArgumentParser) -> None:
    """A command without flags."""


COMMANDS: tuple[tuple[str, str, str | None, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("plan", "solve a placement plan and explain it",
     "Solve a placement plan and explain it. Flags pin what they name; the solver chooses "
     "everything left out.", plan_arguments),
    ("inspect", "per-layer parameters, FLOPs and activation bytes", None, flags.add_model),
    ("emit", "print one rank's distributed program as Python", None, emit_arguments),
    ("plugins", "list the plugins installed packages add (entry points)",
     "List what installed packages add through the entry-point groups autopar.passes, "
     "autopar.rules, autopar.cost_models and autopar.constraints: group, name, package, "
     "version, where a pass runs, and whether it loaded (and why not).", _none),
    ("report", "write a plan as one self-contained HTML report with charts", None,
     report_arguments),
    ("cluster", "cluster descriptions", None, cluster_arguments),
    ("estimate", "memory and step time of one pinned configuration", ESTIMATE_DESCRIPTION,
     estimate_arguments),
    ("calibrate", "measure this machine and write a cluster profile", None,
     calibrate_arguments),
    ("export", "write a checkpoint's weights as one ordinary state dict",
     "Write a checkpoint (autopar.save_checkpoint) as single-device weights under the "
     "model's own names (Hugging Face's for an HF model): .safetensors, or torch.save for "
     "another suffix. Load them with model.load_state_dict(..., strict=True).",
     export_arguments),
    ("demo", "plan a small GPT for 2 CPU processes, train it, compare", None, demo_arguments),
)
"""Every command: its name, its one-line summary, its description (None: the summary) and
what adds its flags, in the order ``autopar --help`` lists them."""
