"""Every bad input a demanding user can give ends in a clear error, never in a traceback,
a hang or a silent acceptance.

One table of cases. A command-line case runs ``autopar ARGV`` in process: it must exit with
status 2, either through argparse (a usage error naming the flag) or with ``autopar: what /
where / fix`` on stderr, raised as the expected ``AutoparError`` subclass. An API case calls
a public function, which must raise the expected class with all three parts. Every case
names the words that point at the culprit (the flag, key, file, line or op). ``{d}`` in a
case is the folder of the files in ``FILES``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
import autopar.cli.main as cli
from autopar.core.cluster import Cluster, DeviceSpec, LinkSpec
from autopar.core.errors import (
    AutoparError,
    ClusterError,
    ModelSpecError,
    NoFeasiblePlanError,
    TraceError,
)
from autopar.core.knobs import schedule_name
from autopar.models import GPT, GPTConfig, resolve_model
from autopar.solver.options import PlanOptions
from autopar.solver.search.pinned import PinnedConfig
from autopar.trace import TensorSpec
from tests.test_errors import assert_well_formed, run_cli

USAGE = SystemExit
"""The expected "class" of an argparse usage error (it exits with status 2)."""

TINY = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,batch=8"
LLAMA = "llama:layers=2,hidden=32,heads=4,ffn=64,vocab=64,seq=16"
MIXTRAL = "mixtral:layers=2,hidden=32,heads=4,ffn=64,vocab=64,seq=16"
NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x){tail}
"""

FILES: dict[str, str | bytes] = {
    # model factories
    "raises.py": "import torch\n\ndef make():\n    raise RuntimeError('boom: no weights here')\n",
    "needs_args.py": "def make(width, depth=2):\n    return None\n",
    "syntax.py": "def make(:\n    pass\n",
    "indent.py": "def make():\nreturn 1\n",
    "imports.py": "import not_a_real_module_xyz\n\ndef make():\n    pass\n",
    "cuda.py": "import torch\n\ndef make():\n    return torch.nn.Linear(4, 4).cuda()\n",
    "exits.py": "import sys\nsys.exit('no')\n",
    "bare.py": NET.format(tail=".sum()") + "\ndef make():\n    return Net()\n",
    "noloss.py": NET.format(tail="") + "\ndef make():\n"
    "    return Net(), (torch.randn(8, 4),), {}\n",
    "intloss.py": NET.format(tail=".argmax()") + "\ndef make():\n"
    "    return Net(), (torch.randn(8, 4),), {}\n",
    "returns_int.py": "def make():\n    return 42\n",
    "pair.py": NET.format(tail=".sum()") + "\ndef make():\n"
    "    return Net(), (torch.randn(8, 4),)\n",
    "no_tensor.py": NET.format(tail=".sum()") + "\ndef make():\n    return Net(), (3,), {}\n",
    "item.py": "import torch\n\ndef make():\n    n = int(torch.randn(()).abs().item())\n"
    "    return torch.nn.Linear(4, 4 + n), (torch.randn(8, 4),), {}\n",
    "dir.py/keep": "",
    "notes.txt": "just text\n",
    # cluster descriptions
    "binary.yaml": bytes(range(128, 256)),
    "pickle.yaml": pickle.dumps({"nodes": 1}),
    "model.pkl": pickle.dumps({"nodes": 1}),
    "dir.yaml/keep": "",
    "empty.yaml": "",
    "list.yaml": "- 1\n- 2\n",
    "string.yaml": "8xH100-80GB\n",
    "tabs.yaml": "nodes: 1\n\tdevices_per_node: 2\n",
    "nodes_text.yaml": "nodes: two\ndevices_per_node: 2\ndevice: cpu\n",
    "nodes_float.yaml": "nodes: 1.5\ndevices_per_node: 2\ndevice: cpu\n",
    "nodes_bool.yaml": "nodes: true\ndevices_per_node: 2\ndevice: cpu\n",
    "zero_devices.yaml": "nodes: 1\ndevices_per_node: 0\ndevice: cpu\n",
    "negative_nodes.yaml": "nodes: -4\ndevices_per_node: 2\ndevice: cpu\n",
    "huge_nodes.yaml": f"nodes: {10**30}\ndevices_per_node: 8\ndevice: cpu\n",
    "wide_node.yaml": "nodes: 1\ndevices_per_node: 100000\ndevice: cpu\n",
    "duplicate.yaml": "nodes: 1\nnodes: 2\ndevices_per_node: 2\ndevice: cpu\n",
    "duplicate.json": '{"nodes": 1, "devices_per_node": 2, "devices_per_node": 4, "device": "cpu"}',
    "broken.json": '{"nodes": 1, "devices_per_node": 2,,}',
    "nan.json": '{"nodes": 1, "devices_per_node": 2, "device": {"preset": "cpu", '
    '"memory_gib": NaN}}',
    "deep.json": "[" * 100_000,
    "deep.yaml": "[" * 100_000,
    "negative_bandwidth.yaml": "nodes: 1\ndevices_per_node: 2\ndevice: cpu\n"
    "intra_node_link:\n  bandwidth_gb_per_s: -5\n",
    "negative_latency.yaml": "nodes: 1\ndevices_per_node: 2\ndevice: cpu\n"
    "inter_node_link:\n  latency_us: -1\n",
    "unknown_backend.yaml": "nodes: 1\ndevices_per_node: 2\ndevice: cpu\nbackend: mpi\n",
    "typo_key.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n  memroy_gib: 3\n",
    "typo_preset.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: H1000\n",
    "no_device.yaml": "nodes: 1\ndevices_per_node: 2\n",
    "fp64.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n"
    "  peak_tflops: {fp64: 1.0}\n",
    "unsorted_curve.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n"
    "  matmul_efficiency_curve: [[1.0e+9, 0.9], [1.0e+6, 0.3]]\n",
    "efficiency.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n"
    "  matmul_efficiency: 1.5\n",
    "yaml_exponent.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n"
    "  memory_bandwidth_gb_per_s: 1e3\n",
    "huge_memory.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n"
    "  memory_gib: 1.0e+300\n",
    "tiny_memory.yaml": "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n"
    "  memory_gib: 1.0e-300\n",
    "missing_profile.yaml": "nodes: 1\ndevices_per_node: 2\ndevice: cpu\nprofile: nope.json\n",
    "name_number.yaml": "name: 5\nnodes: 1\ndevices_per_node: 2\ndevice: cpu\n",
}


