"""Predicted vs published for the measured runs in ``benchmarks/data/*.csv``.

Each row is a published training run (its source, table and page are on the row). A row the
cost model can express -- a GPT or Llama model, fp16/bf16, no torch.compile, no context
parallelism -- is traced on meta tensors at its sizes and priced by ``autopar estimate``'s
model with the row's own layout (tp, pp, dp, ZeRO, microbatch, recomputation) on the row's
hardware. Rows it cannot express are listed with the reason, never dropped silently.

Recomputation: torchtitan's per-op selective policy is autopar's ``op`` mode; its per-layer
policy (``selective_ac_option = "2"``, torchtitan's default: every 2nd layer rerun whole) is
``PinnedConfig.recompute_layers`` with ``full`` on every 2nd layer. A source that says
"selective" per layer without the frequency is priced with that default, and says so.

Precision: fp8 with tensorwise scaling (torchtitan's float8 default, Transformer Engine's
delayed and current scaling) is autopar's ``fp8``; rowwise scaling is a different recipe and
is not priced.

    python benchmarks/fidelity_published.py --sources          # every source
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autopar.core.cluster import load_cluster
from autopar.core.cluster.presets import (
    HOPPER_FLASH_ATTENTION_2_CURVE,
    HOPPER_NATIVE_ATTENTION_EFFICIENCY,
)
from autopar.core.graph_facts import graph_facts
from autopar.cost_models.memory import REPORT_FRAGMENTATION
from autopar.models import resolve_model
from autopar.solver.search.pinned import PinnedConfig, estimate_graph
from autopar.trace import trace

HARDWARE = (  # (words in the source's device name, autopar preset), first match wins
    (("H100", "96GB"), "H100-96GB"), (("H100", "HBM2E"), "H100-96GB"),
    (("H100",), "H100-80GB"), (("H200",), "H200"),
    (("A100", "40GB"), "A100-40GB"), (("A100",), "A100-80GB"), (("V100",), "V100-32GB"),
)


def preset_of(hardware: str | None) -> str | None:
    """The preset for a source's device name (``H100-SXM-96GB-HBM2e-500W`` -> H100-96GB)."""
    name = (hardware or "").upper()
    return next((preset for words, preset in HARDWARE if all(w in name for w in words)), None)

RECOMPUTE = {"none": "none", "full": "full", "selective-op": "op", "selective-layer": "none"}
"""The source's recomputation -> autopar's (per layer: see ``layer_modes``)."""
SELECTIVE_LAYER_EVERY = 2
"""torchtitan's default ``selective_ac_option``: every 2nd layer is recomputed whole."""

PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "fp8", "fp8-cs": "fp8",
             "float8": "fp8", "float8-tensorwise": "fp8"}
"""The source's precision -> autopar's (fp8 recipes with one scale per tensor)."""

PLANNED_ELSEWHERE = {
    "llama3_paper_2024": "its schedule, recomputation and sharding are not published: "
                         "benchmarks/llama3_405b.py plans them with the layout pinned",
}
"""Sources whose rows leave open knobs a pinned estimate would have to guess."""

GIB = 2**30

