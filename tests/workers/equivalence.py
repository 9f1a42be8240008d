"""Train models single-device and under autopar; compare every loss and every gradient.

Run by the equivalence tests under torchrun, one launch for many cases (each a JSON object of
``build`` and ``autopar.parallelize`` arguments)::

    torchrun --nproc-per-node 2 tests/workers/equivalence.py \
        --case '{"model": "gpt", "dp": 2}' --case '{"model": "llama", "pp": 2, "microbatches": 4}'

Each rank writes ``rank<r>.json`` (a list: one record per case) into ``$AUTOPAR_TEST_OUT``.
The comparison (and why the trajectory uses SGD) is in ``grad_check.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_edits  # noqa: E402
from grad_check import compare, train_parallel, train_reference  # noqa: E402
from reuse import Traces, shared_model  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.teardown import leave
from tests.strict_warnings import raise_on_autopar_deprecations  # noqa: E402

raise_on_autopar_deprecations()  # autopar uses current torch APIs only
STEPS = int(os.environ.get("AUTOPAR_TEST_STEPS", 3))
MODEL_KEYS = ("model", "layers", "tied", "cluster", "rtol", "optimizer", "count_in_code", "edit",
              "scramble", "forward", "clip")


def build(name: str, layers: int = 2, tied: bool | None = None):
    """A tiny model and one global batch ``(args, kwargs)``. ``<model>+lora`` adapts its
    attention's query and value projections with LoRA (rank 4), every other weight frozen;
    ``<model>+qlora`` also stores those frozen weights in 4-bit NF4."""
    if "+" in name:
        from autopar.models.lora import LoraConfig, apply_lora

        base, _, adapter = name.partition("+")
        model, batch = build(base, layers, tied)
        targets = ("q_proj", "v_proj") if base == "llama" else ("c_attn", "c_fc")
        torch.manual_seed(3)
        apply_lora(model, LoraConfig(rank=4, alpha=8, targets=targets,
                                     quantize="nf4" if adapter == "qlora" else None))
        return model, batch
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
    if name in ("gpt", "gptmath"):  # gptmath: explicit softmax attention (selective recompute)
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=layers, n_head=4, n_embd=32,
                              attention="math" if name == "gptmath" else "sdpa",
                              tie_weights=True if tied is None else tied))
        return model, ((idx, tgt), {})
    if name == "gptwide":  # weights large beside the activations: their copies show
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=layers, n_head=8,
                              n_embd=512, tie_weights=False))
        g = torch.Generator().manual_seed(1)
        idx, tgt = (torch.randint(0, 96, (8, 32), generator=g) for _ in range(2))
        return model, ((idx, tgt), {})
    if name == "llama":
        from autopar.models.hf import build_llama

        model = build_llama(layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=96,
                            seq=16, tie_word_embeddings=bool(tied))
        return model, ((), {"input_ids": idx, "labels": idx.clone(), "use_cache": False})
    if name == "mixtral":  # HF Mixtral: sorted tokens, grouped matmuls, SwiGLU experts
        from autopar.models.hf import build_mixtral

        model = build_mixtral(layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=96,
                              seq=16, experts=4, top_k=2)
        return model, ((), {"input_ids": idx, "labels": idx.clone(), "use_cache": False})
    if name.startswith("zoo:"):  # a tiny Hugging Face model of tests/hf_zoo.py
        from tests.hf_zoo import build as build_zoo

        return build_zoo(name.removeprefix("zoo:"))
    if name.startswith("hand:"):  # a model as users write them, tests/hand_models.py
        from tests.hand_models import MODELS

        return MODELS[name.removeprefix("hand:")]()
    if name.startswith("moe-"):  # moe-loop, moe-dense, moe-sorted: routing styles
        from autopar.models.moe import MoEConfig, MoEGPT

        # "-zloss": the router z-loss only (a mean over tokens: exact over microbatches,
        # where the balancing loss's product of batch means is not); "-bias": DeepSeek-V3's
        # auxiliary-loss-free balancing, a routing bias nudged by each step's expert load
        routing, _, variant = name.removeprefix("moe-").partition("-")
        model = MoEGPT(MoEConfig(block_size=16, vocab_size=96, n_layer=layers, n_head=4,
                                 n_embd=32, experts=4, top_k=2, expert_ffn=32,
                                 routing=routing, aux_loss_coef=0.0 if variant else 1.0,
                                 z_loss_coef=1e-3,
                                 bias_update_rate=0.05 if variant == "bias" else 0.0))
        return model, ((idx, tgt), {})
    if name == "batchnorm":  # batch statistics in training mode
        model = torch.nn.Sequential(torch.nn.Embedding(96, 32), torch.nn.Flatten(),
                                    torch.nn.Linear(16 * 32, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.Linear(32, 96))
        return _Classifier(model), ((idx, tgt[:, 0]), {})
    raise SystemExit(f"unknown model {name}")


class _Classifier(torch.nn.Module):
    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.body = body

    def forward(self, idx, label):
        return torch.nn.functional.cross_entropy(self.body(idx), label)


def cluster_for(path: str | None, world: int):
    """``<world>xcpu``, or a cluster file resized to the launched world."""
    if not path:
        return f"{world}xcpu"
    import yaml

    cluster = yaml.safe_load(Path(path).read_text())
    cluster.update(nodes=1, devices_per_node=world)
    return cluster


def run_case(case: dict) -> dict:
    key = (case["model"], case.get("layers", 2), case.get("tied"))
    with shared_model(key, lambda: build(*key)) as (model, (a, k)):
        return _run_case(case, model, a, k)


def _run_case(case: dict, model, a: tuple, k: dict) -> dict:
    optimizer = case.get("optimizer", "sgd")
    clip, ref_norms, norms = case.get("clip"), [], []  # gradients clipped to this norm
    reference, ref_losses, ref_grads = train_reference(model, a, k, STEPS, optimizer=optimizer,
                                                       clip=clip, norms=ref_norms)
    options = {key: v for key, v in case.items() if key not in MODEL_KEYS}
    if "zero" in options and isinstance(options["zero"], list):
        options["zero"] = tuple(options["zero"])
    if "recompute" in options:
        options["recompute"] = tuple(options["recompute"].split(","))
    elif "plan" not in options:  # a plan fixes recomputation itself
        options["recompute"] = ("none",)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cluster = cluster_for(case.get("cluster"), world)
    edited: list[str] = []
    if "scramble" in case:  # the plan the solver makes under scrambled costs (plan_edits.py)
        with plan_edits.scrambled_costs(case["scramble"]):
            options = {"plan": autopar.plan(autopar.trace(model, (a, k)), cluster, **options)}
    if "edit" in case:  # a hand edit of the solver's plan (plan_edits.py)
        gm = autopar.trace(model, (a, k))
        plan, edited = getattr(plan_edits, case["edit"])(autopar.plan(gm, cluster, **options), gm)
        options = {"plan": plan}
    pm = autopar.parallelize(model, cluster, (a, k), **options)
    la, lk = pm.shard_batch(*a, **k)
    losses, grads = train_parallel(pm, la, lk, STEPS, optimizer, clip=clip, norms=norms)
    result = compare(pm, reference, losses, ref_losses, grads, ref_grads,
                     rtol=case.get("rtol", 1e-5))
    for step, (mine, theirs) in enumerate(zip(norms, ref_norms)):  # the norm it clipped by
        if abs(mine - theirs) > case.get("rtol", 1e-5) * abs(theirs):
            result.problems.append(f"step {step + 1}: gradient norm {mine} != {theirs}")
        if mine <= clip:  # the case clips: a norm under max_norm would test nothing
            result.problems.append(f"step {step + 1}: norm {mine} <= clip {clip}")
    if case.get("forward"):  # a forward call still hands back whole outputs (logits),
        # which train_step leaves local (comm_ops.outputs_unused)
        with torch.no_grad():
            mine, ref = _logits(pm(*la, **lk)), _logits(reference(*la, **lk))
        err = (mine - ref).abs().max().item() if mine.shape == ref.shape else None
        if err is None or err > 1e-4:
            result.problems.append(f"forward logits {tuple(mine.shape)} vs {tuple(ref.shape)}: "
                                   f"max error {err}")
    digest = hashlib.sha256()  # the exact bits of every gradient of every step
    for step in grads:
        for name in sorted(step):
            if step[name] is not None:
                digest.update(step[name].detach().contiguous().numpy().tobytes())
    plan = pm.plan
    return {"case": case, "rank": dist.get_rank() if dist.is_initialized() else 0,
            "mesh": plan.mesh, "zero": plan.training["zero"],
            "offload": plan.training.get("offload", "none"),
            "dp_replicate": plan.training.get("dp_replicate", 1),
            "microbatches": plan.batch["microbatches"], "recompute": plan.training["recompute"],
            "recompute_layers": plan.training.get("recompute_layers"),
            "checkpointed": pm.code.count("checkpointed("), "layer_span": _layer_span(pm),
            "code_counts": {w: pm.code.count(w) for w in case.get("count_in_code", [])},
            "schedule": plan.pipeline.get("schedule"),
            "virtual_stages": plan.pipeline.get("virtual_stages"),
            "edited": edited, "losses": losses, "reference": ref_losses,
            "grad_digest": digest.hexdigest(),
            "sharded": sorted(f for f, ax in plan.params.items() if ax.get("tp", "R") != "R"),
            # parameters the optimizer steps as shards (FSDP2: ZeRO-1, 2 and 3)
            "dp_sharded": sum(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
                              for p in pm.parameters()),
            # 2 under HSDP: FSDP2's (replicate, shard) mesh
            "dp_mesh_dims": max((p.device_mesh.ndim for p in pm.parameters()
                                 if isinstance(p, DTensor)), default=0),
            **result.to_dict()}


def _logits(outputs) -> torch.Tensor:
    """The logits of a model's outputs (``.logits``, or the first non-scalar tensor)."""
    logits = getattr(outputs, "logits", None)
    if logits is None:
        logits = next(t for t in outputs if isinstance(t, torch.Tensor) and t.ndim > 0)
    return logits