@dataclass(frozen=True)
class Bad:
    """One bad input: argv for ``autopar`` or a call of the API, the error it must raise and
    the words that must name the culprit."""

    name: str
    run: list[str] | Callable[[Path], object]
    error: type[BaseException]
    words: tuple[str, ...]

    @property
    def on_cli(self) -> bool:
        return isinstance(self.run, list)


def cli_case(name: str, argv: str | list[str], error: type[BaseException], *words: str) -> Bad:
    return Bad(name, argv.split() if isinstance(argv, str) else argv, error, words)


def api_case(name: str, call: Callable[[Path], object], error: type[AutoparError],
             *words: str) -> Bad:
    return Bad(name, call, error, words)


def cluster_file(name: str, file: str, *words: str) -> Bad:
    """``autopar cluster show FILE``: a ClusterError whose message names the file."""
    return cli_case(name, ["cluster", "show", f"{{d}}/{file}"], ClusterError, file, *words)


def plan(*flags: str, model: str = TINY, cluster: str = "2xcpu") -> list[str]:
    return ["plan", model, "--cluster", cluster, *flags]


def estimate(*flags: str, model: str = TINY, cluster: str = "8xA100-80GB") -> list[str]:
    return ["estimate", model, "--cluster", cluster, *flags]


def gpt(**changes: object) -> str:
    keys = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16} | changes
    return "gpt:" + ",".join(f"{k}={v}" for k, v in keys.items())


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32))


IDX = torch.zeros(8, 16, dtype=torch.long)