_MEGATRON_CORE = {
    # Megatron-Core's distributed optimizer (optimizer state and fp32 master weights sharded
    # over dp, gradients reduce-scattered: ZeRO-1's footprint) is what NeMo's pretraining
    # recipes run (``use_distributed_optimizer=True`` / ``distributed_fused_adam``), and
    # the model computes with 16-bit parameters (Float16Module); the tables print neither.
    "zero": "1", "master_weights": "optimizer",
    # NeMo's LLM pretraining recipes run one sequence per microbatch
    # (``micro_batch_size=1``; the performance summary's MBS column for Llama 2/3) and
    # accumulate the rest; a table that prints no MBS ran the recipe's.
    "micro_batch": "1",
    # NeMo's throughput callback counts model FLOPs by ``nemo/utils/flops_formulas.py``
    # (``llama2``/``llama3``/``gpt3``): full (non-causal) attention, 12·s·h per token and
    # layer, and the logits; a TFLOPS column is that count over the measured step time.
    "flops": "nemo",
    # Megatron-Core's attention is Transformer Engine's, which prefers cuDNN's fused
    # attention over FlashAttention-2 on Hopper (``DotProductAttention.forward`` since TE
    # 1.4; FlashAttention-2 is an Ampere kernel): a Hopper-native kernel.
    "attention": "hopper-native",
    # Transformer Engine fuses the elementwise work around the matmuls (RMSNorm with the
    # fp8 cast of its output, SwiGLU, rotary embeddings, bias-dropout-add): priced as a
    # program whose elementwise chains run as one kernel (autopar.solver.pricing.elementwise_fusion).
    "fuse_elementwise": True,
    # Megatron-Core's context parallelism passes keys and values around a ring
    # (``cp_comm_type="p2p"``, its only algorithm until mid-2024 and still the default).
    "cp_algorithm": "ring",
    # Under its interleaved schedule Megatron-Core posts pipeline sends and receives ahead
    # of the chunk they run beside (``overlap_p2p_comm``: NeMo's launcher configs set it,
    # NeMo 2 / Megatron-Bridge's comm-overlap callback turns it on whenever vp > 1).
    "p2p_overlap_interleaved": True,
    # The output layer is a plain ColumnParallelLinear outside Transformer Engine's fp8
    # autocast: it runs bf16 in an fp8 run (autopar's fp8 policy would convert it).
    "fp8_head": "bf16",
}
_TORCHTITAN = {
    # With pipeline parallelism torchtitan does not reshard after forward
    # (``parallelize_llama.py@9dec370``: "to avoid per-microbatch all-gathers"), and
    # ``torch.distributed.pipelining`` runs every backward but the last without gradient
    # sync (``PipelineStage.backward_maybe_with_nosync``): weights whole through the step,
    # whole gradients accumulated and reduce-scattered once -- ZeRO-1's program.
    "zero_with_pp": "1",
    # ``pipeline_parallel_microbatches`` unset: as many microbatches as pipeline ranks
    # (``pipeline_llama.py@9dec370``).
    "pp_microbatches": "pp",
    # torchao's Float8Linear casts the weight where the linear runs and saves the 16-bit
    # weight for backward (``float8_linear.py``): no fp8 weight copy outlives its layer.
    "weight_copies": "use",
    # Its float8 conversion skips the output layer (``filter_fqns = ["output"]``): bf16.
    "fp8_head": "bf16",
}
_NEMO_LAUNCHER_2024 = {
    **_MEGATRON_CORE,
    # NeMo-Framework-Launcher up to its 24.07 release exported ``NVTE_FUSED_ATTN: 0`` to every
    # job ("Disable cudnn FA until we've tested it more", ``launcher_scripts/conf/config.yaml``
    # at tags 24.01-24.07; on from 24.09, 04b8d098 "enable fused attention"): Transformer
    # Engine then ran FlashAttention-2 (the flash-attn package), with and without context
    # parallelism, where its default on Hopper is cuDNN's kernel. The 24.03 long-sequence
    # and 24.07 summary runs are launcher runs of those containers.
    "attention": "flash-attention-2",
}
FRAMEWORK_DEFAULTS = {"nemo_24_07_h100_pretrain": _NEMO_LAUNCHER_2024,
                      "torchtitan_llama3_h100_202412": _TORCHTITAN,
                      "torchtitan_performance_md_2024": _TORCHTITAN,
                      "torchtitan_asynctp_h100_202506": _TORCHTITAN,
                      "torchtitan_trainy_h200_202506": _TORCHTITAN,
                      "megatron_bridge_perf_h100": _MEGATRON_CORE,
                      "nemo_long_sequence_cp": _NEMO_LAUNCHER_2024}
"""What each source's framework runs where its rows leave it unstated: ZeRO stage, and where
the fp32 master weights live."""

_NEMO_CONTAINER = re.compile(r"nemo[ _-]?(\d{2})\.(\d{2})")


def framework_defaults(row: dict) -> dict:
    """What ``row``'s framework runs where the row leaves it unstated: its file's entry in
    :data:`FRAMEWORK_DEFAULTS`, else the framework its source names (a table this harness
    has no entry for): torchtitan; Megatron-Bridge; NeMo, whose launcher ran
    FlashAttention-2 up to its 24.07 container (``_NEMO_LAUNCHER_2024``). Nothing for
    anything else.

    >>> framework_defaults({"source": "NeMo docs", "notes": "container NeMo24.05"})["attention"]
    'flash-attention-2'
    >>> framework_defaults({"source": "NVIDIA NeMo performance summary (NeMo 25.02)"})["attention"]
    'hopper-native'
    >>> framework_defaults({"source": "a PyTorch FSDP blog"})
    {}
    """
    stem = Path(row.get("_file") or "").stem
    if stem in FRAMEWORK_DEFAULTS:
        return FRAMEWORK_DEFAULTS[stem]
    text = " ".join(row.get(k) or "" for k in ("source", "url", "file", "notes")).lower()
    if "torchtitan" in text:
        return _TORCHTITAN
    if "megatron-bridge" in text:
        return _MEGATRON_CORE
    if "nemo" in text:
        release = _NEMO_CONTAINER.search(text)
        if release and (int(release[1]), int(release[2])) <= (24, 7):
            return _NEMO_LAUNCHER_2024
        return _MEGATRON_CORE
    return {}

