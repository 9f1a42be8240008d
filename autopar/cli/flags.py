"""The command line's flags: each knob defined once (one function, one help text), so
``plan``, ``estimate``, ``emit`` and ``inspect`` spell and explain it the same way.

Values are checked by argparse types, so a bad value is an argparse error (exit 2) that
names the flag, before any model is traced. Old spellings (``--dtype``, ``--batch``,
``--schedule zero-bubble``) still work and print a deprecation line to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autopar.core.errors import AutoparError
from autopar.core.knobs import (
    BATCH_COUPLING_MODES,
    CP_ALGORITHMS,
    CP_LAYOUTS,
    OPTIMIZERS,
    PRECISION_CHOICES,
    PRECISIONS,
    RECOMPUTE_MODES,
    schedule_name,
    zero_stages,
)

# --- value types --------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An integer >= 1 (degrees, sizes, counts)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_int_up_to(limit: int, why: str) -> Callable[[str], int]:
    """``positive_int`` with an upper bound (``why`` says where the bound comes from)."""

    def convert(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected at most {limit} ({why}), got {value}")
        return value

    convert.__name__ = "positive_int"
    return convert


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A finite number >= 0 (a fraction: 0.1 is 10%)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite fraction >= 0, got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file autopar may write: its folder exists and is writable, and it is no folder.
    Checked before any tracing or solving, so a typo does not cost a solve."""
    path = Path(os.path.expanduser(text))  # "~nobody" stays as written
    folder = path.parent
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a NUL byte, which no file name can")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"'{text}' is a directory; give a file name in it")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"directory '{folder}' does not exist (create it first, or write elsewhere)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory '{folder}' is not writable")
    return text


def _knob(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser in :mod:`autopar.core.knobs`: its errors become argparse
    errors, and its deprecation warnings lines on stderr."""

    def convert(text: str) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            try:
                value = parse(text)
            except AutoparError as err:
                raise argparse.ArgumentTypeError(f"{err.what} ({err.fix})") from None
        for warning in caught:
            print(str(warning.message), file=sys.stderr)
        return value

    convert.__name__ = parse.__name__
    return convert


def _stage_list(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        stages = ()
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise AutoparError(f"{text!r} is not a list of ZeRO stages", where="--zero",
                           fix="give stages 0-3 separated by commas, e.g. 0,3")
    return zero_stages(stages, where="--zero")


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    if not all(modes) or any(m not in RECOMPUTE_MODES for m in modes):
        raise AutoparError(f"{text!r} is not a list of recomputation modes", where="--recompute",
                           fix=f"give modes from {', '.join(RECOMPUTE_MODES)} separated by "
                           "commas, e.g. none,full")
    return tuple(dict.fromkeys(modes))


schedule = _knob(schedule_name)
stage_list = _knob(_stage_list)
mode_list = _knob(_mode_list)


def _layer_modes(text: str) -> tuple[str, ...]:
    """One recomputation mode per layer (repeats kept)."""
    modes = tuple(m.strip() for m in text.split(","))
    if not all(modes) or any(m not in RECOMPUTE_MODES for m in modes):
        raise AutoparError(f"{text!r} is not one recomputation mode per layer",
                           where="--recompute-layers",
                           fix=f"give a mode from {', '.join(RECOMPUTE_MODES)} for each layer, "
                           "separated by commas, e.g. full,full,none,none")
    return modes


layer_modes = _knob(_layer_modes)


class _Renamed(argparse.Action):
    """An old spelling of a flag: stores into the new flag's value and says so on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"autopar: {option_string} is deprecated; use {self.new} (same meaning)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def _renamed(p: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    p.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=_Renamed, new=new,
                   **kwargs)


# --- shared flags: one function each, one help text each -------------------------------------

MODEL_HELP = (
    "built-in name (gpt2, gpt2-xl, gpt-125m, llama3-8b, llama3-70b, gpt3-175b, mixtral-8x7b), "
    "a spec such as gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024, or "
    "path/to/file.py:factory (returning (model, example_args, example_kwargs))"
)