CLI_CASES = [
    # --- numeric flags: argparse types, before anything runs -------------------------------
    cli_case("demo-nproc-0", "demo --nproc 0", USAGE, "--nproc", "0"),
    cli_case("demo-nproc-3", "demo --nproc 3", USAGE, "--nproc", "3"),
    cli_case("demo-steps-0", "demo --steps 0", USAGE, "--steps", ">= 1"),
    cli_case("demo-steps-negative", "demo --steps -1", USAGE, "--steps"),
    cli_case("demo-steps-huge", "demo --steps 1000000000", USAGE, "--steps", "at most"),
    cli_case("plan-tp-0", plan("--tp", "0"), USAGE, "--tp", ">= 1"),
    cli_case("plan-dp-negative", plan("--dp", "-2"), USAGE, "--dp"),
    cli_case("plan-pp-text", plan("--pp", "two"), USAGE, "--pp", "'two'"),
    cli_case("plan-pp-float", plan("--pp", "2.0"), USAGE, "--pp", "'2.0'"),
    cli_case("plan-time-limit-negative", plan("--time-limit", "-1"), USAGE, "--time-limit"),
    cli_case("plan-time-limit-0", plan("--time-limit", "0"), USAGE, "--time-limit"),
    cli_case("plan-time-limit-nan", plan("--time-limit", "nan"), USAGE, "--time-limit", "nan"),
    cli_case("plan-time-limit-inf", plan("--time-limit", "inf"), USAGE, "--time-limit", "inf"),
    cli_case("plan-virtual-stages-0", plan("--virtual-stages", "0"), USAGE, "--virtual-stages"),
    cli_case("plan-microbatch-0", plan("--microbatch", "0"), USAGE, "--microbatch"),
    cli_case("plan-microbatches-negative", plan("--microbatches", "-3"), USAGE,
             "--microbatches"),
    cli_case("plan-seq-0", plan("--seq", "0"), USAGE, "--seq"),
    cli_case("plan-global-batch-0", plan("--global-batch", "0"), USAGE, "--global-batch"),
    cli_case("plan-deprecated-batch-0", plan("--batch", "0"), USAGE, "--batch"),
    cli_case("plan-zero-5", plan("--zero", "5"), USAGE, "--zero", "'5'", "0-3"),
    cli_case("plan-zero-empty", plan("--zero", ""), USAGE, "--zero"),
    cli_case("plan-zero-text", plan("--zero", "0,x"), USAGE, "--zero", "'0,x'"),
    cli_case("plan-recompute-typo", plan("--recompute", "ful"), USAGE, "--recompute", "'ful'"),
    cli_case("plan-recompute-empty-item", plan("--recompute", "none,,full"), USAGE,
             "--recompute"),
    cli_case("plan-schedule-unknown", plan("--schedule", "pipedream"), USAGE, "--schedule",
             "pipedream", "zb_v"),
    cli_case("plan-precision-fp64", plan("--precision", "fp64"), USAGE, "--precision", "fp64"),
    cli_case("plan-optimizer-unknown", plan("--optimizer", "lion"), USAGE, "--optimizer", "lion"),
    cli_case("plan-json-missing-dir", plan("--json", "{d}/no/such/dir/plan.json"), USAGE,
             "--json", "does not exist"),
    cli_case("plan-json-is-a-dir", plan("--json", "{d}"), USAGE, "--json", "is a directory"),
    cli_case("plan-json-empty", plan("--json", ""), USAGE, "--json"),
    cli_case("plan-no-cluster", ["plan", TINY], USAGE, "--cluster"),
    cli_case("no-command", [], USAGE, "command"),
    cli_case("unknown-command", "train gpt2", USAGE, "train"),
    cli_case("estimate-json-missing-dir", estimate("--json", "{d}/nope/e.json"), USAGE, "--json"),
    cli_case("plan-json-nul-byte", plan("--json", "a\x00.json"), USAGE, "--json", "NUL"),
    cli_case("calibrate-out-nul-byte", ["calibrate", "--out", "p\x00.json"], USAGE, "--out",
             "NUL"),
    cli_case("cluster-path-nul-byte", ["cluster", "show", "c\x00.yaml"], ClusterError, "NUL"),
    cli_case("estimate-lora-rank-negative", estimate("--lora-rank", "-4"), USAGE, "--lora-rank"),
    cli_case("estimate-lora-rank-0", estimate("--lora-rank", "0"), USAGE, "--lora-rank"),
    cli_case("estimate-cp-0", estimate("--cp", "0"), USAGE, "--cp"),
    cli_case("estimate-lora-rank-full", estimate("--lora-rank", "100000"), AutoparError,
             "LoRA rank 100000", "--lora-rank"),
    cli_case("estimate-dtype-deprecated-fp64", estimate("--dtype", "fp64"), USAGE, "--dtype",
             "fp64"),
    cli_case("estimate-schedule-unknown", estimate("--schedule", "zero_bubble_h3"), USAGE,
             "--schedule", "zero_bubble_h3"),
    cli_case("calibrate-out-missing-dir", "calibrate --out {d}/nope/p.json", USAGE, "--out"),
    cli_case("calibrate-nproc-0", "calibrate --out {d}/p.json --nproc 0", USAGE, "--nproc"),
    cli_case("calibrate-threads-0", "calibrate --out {d}/p.json --threads 0", USAGE, "--threads"),
    cli_case("calibrate-device-tpu", "calibrate --out {d}/p.json --device tpu", USAGE,
             "--device", "tpu"),
    # --- estimate: configurations that make no sense -------------------------------------
    cli_case("estimate-tp-not-dividing-heads", estimate("--tp", "3", cluster="3xcpu"),
             AutoparError, "tp=3", "4 attention heads"),
    cli_case("estimate-tp-spanning-nodes", estimate("--tp", "16", cluster="2x8xA100-80GB"),
             AutoparError, "tp=16", "spans 2 nodes", "--tp"),
    cli_case("estimate-tp-not-dividing-node", estimate("--tp", "3"), AutoparError, "tp=3",
             "8 devices of a node"),
    cli_case("estimate-two-zero-stages", estimate("--zero", "0,3"), AutoparError, "--zero",
             "one configuration"),
    cli_case("estimate-two-recompute-modes", estimate("--recompute", "none,full"), AutoparError,
             "--recompute", "one configuration"),
    cli_case("estimate-virtual-without-interleaved", estimate("--virtual-stages", "2"),
             AutoparError, "--virtual-stages", "interleaved"),
    cli_case("estimate-zb-v-three-chunks", estimate("--schedule", "zb_v", "--virtual-stages", "3"),
             AutoparError, "zb_v", "--virtual-stages"),
    cli_case("estimate-degrees-exceed-devices", estimate("--dp", "3"), AutoparError,
             "tp x pp x dp x cp", "8"),
    cli_case("estimate-microbatch-not-dividing", estimate("--microbatch", "3", "--dp", "8"),
             AutoparError, "microbatch 3", "--microbatch"),
    cli_case("estimate-batch-not-splitting", estimate("--global-batch", "6", "--dp", "8"),
             AutoparError, "global batch 6", "dp=8"),
    cli_case("estimate-pp-more-than-layers", estimate("--pp", "4", "--dp", "2"), AutoparError,
             "2 layers", "4 stages"),
    cli_case("estimate-cp-chunks-not-dividing-the-sequence",
             estimate("--cp", "4", "--dp", "2", model=gpt(seq=12)), AutoparError,
             "--cp", "12 tokens", "2·cp = 8 zigzag chunks"),
    cli_case("plan-cp-chunks-not-dividing-the-sequence",
             plan("--cp", "2", "--cp-layout", "contiguous", model=gpt(seq=15)), AutoparError,
             "cp=2", "15 tokens", "cp = 2"),
    cli_case("estimate-ulysses-heads-not-divisible-by-cp",
             estimate("--cp", "8", "--dp", "1", "--cp-algorithm", "ulysses"), AutoparError,
             "--cp-algorithm", "ulysses needs the query heads", "divisible by cp=8"),
    cli_case("plan-cp-with-unrecognised-attention",
             plan("--cp", "2", "--no-fuse-attention", model="gpt2hf:layers=2,hidden=32,heads=4,"
                  "vocab=64,seq=16"), AutoparError, "cp=2", "attention"),
    # --- pins that rule every mesh out ----------------------------------------------------
    cli_case("plan-microbatches-not-dividing", plan("--microbatches", "3"), NoFeasiblePlanError,
             "microbatches=3", "does not divide", "sequences per data-parallel rank"),
    cli_case("plan-microbatch-not-dividing", plan("--microbatch", "3", "--dp", "2"),
             NoFeasiblePlanError, "microbatch=3", "4 sequences", "dp=2"),
    cli_case("plan-batch-not-splitting-over-dp", plan("--global-batch", "6", "--dp", "4",
                                                      cluster="4xcpu"),
             NoFeasiblePlanError, "global batch 6", "dp=4"),
    cli_case("plan-too-few-microbatches-for-pp", plan("--pp", "2", "--microbatches", "1"),
             NoFeasiblePlanError, "pp=2", "microbatches=1", "cannot fill"),
    cli_case("plan-interleaved-without-layers", plan("--pp", "2", "--schedule", "interleaved",
                                                     "--virtual-stages", "4"),
             NoFeasiblePlanError, "interleaved", "virtual_stages=4", "2 layers"),
    cli_case("plan-dp-not-matching-devices", plan("--dp", "3"), NoFeasiblePlanError, "dp=3",
             "2 devices"),
    cli_case("plan-tp-beyond-node", plan("--tp", "4"), NoFeasiblePlanError, "tp=4"),
    cli_case("plan-pp-beyond-layers", plan("--pp", "4", cluster="4xcpu"), NoFeasiblePlanError,
             "pp=4", "2 layers"),
    cli_case("emit-rank-negative", ["emit", TINY, "--cluster", "2xcpu", "--rank", "-1"],
             AutoparError, "rank -1", "--rank"),
    # --- model specs ----------------------------------------------------------------------
    cli_case("spec-layers-100000", plan(model=gpt(layers=100000)), ModelSpecError, "'layers'",
             "at most 512"),
    cli_case("spec-layers-10-to-30", plan(model=gpt(layers=10**30)), ModelSpecError, "'layers'",
             "at most"),
    cli_case("spec-hidden-10-to-30", ["inspect", gpt(hidden=10**30)], ModelSpecError,
             "'hidden'", "at most"),
    cli_case("spec-4000-digits", plan(model=gpt(vocab="9" * 4000)), ModelSpecError, "'vocab'",
             "4000 digits"),
    cli_case("spec-layers-negative", plan(model=gpt(layers=-2)), ModelSpecError, "'layers'"),
    cli_case("spec-layers-zero", plan(model=gpt(layers=0)), ModelSpecError, "'layers'",
             "positive"),
    cli_case("spec-layers-float", plan(model=gpt(layers=2.5)), ModelSpecError, "'layers'",
             "integer"),
    cli_case("spec-layers-exponent", plan(model=gpt(layers="2e1")), ModelSpecError, "'layers'"),
    cli_case("spec-layers-underscore", plan(model=gpt(layers="1_0")), ModelSpecError, "'layers'"),
    cli_case("spec-layers-arabic-digit", plan(model=gpt(layers="٣")), ModelSpecError, "'layers'"),
    cli_case("spec-duplicate-key", plan(model=gpt() + ",layers=3"), ModelSpecError, "'layers'",
             "twice"),
    cli_case("spec-unknown-key", plan(model=gpt() + ",colour=1"), ModelSpecError, "'colour'"),
    cli_case("spec-missing-equals", plan(model="gpt:layers,hidden=32"), ModelSpecError,
             "'layers'", "key=value"),
    cli_case("spec-empty-value", plan(model=gpt() + ",dropout="), ModelSpecError, "'dropout='"),
    cli_case("spec-missing-key", plan(model="gpt:layers=2,hidden=32"), ModelSpecError,
             "missing key 'heads'"),
    cli_case("spec-family-only", plan(model="gpt:"), ModelSpecError, "missing key 'layers'"),
    cli_case("spec-semicolons", plan(model="gpt:layers=2;hidden=32"), ModelSpecError,
             "'layers'", "'2;hidden=32'"),
    cli_case("spec-unknown-family", plan(model="gtp:layers=2"), ModelSpecError, "'gtp'",
             "did you mean"),
    cli_case("spec-empty-family", plan(model=":layers=2"), ModelSpecError, "family ''"),
    cli_case("model-empty", plan(model=""), ModelSpecError, "unknown model ''"),
    cli_case("model-blank", plan(model="   "), ModelSpecError, "unknown model"),
    cli_case("model-unicode", plan(model="ｇｐｔ２"), ModelSpecError, "ｇｐｔ２"),
    cli_case("model-near-miss", plan(model="llama3-7b"), ModelSpecError, "llama3-7b",
             "did you mean"),
    cli_case("spec-rope-nan", plan(model=f"{LLAMA},rope_theta=nan"), ModelSpecError,
             "'rope_theta'"),
    cli_case("spec-rope-inf", plan(model=f"{LLAMA},rope_theta=inf"), ModelSpecError,
             "'rope_theta'"),
    cli_case("spec-rope-overflow", plan(model=f"{LLAMA},rope_theta=1e999"), ModelSpecError,
             "'rope_theta'", "finite"),
    cli_case("spec-rope-negative", plan(model=f"{LLAMA},rope_theta=-5"), ModelSpecError,
             "'rope_theta'", "positive"),
    cli_case("spec-dropout-1.5", plan(model=gpt(dropout=1.5)), ModelSpecError, "'dropout'"),
    cli_case("spec-bias-true", plan(model=gpt(bias="true")), ModelSpecError, "'bias'", "0 or 1"),
    cli_case("spec-heads-not-dividing", plan(model=gpt(heads=5)), ModelSpecError, "hidden=32",
             "heads=5"),
    cli_case("spec-kv-heads-not-dividing", plan(model=f"{LLAMA},kv_heads=3"), ModelSpecError,
             "kv_heads=3"),
    cli_case("spec-top-k-above-experts", plan(model=f"{MIXTRAL},top_k=9"), ModelSpecError,
             "top_k=9"),
    cli_case("spec-experts-huge", plan(model=f"{MIXTRAL},experts=100000"), ModelSpecError,
             "'experts'", "at most"),
    cli_case("spec-batch-huge", plan(model=gpt(batch=10**9)), ModelSpecError, "'batch'"),
    cli_case("spec-seq-huge", plan(model=gpt(seq=4_000_000)), ModelSpecError, "'seq'"),
    cli_case("spec-tokens-huge", plan(model=gpt(seq=2**20, batch=2**20)), ModelSpecError,
             "tokens per step"),
    cli_case("flag-seq-huge", plan("--seq", str(10**30)), ModelSpecError, "seq", "limit"),
    cli_case("flag-global-batch-huge", plan("--global-batch", str(10**30)), ModelSpecError,
             "batch", "limit"),
    cli_case("flag-seq-beyond-positions", plan("--seq", "32"), ModelSpecError, "32",
             "16 learned positions"),
    # --- model files ------------------------------------------------------------------------
    cli_case("py-without-factory", plan(model="{d}/raises.py"), ModelSpecError, "raises.py",
             "names no factory"),
    cli_case("factory-file-missing", plan(model="{d}/nowhere.py:make"), ModelSpecError,
             "nowhere.py", "not found"),
    cli_case("factory-file-is-dir", plan(model="{d}/dir.py:make"), ModelSpecError, "dir.py",
             "directory"),
    cli_case("factory-not-python", plan(model="{d}/notes.txt:make"), ModelSpecError,
             "notes.txt", "not a Python file"),
    cli_case("factory-raises", plan(model="{d}/raises.py:make"), ModelSpecError,
             "raises.py:4", "RuntimeError", "boom"),
    cli_case("factory-needs-arguments", plan(model="{d}/needs_args.py:make"), ModelSpecError,
             "needs_args.py:1", "(width)", "defaults"),
    cli_case("factory-syntax-error", plan(model="{d}/syntax.py:make"), ModelSpecError,
             "syntax.py:1", "syntax error"),
    cli_case("factory-indentation-error", plan(model="{d}/indent.py:make"), ModelSpecError,
             "indent.py:2"),
    cli_case("factory-import-error", plan(model="{d}/imports.py:make"), ModelSpecError,
             "imports.py:1", "not_a_real_module_xyz"),
    cli_case("factory-calls-cuda", plan(model="{d}/cuda.py:make"), ModelSpecError, "cuda.py:4",
             "CUDA", ".cuda()"),
    cli_case("factory-file-exits", plan(model="{d}/exits.py:make"), ModelSpecError, "exits.py:2",
             "SystemExit"),
    cli_case("factory-meta-item", plan(model="{d}/item.py:make"), ModelSpecError, "item.py:4",
             "meta"),
    cli_case("factory-bare-module", plan(model="{d}/bare.py:make"), ModelSpecError,
             "returned only a module", "Net.forward(x)", "(model, example_args, example_kwargs)"),
    cli_case("factory-returns-int", plan(model="{d}/returns_int.py:make"), ModelSpecError,
             "returned int", "example_args"),
    cli_case("factory-returns-pair", plan(model="{d}/pair.py:make"), ModelSpecError,
             "tuple of 2", "example_kwargs"),
    cli_case("factory-inputs-without-tensors", plan(model="{d}/no_tensor.py:make"),
             ModelSpecError, "no tensor", "no_tensor.py"),
    cli_case("factory-unknown-function", plan(model="{d}/raises.py:build"), ModelSpecError,
             "no function 'build'", "make"),
    cli_case("factory-name-not-identifier", plan(model="{d}/raises.py:1make"), ModelSpecError,
             "'1make'"),
    cli_case("model-without-loss", plan(model="{d}/noloss.py:make"), TraceError,
             "no scalar loss", "float32 tensor (8, 4)"),
    cli_case("model-with-integer-output", plan(model="{d}/intloss.py:make"), TraceError,
             "no scalar loss", "int64 tensor ()"),
    # --- clusters -----------------------------------------------------------------------
    cli_case("cluster-empty-text", plan(cluster=""), ClusterError, "''", "shorthand"),
    cli_case("cluster-zero-nodes", "cluster show 0x8xH100-80GB", ClusterError, "count of 0"),
    cli_case("cluster-count-only", "cluster show 8x", ClusterError, "'8x'"),
    cli_case("cluster-three-counts", "cluster show 1x2x3xcpu", ClusterError, "'1x2x3xcpu'"),
    cli_case("cluster-20-digit-count", "cluster show 99999999999999999999xcpu", ClusterError,
             "more than 9 digits"),
    cli_case("cluster-too-many-devices", "cluster show 100000x1000xcpu", ClusterError,
             "100000000 devices", "limit"),
    cli_case("cluster-node-too-wide", "cluster show 4096xH100-80GB", ClusterError,
             "devices_per_node 4096"),
    cli_case("cluster-fullwidth-digit", "cluster show ８xcpu", ClusterError, "'８xcpu'"),
    cli_case("cluster-unicode-times", "cluster show 2×cpu", ClusterError, "'2×cpu'"),
    cli_case("cluster-unknown-preset", "cluster show 2xH1000", ClusterError, "'H1000'",
             "H100-80GB"),
    cluster_file("cluster-binary-file", "binary.yaml", "binary, not text"),
    cluster_file("cluster-pickle-file", "pickle.yaml", "binary"),
    cluster_file("cluster-pickle-extension", "model.pkl", "extension"),
    cluster_file("cluster-directory-yaml", "dir.yaml", "directory"),
    cli_case("cluster-directory", "cluster show {d}", ClusterError, "is a directory"),
    cluster_file("cluster-missing-file", "nope.yaml", "not found"),
    cluster_file("cluster-empty-file", "empty.yaml", "empty"),
    cluster_file("cluster-list", "list.yaml", "mapping", "list"),
    cluster_file("cluster-string", "string.yaml", "mapping", "str"),
    cluster_file("cluster-tabs", "tabs.yaml", "YAML", "line 2"),
    cluster_file("cluster-nodes-text", "nodes_text.yaml", "nodes", "'two'"),
    cluster_file("cluster-nodes-float", "nodes_float.yaml", "nodes", "1.5"),
    cluster_file("cluster-nodes-bool", "nodes_bool.yaml", "nodes", "True"),
    cluster_file("cluster-zero-devices", "zero_devices.yaml", "devices_per_node", "got 0"),
    cluster_file("cluster-negative-nodes", "negative_nodes.yaml", "nodes", "-4"),
    cluster_file("cluster-huge-nodes", "huge_nodes.yaml", "limit"),
    cluster_file("cluster-wide-node", "wide_node.yaml", "devices_per_node 100000"),
    cluster_file("cluster-duplicate-yaml-key", "duplicate.yaml", "'nodes'", "twice", "line 2"),
    cluster_file("cluster-duplicate-json-key", "duplicate.json", "'devices_per_node'", "twice"),
    cluster_file("cluster-broken-json", "broken.json", "not valid JSON", "line 1"),
    cluster_file("cluster-json-nan", "nan.json", "memory_gib", "nan"),
    cluster_file("cluster-deep-json", "deep.json", "nested too deeply"),
    cluster_file("cluster-deep-yaml", "deep.yaml", "nested too deeply"),
    cluster_file("cluster-negative-bandwidth", "negative_bandwidth.yaml",
                 "intra_node_link.bandwidth_gb_per_s", "-5"),
    cluster_file("cluster-negative-latency", "negative_latency.yaml",
                 "inter_node_link.latency_us", "-1"),
    cluster_file("cluster-unknown-backend", "unknown_backend.yaml", "'mpi'", "gloo"),
    cluster_file("cluster-typo-key", "typo_key.yaml", "'memroy_gib'", "memory_gib"),
    cluster_file("cluster-typo-preset", "typo_preset.yaml", "'H1000'"),
    cluster_file("cluster-no-device", "no_device.yaml", "missing device.name"),
    cluster_file("cluster-peak-fp64", "fp64.yaml", "'fp64'", "peak_tflops"),
    cluster_file("cluster-unsorted-curve", "unsorted_curve.yaml",
                 "matmul_efficiency_curve", "rise"),
    cluster_file("cluster-efficiency-above-1", "efficiency.yaml", "matmul_efficiency", "1.5"),
    cluster_file("cluster-yaml-exponent-as-text", "yaml_exponent.yaml",
                 "memory_bandwidth_gb_per_s", "1.0e+12"),
    cluster_file("cluster-memory-overflow", "huge_memory.yaml", "memory_gib", "too large"),
    cluster_file("cluster-memory-underflow", "tiny_memory.yaml", "memory_gib", "too small"),
    cluster_file("cluster-missing-profile", "missing_profile.yaml", "nope.json", "not found"),
    cluster_file("cluster-name-number", "name_number.yaml", "name", "5"),
    cli_case("plan-cluster-bad-before-trace", plan(cluster="{d}/binary.yaml",
                                                   model=gpt(layers=512)),
             ClusterError, "binary"),
    cli_case("estimate-cluster-directory", estimate(cluster="{d}"), ClusterError, "directory"),
]


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _hf_gpt2_with_cache(_: Path) -> object:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(2, 16, dtype=torch.long)
    return autopar.trace(model, {"input_ids": ids, "labels": ids.clone()})