ARCHITECTURES = {  # released configs (Hugging Face config.json of each model), for rows
    # whose source names the model but not all its sizes: (layers, hidden, ffn, heads,
    # kv_heads, vocab)
    "llama2-7b": (32, 4096, 11008, 32, 32, 32000),      # meta-llama/Llama-2-7b-hf
    "llama2-13b": (40, 5120, 13824, 40, 40, 32000),     # meta-llama/Llama-2-13b-hf
    "llama2-34b": (48, 8192, 22016, 64, 8, 32000),      # codellama/CodeLlama-34b-hf (the
    # Llama 2 34B architecture; Llama 2 34B itself was not released)
    "llama2-70b": (80, 8192, 28672, 64, 8, 32000),      # meta-llama/Llama-2-70b-hf
    "llama3-8b": (32, 4096, 14336, 32, 8, 128256),      # meta-llama/Meta-Llama-3-8B
    "llama3-70b": (80, 8192, 28672, 64, 8, 128256),     # meta-llama/Meta-Llama-3-70B
    # NeMo's GPT-3 recipes (NeMo-Framework-Launcher launcher_scripts/conf/training/gpt3/
    # {5b,20b,175b}.yaml@24.07): 4h FFN, multi-head attention, the GPT-2 BPE tokenizer's
    # 50,257 tokens (GPT2BPETokenizer; Megatron pads it to a multiple of 128 x tp)
    "gpt3-5b": (24, 4096, 16384, 32, 32, 50257),
    "gpt3-20b": (44, 6144, 24576, 48, 48, 50257),
    "gpt3-175b": (96, 12288, 49152, 96, 96, 50257),
}
_ARCH_COLUMNS = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab")


def with_architecture(row: dict) -> dict:
    """``row`` with the sizes it leaves empty taken from its model's released config (the
    row's own numbers win; a filled column is named in ``filled``)."""
    arch = ARCHITECTURES.get((row.get("model") or "").lower().replace("llama3.1", "llama3"))
    if arch is None:
        return row
    out = dict(row)
    out["filled"] = [k for k, v in zip(_ARCH_COLUMNS, arch) if row.get(k) in (None, "")]
    for k in out["filled"]:
        out[k] = arch[_ARCH_COLUMNS.index(k)]
    return out


@dataclass
class Outcome:
    """One row: the published figures, the predicted ones, or why it was not predicted."""

    row: dict
    skipped: str = ""
    predicted: float = math.nan  # in the row's throughput unit
    published: float = math.nan
    predicted_gib: float = math.nan  # live bytes + the report's fragmentation allowance
    published_gib: float = math.nan
    notes: list[str] = field(default_factory=list)
    fits: bool = True  # the model's live bytes within the device's memory (estimate's test)
    mesh: dict = field(default_factory=dict)
    zero: int = 0
    schedule: str | None = None
    cp_algorithm: str | None = None  # the attention algorithm priced under cp

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published

    @property
    def memory_error(self) -> float:
        return (self.predicted_gib - self.published_gib) / self.published_gib


def _num(row: dict, key: str, default: float | None = None) -> float | None:
    value = row.get(key)
    if value in (None, ""):
        return default
    return float(value)