def _layer_span(pm) -> list[int]:
    """The first and last layer this rank's program runs (all of them without pipelines)."""
    plan = pm.plan
    if plan.mesh.get("pp", 1) == 1:
        return [0, len(plan.training.get("recompute_layers") or [0]) - 1]
    mine = [c["layers"] for c in plan.pipeline["chunks"]
            if c["rank"] == pm.mesh_context.coords["pp"]]
    return [min(a for a, _ in mine), max(b for _, b in mine)]


def serve_cases(run_case) -> NoReturn:
    """Run each ``--case`` (a JSON object) with ``run_case`` on this rank, write the records
    to ``$AUTOPAR_TEST_OUT/rank{r}.json`` (also when a case raises), print them; leave
    (:func:`autopar.runtime.teardown.leave`) with status 0 when every case is ok. Shared by the workers that check training case by case."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", required=True, help="JSON object")
    cases = [json.loads(c) for c in ap.parse_args().case]
    records = []
    for case in cases:
        try:
            records.append(run_case(case))
        except Exception as e:  # noqa: BLE001 - recorded, then the launch fails
            records.append({"case": case, "ok": False, "error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            rank = dist.get_rank() if dist.is_initialized() else 0
            out_dir = os.environ.get("AUTOPAR_TEST_OUT")
            if out_dir:
                Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    print(json.dumps(records), flush=True)
    leave(0 if all(r["ok"] for r in records) else 1)


if __name__ == "__main__":
    Traces()  # every case of the launch shares each model's trace
    serve_cases(run_case)