def _cluster(**changes: object) -> Cluster:
    device = DeviceSpec("x", 2**30, {"fp32": 1e12}, 1e11, 0.5)
    link = LinkSpec(1e9, 1e-6)
    fields = dict(nodes=1, devices_per_node=2, device=device, intra_node=link, inter_node=link)
    return Cluster(**(fields | changes))


def _device(**changes: object) -> DeviceSpec:
    fields = dict(name="x", memory_bytes=2**30, peak_flops={"fp32": 1e12},
                  memory_bandwidth_bytes_per_s=1e11, matmul_efficiency=0.5)
    return DeviceSpec(**(fields | changes))


def _cpu(**device: object) -> dict:
    return {"nodes": 1, "devices_per_node": 2, "device": {"preset": "cpu", **device}}


API_CASES = [
    # --- autopar.plan / parallelize ------------------------------------------------------
    api_case("plan-unknown-keyword", lambda d: autopar.plan(tiny_gpt(), "2xcpu", (IDX, IDX),
                                                            fsdp=2),
             AutoparError, "'fsdp'", "autopar.plan", "virtual_stages"),
    api_case("parallelize-unknown-keyword", lambda d: autopar.parallelize(
        tiny_gpt(), "2xcpu", (IDX, IDX), fsdp=2), AutoparError, "'fsdp'",
        "autopar.parallelize", "precision"),
    api_case("plan-ep-without-experts", lambda d: autopar.plan(tiny_gpt(), "2xcpu", (IDX, IDX),
                                                               ep=2),
             AutoparError, "ep=2", "no experts"),
    api_case("plan-old-and-new-keyword", lambda d: autopar.plan(
        tiny_gpt(), "2xcpu", (IDX, IDX), virtual=2, virtual_stages=2), AutoparError, "virtual"),
    api_case("plan-model-is-text", lambda d: autopar.plan("gpt2", "2xcpu"), AutoparError,
             "nn.Module", "str"),
    api_case("plan-model-none", lambda d: autopar.plan(None, "2xcpu"), AutoparError, "NoneType"),
    api_case("plan-cluster-int", lambda d: autopar.plan(tiny_gpt(), 8, (IDX, IDX)), ClusterError,
             "int"),
    api_case("plan-cluster-none", lambda d: autopar.plan(tiny_gpt(), None, (IDX, IDX)),
             ClusterError, "NoneType"),
    api_case("plan-without-inputs", lambda d: autopar.plan(tiny_gpt(), "2xcpu"), TraceError,
             "do not match forward()", "'idx'"),
    api_case("plan-without-targets", lambda d: autopar.plan(tiny_gpt(), "2xcpu", (IDX,)),
             TraceError, "no scalar loss", "float32 tensor (8, 16, 64)", "None"),
    api_case("plan-returns-activations", lambda d: autopar.plan(_MLP(), "2xcpu",
                                                               torch.randn(8, 4)),
             TraceError, "no scalar loss", "(8, 4)"),
    api_case("plan-global-batch-huge", lambda d: autopar.plan(
        tiny_gpt(), "2xcpu", (IDX, IDX), global_batch=10**12), AutoparError, "global batch",
        "limit"),
    api_case("plan-time-limit-zero", lambda d: autopar.plan(tiny_gpt(), "2xcpu", (IDX, IDX),
                                                            time_limit_s=0),
             AutoparError, "time_limit_s"),
    api_case("plan-zero-stage-5", lambda d: autopar.plan(tiny_gpt(), "2xcpu", (IDX, IDX), zero=5),
             AutoparError, "zero", "5"),
    api_case("plan-schedule-keyword-unknown", lambda d: autopar.plan(
        tiny_gpt(), "2xcpu", (IDX, IDX), schedule="pipedream"), AutoparError, "'pipedream'"),
    # --- PlanOptions ------------------------------------------------------------------------
    api_case("options-time-limit-text", lambda d: PlanOptions(time_limit_s="20"), AutoparError,
             "time_limit_s", "'20'"),
    api_case("options-time-limit-nan", lambda d: PlanOptions(time_limit_s=float("nan")),
             AutoparError, "time_limit_s", "nan"),
    api_case("options-time-limit-inf", lambda d: PlanOptions(time_limit_s=float("inf")),
             AutoparError, "time_limit_s", "inf"),
    api_case("options-memory-fraction-text", lambda d: PlanOptions(memory_fraction="0.9"),
             AutoparError, "memory_fraction"),
    api_case("options-memory-fraction-above-1", lambda d: PlanOptions(memory_fraction=1.5),
             AutoparError, "memory_fraction", "1.5"),
    api_case("options-fuse-attention-text", lambda d: PlanOptions(fuse_attention="no"),
             AutoparError, "fuse_attention", "'no'"),
    api_case("options-tp-splits-batch-text", lambda d: PlanOptions(tp_splits_batch="no"),
             AutoparError, "tp_splits_batch"),
    api_case("options-tp-float", lambda d: PlanOptions(tp=2.0), AutoparError, "tp", "2.0"),
    api_case("options-tp-bool", lambda d: PlanOptions(tp=True), AutoparError, "tp", "True"),
    api_case("options-precision-upper-case", lambda d: PlanOptions(precision="FP32"),
             AutoparError, "precision", "'FP32'"),
    api_case("options-recompute-string", lambda d: PlanOptions(recompute="none"), AutoparError,
             "recompute"),
    api_case("options-zero-empty", lambda d: PlanOptions(zero=()), AutoparError, "zero", "()"),
    api_case("options-zero-text", lambda d: PlanOptions(zero="3"), AutoparError, "zero", "'3'"),
    api_case("options-optimizer-none", lambda d: PlanOptions(optimizer=None), AutoparError,
             "optimizer", "None"),
    api_case("options-schedule-number", lambda d: PlanOptions(schedule=3), AutoparError,
             "schedule", "3"),
    api_case("options-virtual-with-1f1b", lambda d: PlanOptions(virtual_stages=2,
                                                                schedule="1f1b"),
             AutoparError, "virtual_stages=2", "interleaved"),
    api_case("options-microbatch-and-count", lambda d: PlanOptions(microbatch=2, microbatches=2),
             AutoparError, "microbatch", "microbatches"),
    api_case("knobs-schedule-unknown", lambda d: schedule_name("1f2b"), AutoparError, "'1f2b'",
             "gpipe"),
    # --- estimate's PinnedConfig ----------------------------------------------------------
    api_case("pinned-tp-0", lambda d: PinnedConfig(tp=0), AutoparError, "tp", "0"),
    api_case("pinned-tp-bool", lambda d: PinnedConfig(tp=True), AutoparError, "tp", "True"),
    api_case("pinned-sp-text", lambda d: PinnedConfig(sp="yes"), AutoparError, "sp", "'yes'"),
    api_case("pinned-precision-fp64", lambda d: PinnedConfig(precision="fp64"), AutoparError,
             "precision", "'fp64'"),
    api_case("pinned-optimizer-lion", lambda d: PinnedConfig(optimizer="lion"), AutoparError,
             "optimizer", "'lion'"),
    api_case("pinned-global-batch-negative", lambda d: PinnedConfig(global_batch=-1),
             AutoparError, "global_batch", "-1"),
    api_case("pinned-global-batch-float", lambda d: PinnedConfig(global_batch=1.5), AutoparError,
             "global_batch", "1.5"),
    api_case("pinned-zero-bool", lambda d: PinnedConfig(zero=True), AutoparError, "ZeRO",
             "True"),
    api_case("pinned-fuse-attention-none", lambda d: PinnedConfig(fuse_attention=None),
             AutoparError, "fuse_attention"),
    api_case("pinned-layout-unknown", lambda d: PinnedConfig(layout="deepspeed"), AutoparError,
             "layout", "'deepspeed'"),
    api_case("pinned-recompute-unknown", lambda d: PinnedConfig(recompute="some"), AutoparError,
             "recompute", "'some'"),
    # --- trace and input specs --------------------------------------------------------------
    api_case("trace-model-is-text", lambda d: autopar.trace("gpt2", (IDX,)), TraceError,
             "nn.Module", "str"),
    api_case("trace-inputs-text", lambda d: autopar.trace(tiny_gpt(), "not a tensor"),
             TraceError, "str", "(args, kwargs)"),
    api_case("trace-too-many-inputs", lambda d: autopar.trace(tiny_gpt(), (IDX, IDX, IDX)),
             TraceError, "do not match forward()", "too many"),
    api_case("trace-unknown-keyword-input", lambda d: autopar.trace(tiny_gpt(), {"foo": IDX}),
             TraceError, "do not match forward()", "'idx'"),
    api_case("trace-float-token-ids", lambda d: autopar.trace(tiny_gpt(), (IDX.float(),)),
             TraceError, "Long", "float32"),
    api_case("trace-sequence-too-long", lambda d: autopar.trace(
        tiny_gpt(), (torch.zeros(2, 32, dtype=torch.long),)), TraceError, "block_size 16"),
    api_case("trace-hf-use-cache", _hf_gpt2_with_cache, TraceError, "use_cache=True",
             "use_cache=False"),
    api_case("tensorspec-negative-dim", lambda d: TensorSpec((4, -1)), TraceError, "(4, -1)"),
    api_case("tensorspec-bool-dim", lambda d: TensorSpec((True, 2)), TraceError, "(True, 2)"),
    api_case("tensorspec-int-shape", lambda d: TensorSpec(4), TraceError, "shape", "4"),
    api_case("tensorspec-text-shape", lambda d: TensorSpec("ab"), TraceError, "'ab'"),
    api_case("tensorspec-float-dim", lambda d: TensorSpec((4.0, 16)), TraceError, "(4.0, 16)"),
    api_case("tensorspec-huge", lambda d: TensorSpec((2**40, 2**40)), TraceError, "elements"),
    api_case("tensorspec-dtype-list", lambda d: TensorSpec((4,), []), TraceError, "dtype", "[]"),
    api_case("tensorspec-dtype-unknown", lambda d: TensorSpec((4,), "int13"), TraceError,
             "'int13'", "int64"),
    # --- resolve_model and ModelSpec ------------------------------------------------------
    api_case("resolve-none", lambda d: resolve_model(None), ModelSpecError, "NoneType"),
    api_case("resolve-int", lambda d: resolve_model(5), ModelSpecError, "int"),
    api_case("resolve-bytes", lambda d: resolve_model(b"gpt2"), ModelSpecError, "bytes"),
    api_case("example-inputs-batch-0", lambda d: resolve_model(TINY).example_inputs(0, 8),
             ModelSpecError, "batch", "0"),
    api_case("example-inputs-batch-bool", lambda d: resolve_model(TINY).example_inputs(True, 8),
             ModelSpecError, "batch", "True"),
    api_case("example-inputs-seq-huge", lambda d: resolve_model(LLAMA).example_inputs(8, 2**30),
             ModelSpecError, "seq", "limit"),
    api_case("gpt-config-layers-0", lambda d: GPTConfig(block_size=8, vocab_size=8, n_layer=0,
                                                        n_head=2, n_embd=8),
             ModelSpecError, "n_layer"),
    api_case("gpt-config-attention-flash", lambda d: GPTConfig(
        block_size=8, vocab_size=8, n_layer=1, n_head=2, n_embd=8, attention="flash"),
        ModelSpecError, "attention", "'flash'"),
    # --- load_cluster and the cluster types -------------------------------------------------
    api_case("cluster-list-value", lambda d: autopar.load_cluster([1, 2]), ClusterError, "list"),
    api_case("cluster-bytes-value", lambda d: autopar.load_cluster(b"8xcpu"), ClusterError,
             "bytes"),
    api_case("cluster-path-to-dir", lambda d: autopar.load_cluster(d), ClusterError,
             "extension"),
    api_case("cluster-dict-nodes-text", lambda d: autopar.load_cluster(
        {"nodes": "2", "devices_per_node": 8, "device": "cpu"}), ClusterError, "nodes", "'2'"),
    api_case("cluster-dict-int-key", lambda d: autopar.load_cluster({1: 2}), ClusterError,
             "unknown key '1'"),
    api_case("cluster-dict-device-list", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": ["cpu"]}), ClusterError, "device",
        "mapping"),
    api_case("cluster-dict-preset-int", lambda d: autopar.load_cluster(_cpu(preset=5)),
             ClusterError, "preset", "5"),
    api_case("cluster-dict-peak-list", lambda d: autopar.load_cluster(_cpu(peak_tflops=[1])),
             ClusterError, "peak_tflops", "mapping"),
    api_case("cluster-dict-curve-triples", lambda d: autopar.load_cluster(
        _cpu(matmul_efficiency_curve=[[1, 0.5, 3]])), ClusterError, "matmul_efficiency_curve[0]"),
    api_case("cluster-dict-curve-set", lambda d: autopar.load_cluster(
        _cpu(matmul_efficiency_curve={1, 2})), ClusterError, "matmul_efficiency_curve"),
    api_case("cluster-dict-memory-inf", lambda d: autopar.load_cluster(
        _cpu(memory_gib=float("inf"))), ClusterError, "memory_gib", "inf"),
    api_case("cluster-dict-backend-list", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": "cpu", "backend": ["gloo"]}), ClusterError,
        "backend"),
    api_case("cluster-dict-sources-number", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": "cpu", "sources": {"nodes": 3}}),
        ClusterError, "sources.nodes"),
    api_case("cluster-dict-profile-nul-byte", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": "p\x00.json"}),
        ClusterError, "profile", "NUL"),
    api_case("cluster-dict-profile-dir", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": str(d)}), ClusterError,
        "profile", "directory"),
    api_case("cluster-dict-profile-binary", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": str(d / "binary.yaml")}),
        ClusterError, "profile", "binary"),
    api_case("cluster-dict-profile-number", lambda d: autopar.load_cluster(
        {"nodes": 1, "devices_per_node": 2, "device": "cpu", "profile": 7}), ClusterError,
        "profile", "7"),
    api_case("cluster-type-zero-nodes", lambda d: _cluster(nodes=0), ClusterError,
             "Cluster.nodes"),
    api_case("cluster-type-huge", lambda d: _cluster(nodes=2**30), ClusterError, "limit"),
    api_case("cluster-type-device-dict", lambda d: _cluster(device={"name": "x"}), ClusterError,
             "Cluster.device"),
    api_case("cluster-type-backend", lambda d: _cluster(backend="mpi"), ClusterError, "'mpi'"),
    api_case("device-type-no-peaks", lambda d: _device(peak_flops={}), ClusterError,
             "peak_flops"),
    api_case("device-type-negative-memory", lambda d: _device(memory_bytes=-1), ClusterError,
             "memory_bytes"),
    api_case("link-type-negative-bandwidth", lambda d: LinkSpec(-1.0, 0.0), ClusterError,
             "bandwidth_bytes_per_s"),
    api_case("device-unsupported-dtype", lambda d: autopar.load_cluster("V100-32GB").device.peak(
        "bf16"), ClusterError, "V100-32GB", "bf16"),
]