def expressible(row: dict) -> str:
    """Why the cost model cannot price ``row`` ("" when it can)."""
    precision = (row.get("precision") or "").lower()
    if precision not in PRECISION:
        why = ("rowwise scaling (autopar's fp8 scales per tensor)" if "rowwise" in precision
               else "not stated by the source")
        return f"precision {precision or '?'}: {why}"
    if "async tp" in (row.get("scheme") or "").lower():
        return "async TP (tensor-parallel communication overlapped in the matmuls) is not modelled"
    stem = Path(row.get("_file") or "").stem
    if stem in PLANNED_ELSEWHERE:
        return PLANNED_ELSEWHERE[stem]
    model = (row.get("model") or "").lower()
    if compiled(row):
        # Inductor's fusion is priced (PinnedConfig.fuse_elementwise), but what else a
        # compiled program changes is not: rows measured under it are not predicted
        # (priced with fusion, torchtitan 2024-12's compiled bf16 rows came out +12% and
        # +16%, its Float8 ones +20% to +26% and its 70B 2D row not fitting;
        # benchmarks/results/fused_elementwise_2026-11-29.md)
        return "torch.compile (its fusion is priced; the rest of what it changes is not)"
    if not any(k in model for k in ("llama", "gpt")):
        return f"model {row.get('model')!r} (only GPT and Llama rows are built)"
    if preset_of(row.get("hardware")) is None:
        return f"hardware {row.get('hardware')!r} has no preset"
    if (row.get("recompute") or "none") not in RECOMPUTE:
        return f"recompute {row.get('recompute')!r}"
    unit = (row.get("throughput_unit") or "").lower()
    if "token" not in unit and "tflop" not in unit:
        return f"throughput unit {row.get('throughput_unit')!r}"
    if not any(row.get(k) for k in ("tp", "pp", "dp", "zero_stage")):
        return "parallel layout not stated by the source"
    for key in ("layers", "hidden", "heads", "vocab", "seq_len", "gpus", "global_batch"):
        if _num(row, key) is None:
            return f"no {key}"
    if _num(row, "ffn_hidden") is None and "llama" in model:
        return "no ffn_hidden"
    return ""


def compiled(row: dict) -> bool:
    """Whether the row's program ran under ``torch.compile``: Inductor fuses its
    elementwise chains (priced as ``PinnedConfig.fuse_elementwise``)."""
    return (row.get("compile") or "").lower() in ("yes", "true", "1")


def model_spec(row: dict) -> str:
    sizes = {k: int(_num(row, k)) for k in ("layers", "hidden", "heads", "vocab")}
    seq, batch = int(_num(row, "seq_len")), int(_num(row, "global_batch"))
    if "llama" in row["model"].lower():
        kv = int(_num(row, "kv_heads", sizes["heads"]))
        ffn = int(_num(row, "ffn_hidden"))
        return (f"llama:layers={sizes['layers']},hidden={sizes['hidden']},heads={sizes['heads']},"
                f"kv_heads={kv},ffn={ffn},vocab={sizes['vocab']},seq={seq}")
    return (f"gpt:layers={sizes['layers']},hidden={sizes['hidden']},heads={sizes['heads']},"
            f"vocab={sizes['vocab']},seq={seq},batch={batch}")