def add_model(p: argparse.ArgumentParser) -> None:
    """MODEL, and the batch and sequence it is traced with."""
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--global-batch", type=positive_int, default=None, metavar="N",
                   help="sequences per optimizer step (default: the model's)")
    _renamed(p, "--batch", "--global-batch", type=positive_int, metavar="N")
    p.add_argument("--seq", type=positive_int, default=None, metavar="N",
                   help="sequence length (default: the model's)")


def add_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="a shorthand (8xH100-80GB, 16x8xA100-80GB, 2xcpu) or a .yaml/.json file")


def add_degree(p: argparse.ArgumentParser, axis: str, default: int | None = None) -> None:
    """``--dp``/``--tp``/``--pp``/``--cp``: a mesh degree."""
    words = {"dp": "data", "tp": "tensor", "pp": "pipeline", "cp": "context",
             "ep": "expert (carved out of dp)"}[axis]
    p.add_argument(f"--{axis}", type=positive_int, default=default, metavar="N",
                   help=f"{words}-parallel degree")


def add_dp_replicate(p: argparse.ArgumentParser, default: int | None = None) -> None:
    p.add_argument("--dp-replicate", type=positive_int, default=default, metavar="N",
                   help="HSDP: ZeRO shards within dp/N consecutive data-parallel ranks and the "
                   "N groups replicate (1: shard over all of dp; default: chosen by cost)")


def add_batch_coupling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-coupling", choices=BATCH_COUPLING_MODES, default="exact",
                   help="exact: split the batch (dp, microbatches) only where ops coupling its "
                   "samples (balancing losses, batch norm) stay exact; local: split anyway, "
                   "each rank's statistics its own (as DDP does)")


def add_cp_algorithm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp-algorithm", choices=CP_ALGORITHMS, default=None,
                   help="attention under context parallelism: ring (K/V passed around, "
                   "overlapped), all_gather (K/V gathered, cheap with few K/V heads) or "
                   "ulysses (all-to-all heads <-> sequence); default: the cheapest modelled")


def add_cp_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp-layout", choices=CP_LAYOUTS, default="zigzag",
                   help="how a sequence is cut over cp: zigzag (2 x cp chunks, rank i holds "
                   "i and 2cp-1-i: even causal work) or contiguous")


def add_devices(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="use N of the cluster's devices (the first: whole nodes, or part of "
                   "one node); default: all, or fewer when that is predicted faster (unless a "
                   "mesh degree is pinned)")


def add_microbatch(p: argparse.ArgumentParser, default: int | None = None) -> None:
    p.add_argument("--microbatch", type=positive_int, default=default, metavar="N",
                   help="sequences per microbatch on each data-parallel rank")


def add_microbatches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--microbatches", type=positive_int, default=None, metavar="N",
                   help="microbatches per step on each data-parallel rank (instead of "
                   "--microbatch)")


def add_schedule(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--schedule", type=schedule, default=default, metavar="NAME",
                   help="pipeline schedule: gpipe, 1f1b, interleaved (interleaved 1F1B) or "
                   "zb_v (zero-bubble V)")


def add_virtual_stages(p: argparse.ArgumentParser, default: int | None = None) -> None:
    p.add_argument("--virtual-stages", type=positive_int, default=default, metavar="V",
                   help="model chunks per pipeline rank (interleaved schedule)")


def add_recompute(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--recompute", type=mode_list, default=default, metavar="MODES",
                   help="activation recomputation: none, selective, full or op (torchtitan's "
                   "per-op policy); plan may be given "
                   "several, comma-separated, to choose from for each layer")
    p.add_argument("--recompute-layers", type=layer_modes, default=None, metavar="MODES",
                   help="one recomputation mode per repeated layer, comma-separated, in the "
                   "order the layers run (pins recomputation per layer)")


