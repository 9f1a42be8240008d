"""The planning knobs, one row each: the single source of their names, values and help.

A knob has one spelling: its Python keyword (``autopar.plan``, ``PlanOptions``) is its
name, and its flag is the name with dashes (``cp_layout``, ``--cp-layout``) unless the row
says otherwise. The CLI's flags (:mod:`autopar.cli.flags`: help text, choices, default),
``autopar.plan``'s docstring, the knob table of docs/cli.md (:mod:`autopar.core.knob_docs`)
and ``PlanOptions``' checks all read this table, so no two of them can drift apart.

In a help text, ``{name}`` names another knob: it shows as ``--name`` in flags' help and
as ``name`` in the Python docs.

>>> KNOBS["cp_layout"].cli, KNOBS["cp_layout"].choices
('--cp-layout', ('zigzag', 'contiguous'))
>>> KNOBS["time_limit_s"].cli
'--time-limit'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.core import knob_checks as checks
from autopar.core.knobs import (
    ATTENTION_KERNELS,
    BATCH_COUPLING_MODES,
    CP_ALGORITHMS,
    CP_LAYOUTS,
    MASTER_WEIGHTS,
    OFFLOADS_RUNNABLE,
    OPTIMIZERS,
    PRECISION_CHOICES,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    SEARCHED_RECOMPUTE_MODES,
    WEIGHT_COPIES,
    ZERO_STAGES_RUNNABLE,
)

KINDS = {
    "count": "an integer >= 1",
    "choice": "one of the choices",
    "schedule": "a schedule name",
    "stages": "ZeRO stages, comma-separated",
    "modes": "modes, comma-separated",
    "layer_modes": "one mode per layer, comma-separated",
    "override": "NODE=DTYPE, repeatable",
    "switch": "on or off",
    "seconds": "seconds > 0",
    "solves": "an integer >= 1, or none",
    "fraction": "a fraction >= 0",
    "share": "a fraction in (0, 1]",
    "boolean": "True, False or None",
    "constraint": "constraint text, repeatable",
}
"""The kinds of value a knob takes; the flag of each kind is read by the argparse type
:mod:`autopar.cli.flags` gives it ("switch": a ``--no-...`` flag turns the knob off)."""


@dataclass(frozen=True)
class Knob:
    """One planning knob. ``default`` is ``autopar.plan``'s (``None``: the solver chooses);
    ``check`` is what ``PlanOptions`` runs on it (``None``: not a PlanOptions field)."""

    name: str
    help: str
    kind: str = "count"
    default: Any = None
    choices: tuple = ()
    check: checks.Check | None = checks.positive_or_none
    flag: str | None = None  # the flag where it is not --name-with-dashes; "": no flag
    metavar: str | None = None
    old_flag: str | None = None  # a deprecated spelling the CLI still reads
    python: str = ""  # what the Python keyword takes, where the flag reads another form
    json: str = ""  # where a plan records the choice

    @property
    def cli(self) -> str:
        """The flag (empty for a knob only Python sets)."""
        return ("--" + self.name.replace("_", "-")) if self.flag is None else self.flag


def _degree(axis: str, words: str) -> Knob:
    return Knob(axis, f"{words}-parallel degree", metavar="N", json=f"mesh.{axis}")


def _choice(name: str, choices: tuple[str, ...], default: str | None, help: str,
            none_chooses: bool = False, **more: Any) -> Knob:
    return Knob(name, help, "choice", default, choices,
                checks.one_of(choices, none_chooses), **more)


_TABLE = (
    Knob("global_batch", "sequences per optimizer step (default: the model's)", metavar="N",
         old_flag="--batch", json="batch.global"),
    _degree("dp", "data"),
    _degree("tp", "tensor"),
    _degree("pp", "pipeline"),
    _degree("cp", "context"),
    _degree("ep", "expert (carved out of dp)"),
    Knob("dp_replicate", "HSDP: ZeRO shards within dp/N consecutive data-parallel ranks and "
         "the N groups replicate (1: shard over all of dp; default: chosen by cost)",
         metavar="N", json="training.dp_replicate"),
    _choice("cp_algorithm", CP_ALGORITHMS, None, "attention under context parallelism: ring "
            "(K/V passed around, overlapped), all_gather (K/V gathered, cheap with few K/V "
            "heads) or ulysses (all-to-all heads <-> sequence); default: the cheapest modelled",
            none_chooses=True, json="context.algorithm"),
    _choice("cp_layout", CP_LAYOUTS, "zigzag", "how a sequence is cut over cp: zigzag (2 x cp "
            "chunks, rank i holds i and 2cp-1-i: even causal work) or contiguous",
            json="context.layout"),
    Knob("devices", "use N of the cluster's devices (the first: whole nodes, or part of one "
         "node); default: all, or fewer when that is predicted faster (unless a mesh degree "
         "is pinned)", check=None, metavar="N", json="explanation.devices.used"),
    Knob("schedule", "pipeline schedule: gpipe, 1f1b, interleaved (interleaved 1F1B) or zb_v "
         "(zero-bubble V)", "schedule", choices=SCHEDULES, check=checks.schedule,
         metavar="NAME", json="pipeline.schedule"),
    Knob("virtual_stages", "model chunks per pipeline rank (interleaved schedule)",
         metavar="V", json="pipeline.virtual_stages"),
    Knob("microbatch", "sequences per microbatch on each data-parallel rank", metavar="N",
         json="batch.microbatch"),
    Knob("microbatches", "microbatches per step on each data-parallel rank (instead of "
         "{microbatch})", metavar="N", json="batch.microbatches"),
    _choice("batch_coupling", BATCH_COUPLING_MODES, "exact", "exact: split the batch (dp, "
            "microbatches) only where ops coupling its samples (balancing losses, batch norm) "
            "stay exact; local: split anyway, each rank's statistics its own (as DDP does)",
            json="training.batch_coupling"),
    Knob("precision", "compute precision: bf16/fp16 matmuls (fp16 with loss scaling), fp8 "
         "linears, or fp32; mixed precision keeps fp32 master weights, and normalisations, "
         "softmax and losses in fp32; auto: the fastest the device runs without loss scaling "
         "(default: bf16 on GPUs, fp32 on CPU)", "choice", None, PRECISION_CHOICES,
         checks.one_of(PRECISIONS), old_flag="--dtype", json="training.precision"),
    Knob("precision_overrides", "compute one fx node, or every node of a module path, in "
         f"DTYPE ({', '.join(PRECISIONS)}); repeatable", "override",
         check=checks.precision_overrides, flag="--precision-override", metavar="NODE=DTYPE",
         python="a dict: node name or module path -> dtype word",
         json="precision_policy.overrides"),
    _choice("master_weights", MASTER_WEIGHTS, "optimizer", "where mixed precision keeps the "
            "fp32 master weights under ZeRO 1-3: 'optimizer' (16-bit parameters, the fp32 "
            "masters sharded with the optimizer states, gradients accumulated and reduced in "
            "fp32: Megatron-LM's distributed optimizer, FSDP2's MixedPrecisionPolicy; 2 + 4 + "
            "12/dp bytes per parameter at ZeRO-1) or 'params' (fp32 parameters, cast to 16 bits "
            "once a step). At ZeRO-0 the two are the same bytes and run as 'params'"),
    _choice("weight_copies", WEIGHT_COPIES, "step", "how long the low-precision copy of "
            "an fp32 weight lives (16-bit for bf16/fp16 matmuls, fp8 for fp8 linears): step "
            "(one copy for the whole step, shared by its microbatches and recomputations: "
            "autopar's runtime, Megatron-LM's 16-bit parameters, Transformer Engine's weight "
            "workspaces) or use (made where it is read and kept by each microbatch in flight: "
            "torch.autocast, torchao's Float8Linear; priced only)", flag=""),
    _choice("optimizer", OPTIMIZERS, "adamw", "optimizer whose states are counted",
            json="training.optimizer"),
    Knob("zero", "ZeRO stage 0-3 (0: DDP, 3: FSDP2 fully_shard); plan may be given several, "
         "comma-separated, to choose from", "stages", ZERO_STAGES_RUNNABLE,
         ZERO_STAGES_RUNNABLE, checks.stages, metavar="STAGES",
         python="a stage, or a tuple of them", json="training.zero"),
    Knob("offload", "where ZeRO-3's parameter, gradient and optimizer shards may live: none "
         "(device memory) or optimizer+params (host memory, the optimizer stepping there: "
         "FSDP2's CPUOffloadPolicy, priced with the host link and a host optimizer); with "
         "both, the default, offload is used only when no plan fits in device memory "
         "without it", "choice", ("none", "optimizer+params"), OFFLOADS_RUNNABLE,
         checks.offloads, flag="", python="a mode, or a tuple of them",
         json="training.offload"),
    Knob("recompute", "activation recomputation: none, selective, full or op (torchtitan's "
         "per-op policy); plan may be given several, comma-separated, to choose from for "
         "each layer", "modes", SEARCHED_RECOMPUTE_MODES, RECOMPUTE_MODES,
         checks.recompute_modes, metavar="MODES", python="a mode, or a tuple of them",
         json="training.recompute"),
    Knob("recompute_layers", "one recomputation mode per repeated layer, comma-separated, in "
         "the order the layers run (pins recomputation per layer)", "layer_modes",
         choices=RECOMPUTE_MODES, check=checks.layer_modes, metavar="MODES",
         python="a tuple, one mode per layer", json="training.recompute_layers"),
    Knob("tp_splits_batch", "whether tensor parallelism may split the batch (data "
         "parallelism inside a tp group); default: off when tp is pinned (Megatron's tensor "
         "parallelism, which splits work within each sequence only), on when the solver "
         "chooses tp", "boolean", check=checks.boolean, flag=""),
    Knob("fuse_attention", "keep attention op by op as traced, instead of one generated fused "
         "kernel", "switch", True, check=checks.boolean, flag="--no-fuse-attention",
         json="attention[].fused"),
    Knob("compile", "run each rank's program through torch.compile (Inductor): each outlined "
         "layer compiled (torchtitan's per-block compile), or the whole program; a graph it "
         "cannot compile runs eagerly, the reason logged; priced with fused elementwise "
         "kernels", "switch", False, check=checks.boolean, flag="--compile",
         json="training.compile"),
    Knob("chunked_loss", "keep torch's cross-entropy (its [tokens, vocab] log-softmax), "
         "instead of computing it a block of tokens at a time", "switch", True,
         check=checks.boolean, flag="--no-chunked-loss", json="training.chunked_loss"),
    _choice("attention_kernel", ATTENTION_KERNELS, "generated", "what the fused attention "
            "sites are priced as: generated (autopar's own kernels, which its program runs "
            "on GPUs, at the device's generated_attention_forward/_backward) or device (the "
            "kernel the cluster's attention_efficiency describes: to price a run by another "
            "framework, such as SDPA's flash backend or cuDNN)", flag=""),
    Knob("memory_fraction", "share of device memory a plan may fill (the rest is headroom for "
         "the allocator and the runtime's own buffers)", "share", 0.9,
         check=checks.memory_share, flag=""),
    Knob("time_limit_s", "CP-SAT seconds per mesh candidate", "seconds", 20.0,
         check=checks.seconds, flag="--time-limit", metavar="S"),
    Knob("max_solves", "CP-SAT solves the search may run; past them only layouts already "
         "solved are priced, and the plan says so ('none': no limit)",
         "solves", 300, metavar="N", python="an integer >= 1, or None (no limit)",
         json="solver.max_solves"),
    Knob("constraints", "what the plan must obey, repeatable: tp<=4, dp>=2, pp==2, "
         "devices<=64, memory<=40GiB, 'schedule in 1f1b,zb_v', 'cut after 11', "
         "'replicate lm_head', 'dtype lm_head=fp32' (a cluster file's constraints: list "
         "adds to them); when they leave no plan, the error names the constraints that "
         "conflict", "constraint", check=checks.constraint_tuple, flag="--constraint",
         metavar="TEXT", python="Constraint objects or their text (autopar.core.constraints)",
         json="constraints"),
    Knob("extrapolation_margin", "how much faster (0.1 = 10%) a plan beyond the cost model's "
         "validated ground must be predicted than the best validated plan (default: the "
         "model's own error there; 0: no preference)", "fraction", check=checks.margin,
         metavar="F", json="predicted.ground_margin"),
)

KNOBS: dict[str, Knob] = {knob.name: knob for knob in _TABLE}
"""Every planning knob by name, in the order PlanOptions checks them and docs list them."""

OPTION_KNOBS = tuple(knob for knob in _TABLE if knob.check is not None)
"""The knobs ``PlanOptions`` holds, each with its check."""