def row_cluster(row: dict, attention: str | None = None):
    """The row's cluster; ``attention`` names the source's kernel when it is not SDPA's:
    ``hopper-native`` (cuDNN's, FlashAttention-3) or ``flash-attention-2`` (on Hopper, its
    measured curve: ``autopar.core.cluster.presets.HOPPER_FLASH_ATTENTION_2_CURVE``)."""
    gpus = int(_num(row, "gpus"))
    per_node = int(_num(row, "devices_per_node", 8))
    preset = preset_of(row["hardware"])
    spec: dict = {"nodes": max(1, gpus // per_node), "devices_per_node": min(per_node, gpus),
                  "device": {"preset": preset}}
    if (preset or "").startswith(("H100", "H200")):
        if attention == "hopper-native":
            spec["device"]["attention_efficiency"] = HOPPER_NATIVE_ATTENTION_EFFICIENCY
        elif attention == "flash-attention-2":
            spec["device"]["attention_efficiency_curve"] = [
                list(p) for p in HOPPER_FLASH_ATTENTION_2_CURVE]
    gbps = _num(row, "inter_node_gbps_per_gpu")
    if gbps:
        spec["inter_node_link"] = {"bandwidth_bytes_per_s": gbps / 8 * 1e9}
    return load_cluster(spec)


def nemo_model_flops(row: dict, batch: int, seq: int) -> float:
    """Model FLOPs of one global batch as NeMo counts them (``nemo/utils/flops_formulas.py``,
    ``llama2``/``llama3``: per token and layer 12·h² for Q and O, 12·h²·groups/heads for K
    and V, 18·h·ffn for the gated MLP, 12·s·h for attention without the causal half, and
    6·V·h once for the logits; ``gpt3``: 24·h² + 4·s·h per layer, times 3, plus the logits)."""
    layers, h, heads, vocab = (int(_num(row, k)) for k in ("layers", "hidden", "heads", "vocab"))
    tokens = batch * seq
    if "llama" in row["model"].lower():
        groups, ffn = int(_num(row, "kv_heads", heads)), int(_num(row, "ffn_hidden"))
        return tokens * layers * h * h * (12 + 12 * groups / heads + 18 * ffn / h + 12 * seq / h
                                         + 6 * vocab / (layers * h))
    return (24 * tokens * h * h + 4 * tokens * seq * h) * 3 * layers + 6 * tokens * h * vocab


_TRACED: dict[tuple, torch.fx.GraphModule] = {}


def predict_row(row: dict) -> Outcome:
    row = with_architecture(row)
    out = Outcome(row, published=_num(row, "throughput_value", math.nan),
                  published_gib=_num(row, "memory_gib", math.nan))
    why = expressible(row)
    if why:
        out.skipped = why
        return out
    gpus, batch = int(_num(row, "gpus")), int(_num(row, "global_batch"))
    tp, pp, cp = int(_num(row, "tp", 1)), int(_num(row, "pp", 1)), int(_num(row, "cp", 1))
    dp = int(_num(row, "dp", gpus // (tp * pp * cp)))
    if tp * pp * dp * cp != gpus:
        out.skipped = f"tp {tp} x pp {pp} x dp {dp} x cp {cp} != {gpus} GPUs"
        return out
    defaults = framework_defaults(row)
    zero_text = (row.get("zero_stage") or defaults.get("zero", "0")).lower()
    if not row.get("zero_stage") and "zero" in defaults:
        out.notes.append(f"ZeRO-{defaults['zero']} (the source's framework default)")
    zero = 3 if zero_text in ("fsdp", "3", "zero-3", "zero3") else int(float(zero_text or 0))
    if zero == 3 and pp > 1 and "zero_with_pp" in defaults:
        zero = int(defaults["zero_with_pp"])
        out.notes.append(f"FSDP with pipeline stages runs as ZeRO-{zero} (the framework's)")
    local = int(_num(row, "local_batch", batch // dp))
    unstated = local if pp == 1 else (
        local // pp if defaults.get("pp_microbatches") == "pp" else 1)
    micro = int(_num(row, "micro_batch", _num(defaults, "micro_batch", unstated)))
    if micro < 1 or local < micro:
        out.skipped = f"global batch {batch} over dp {dp} leaves no {micro}-sequence microbatch"
        return out
    recompute = RECOMPUTE[row.get("recompute") or "none"]
    layer_modes: tuple[str, ...] = ()
    if row.get("recompute") == "selective-layer":
        layers = int(_num(row, "layers"))
        layer_modes = tuple("full" if (i + 1) % SELECTIVE_LAYER_EVERY == 0 else "none"
                            for i in range(layers))
        out.notes.append(f"every {SELECTIVE_LAYER_EVERY}nd layer recomputed (torchtitan's "
                         "default; the source does not say)")
    if row.get("filled"):
        out.notes.append(f"{', '.join(row['filled'])} from the released config")
    vpp = int(_num(row, "vpp", 1))
    schedule = (row.get("schedule") or ("interleaved" if vpp > 1 else "1f1b")) if pp > 1 else None
    overrides: tuple[tuple[str, str], ...] = ()
    if PRECISION[row["precision"].lower()] == "fp8" and "fp8_head" in defaults:
        overrides = (("lm_head", defaults["fp8_head"]),)
        out.notes.append(f"output layer {defaults['fp8_head']} (the framework's)")
    tp_overlap = tp > 1 and row.get("tp_comm_overlap") == "yes"
    p2p_overlap = pp > 1 and vpp > 1 and bool(defaults.get("p2p_overlap_interleaved"))
    if p2p_overlap:
        out.notes.append("pipeline sends overlapped (the framework's, interleaved)")
    if tp_overlap:
        out.notes.append("tp collectives pipelined with the matmuls (the recipe's)")
    spec_text = model_spec(row)
    seq = int(_num(row, "seq_len"))
    key = (spec_text, micro)
    if key not in _TRACED:
        spec = resolve_model(spec_text)
        with torch.device("meta"):
            model = spec.build()
        _TRACED[key] = trace(model, spec.example_inputs(micro, seq))
    gm = _TRACED[key]
    config = PinnedConfig(tp=tp, pp=pp, dp=dp, cp=cp, sp=tp > 1, microbatch=micro, global_batch=batch,
                          recompute=recompute, recompute_layers=layer_modes,
                          precision=PRECISION[row["precision"].lower()], zero=zero,
                          precision_overrides=overrides, tp_overlap=tp_overlap,
                          p2p_overlap=p2p_overlap,
                          optimizer="adamw", schedule=schedule or "1f1b",
                          virtual=vpp if pp > 1 else 1,
                          # Megatron-style tensor parallelism (column/row pairs, sequence
                          # parallelism), as torchtitan's and NeMo's runs shard: the pinned
                          # estimate lifts the memory limit, and its own fastest layout would
                          # keep some weights whole on every tp rank.
                          layout="megatron" if tp > 1 else "auto",
                          # the published programs take the loss over whole logits
                          chunked_loss=False,
                          fuse_elementwise=compiled(row) or bool(defaults.get("fuse_elementwise")),
                          cp_algorithm=defaults.get("cp_algorithm") if cp > 1 else None,
                          master_weights=defaults.get("master_weights", "params"),
                          weight_copies=defaults.get("weight_copies", "step"),
                          # the run's own attention kernel (SDPA's flash backend, cuDNN),
                          # which the cluster's attention_efficiency describes
                          attention_kernel="device")
    est = estimate_graph(gm, row_cluster(row, defaults.get("attention")), config)
    step = est.prediction.step_time_s
    unit = row["throughput_unit"].lower()
    if "token" in unit:
        out.predicted = batch * seq / step / gpus
    else:
        if defaults.get("flops") == "nemo":
            flops = nemo_model_flops(row, batch, seq)
            out.notes.append("FLOPs by NeMo's formula (non-causal attention)")
        else:
            facts = graph_facts(gm)
            flops = (facts.fwd_flops + facts.bwd_flops) * batch / (facts.batch_size or 1)
        out.predicted = flops / step / gpus / 1e12
    out.predicted_gib = est.prediction.peak_memory_bytes * (1 + REPORT_FRAGMENTATION) / GIB
    out.fits = est.prediction.peak_memory_bytes <= est.tables.cluster.device.memory_bytes
    if not out.fits:
        out.notes.append("PREDICTED NOT TO FIT, though the run ran")
    out.mesh = {"pp": pp, "dp": dp, **({"cp": cp} if cp > 1 else {}), "tp": tp}
    out.zero, out.schedule = zero, schedule
    out.cp_algorithm = est.tables.setting.cp_algorithm
    return out


RANKING_TIE = 0.02
"""Published figures closer than this (relative) order nothing: run-to-run variation of a
training job's throughput is of this size, and a source reports one run per row (torchtitan's
Llama 2 7B: 1,914 vs 1,904 words/s for two recomputation policies, 0.5% apart)."""


def ranking_pairs(outcomes: list[Outcome]) -> list[tuple[Outcome, Outcome, bool]]:
    """Rows of one source that compare layouts or GPU counts for the same model on the same
    hardware, in a per-GPU unit, and whose published figures differ by more than
    :data:`RANKING_TIE`: (a, b, the model orders them as the measurements do)."""
    return [pair for pair in comparable_pairs(outcomes) if _ordered(pair[0], pair[1])]


def _ordered(a: Outcome, b: Outcome) -> bool:
    """Whether two published figures are further apart than :data:`RANKING_TIE`."""
    return abs(a.published - b.published) > RANKING_TIE * max(a.published, b.published)


def comparable_pairs(outcomes: list[Outcome]) -> list[tuple[Outcome, Outcome, bool]]:
    """:func:`ranking_pairs` before ties are left out."""
    done = [o for o in outcomes if not o.skipped]
    pairs = []
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            same = all(a.row.get(k) == b.row.get(k)
                       for k in ("source", "hardware", "model", "seq_len", "throughput_unit"))
            if not same or a.published == b.published:
                continue
            pairs.append((a, b, (a.published > b.published) == (a.predicted > b.predicted)))
    return pairs


def summarize(outcomes: list[Outcome]) -> dict:
    done = [o for o in outcomes if not o.skipped]
    errors = [abs(o.error) for o in done]
    mem = [abs(o.memory_error) for o in done if not math.isnan(o.published_gib)]
    comparable = comparable_pairs(outcomes)
    pairs = [pair for pair in comparable if _ordered(pair[0], pair[1])]
    return {
        "rows": len(outcomes), "predicted": len(done),
        "median": statistics.median(errors) if errors else math.nan,
        "worst": max(errors) if errors else math.nan,
        "memory_median": statistics.median(mem) if mem else math.nan,
        "memory_worst": max(mem) if mem else math.nan,
        "pairs": len(pairs), "agree": sum(ok for _, _, ok in pairs),
        "ties": len(comparable) - len(pairs),
        "not_fit": sum(not o.fits for o in done),
    }