def add_precision(p: argparse.ArgumentParser, overrides: bool = False) -> None:
    p.add_argument("--precision", choices=PRECISION_CHOICES, default=None,
                   help="compute precision: bf16/fp16 matmuls (fp16 with loss scaling), fp8 "
                   "linears, or fp32; mixed precision keeps fp32 master weights, and "
                   "normalisations, softmax and losses in fp32; auto: the fastest the device "
                   "runs without loss scaling (default: bf16 on GPUs, fp32 on CPU)")
    _renamed(p, "--dtype", "--precision", choices=PRECISION_CHOICES)
    if overrides:
        p.add_argument("--precision-override", type=precision_override, action="append",
                       default=None, dest="precision_overrides", metavar="NODE=DTYPE",
                       help="compute one fx node, or every node of a module path, in DTYPE "
                       f"({', '.join(PRECISIONS)}); repeatable")


def precision_override(text: str) -> tuple[str, str]:
    """``NODE=DTYPE`` (NODE an fx node name or a module path)."""
    key, eq, word = text.partition("=")
    if not eq or not key.strip() or word.strip() not in PRECISIONS:
        raise argparse.ArgumentTypeError(
            f"expected NODE=DTYPE with DTYPE one of {', '.join(PRECISIONS)}, got {text!r}")
    return key.strip(), word.strip()


def add_zero(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--zero", type=stage_list, default=default, metavar="STAGES",
                   help="ZeRO stage 0-3 (0: DDP, 3: FSDP2 fully_shard); plan may be given "
                   "several, comma-separated, to choose from")


def add_optimizer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="optimizer whose states are counted")


def add_fuse_attention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-fuse-attention", dest="fuse_attention", action="store_false",
                   help="keep attention op by op as traced, instead of one generated fused kernel")


def add_chunked_loss(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-chunked-loss", dest="chunked_loss", action="store_false",
                   help="keep torch's cross-entropy (its [tokens, vocab] log-softmax), instead "
                        "of computing it a block of tokens at a time")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=output_file, metavar="FILE",
                   help="also write the result as JSON to FILE")


def add_time_limit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=positive_seconds, default=20.0, metavar="S",
                   help="CP-SAT seconds per mesh candidate")
    p.add_argument("--max-solves", type=_solve_budget, default=300, metavar="N",
                   help="CP-SAT solves the search may run; past them only layouts already "
                   "solved are priced, and the plan says so ('none': no limit; default: 300)")


def _solve_budget(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count or 'none', got {text!r}")
    return value


def add_extrapolation_margin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extrapolation-margin", type=fraction, default=None, metavar="F",
                   help="how much faster (0.1 = 10%%) a plan beyond the cost model's validated "
                   "ground must be predicted than the best validated plan (default: the "
                   "model's own error there; 0: no preference)")


def constraint(text: str) -> str:
    """A constraint's text, read now so a typo fails before tracing (autopar.core.constraints)."""
    from autopar.core.constraints import parse_constraint
    from autopar.core.errors import AutoparError

    try:
        parse_constraint(text)
    except AutoparError as e:
        raise argparse.ArgumentTypeError(f"{e.what}; {e.fix}") from None
    return text


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no live progress (tracing, the mesh being solved, the best plan so "
                   "far); it shows only on a terminal anyway")


def add_constraint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--constraint", action="append", type=constraint, default=None,
                   metavar="TEXT",
                   help="what the plan must obey, repeatable: tp<=4, dp>=2, pp==2, "
                   "devices<=64, memory<=40GiB, 'schedule in 1f1b,zb_v', 'cut after 11', "
                   "'replicate lm_head', 'dtype lm_head=fp32' (a cluster file's constraints: "
                   "list adds to them); when they leave no plan, the error names the "
                   "constraints that conflict")


SHARED_FLAGS = ("--global-batch", "--seq", "--cluster", "--dp", "--tp", "--pp", "--cp", "--ep",
                "--dp-replicate",
                "--cp-algorithm", "--cp-layout", "--microbatch",
                "--schedule", "--virtual-stages", "--recompute", "--precision", "--zero",
                "--optimizer", "--no-fuse-attention", "--json")
"""Flags ``plan`` and ``estimate`` both take (tests check their help texts are the same)."""


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless it has none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and "%(default)" not in text
                and not any(default is v for v in (None, False, True, argparse.SUPPRESS))):
            text += f" (default: {default})".replace("%", "%%")
        return text