CASES = CLI_CASES + API_CASES


def test_the_table_is_large_and_distinct() -> None:
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names), "case names repeat"
    inputs = [repr(c.run) for c in CLI_CASES]
    assert len(set(inputs)) == len(inputs), "command lines repeat"
    assert len(CASES) >= 120


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bad inputs")
    for name, content in FILES.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return folder


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [c for c in CASES if c.on_cli], ids=lambda c: c.name)
def test_bad_input_on_the_command_line(case: Bad, files: Path,
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [arg.replace("{d}", str(files)) for arg in case.run]
    if case.error is USAGE:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err, err
    else:
        raised: list[AutoparError] = []
        run = cli._run

        def recording(args: object) -> int:
            try:
                return run(args)
            except AutoparError as e:
                raised.append(e)
                raise

        monkeypatch.setattr(cli, "_run", recording)
        err = run_cli(argv, capsys)
        assert len(raised) == 1 and isinstance(raised[0], case.error), raised
        assert_well_formed(raised[0])
    for word in case.words:
        assert word.replace("{d}", str(files)) in err, (word, err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [c for c in CASES if not c.on_cli], ids=lambda c: c.name)
def test_bad_input_through_the_api(case: Bad, files: Path) -> None:
    with pytest.raises(case.error) as info:
        case.run(files)
    assert_well_formed(info.value)
    for word in case.words:
        assert word in str(info.value), (word, str(info.value))
