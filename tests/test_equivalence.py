"""Training under autopar equals single-device training (fp32, rtol 1e-5, every loss and every
gradient on every rank at every step), with plans from the solver: dp, tp, dp x tp, ZeRO 1-3,
recomputation, and pipelines composed with tp and dp, on the nanoGPT-style GPT and HF Llama.

Cases with the same number of processes share one torchrun launch (tests/workers/
equivalence.py), and its models and traces. Tensor parallelism is exercised on a cluster with fast links
(tests/clusters/), where the solver shards every matmul; on the default CPU preset it would
rightly keep such tiny models replicated. Pipeline schedules have their own matrix
(test_pipeline_equivalence.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import FAST, run_cases

pytest.importorskip("transformers")

LAUNCHES = {
    "2ranks": (2, [
        {"model": "gpt", "dp": 2},
        {"model": "llama", "dp": 2},
        {"model": "gpt", "tp": 2, "cluster": FAST},
        # and its forward call returns whole logits, which train_step does not gather
        {"model": "llama", "tp": 2, "cluster": FAST, "forward": True,
         "count_in_code": ["redistribute_output"]},
        # ZeRO-3 (FSDP2 per outlined layer) and gradient accumulation over microbatches.
        {"model": "gpt", "dp": 2, "zero": 3, "microbatch": 1},
        # ZeRO-1 and 2 (FSDP2, weights kept whole through the step), under AdamW: its state
        # is what they shard. Stage 1 accumulates whole gradients over the microbatches.
        {"model": "gpt", "dp": 2, "zero": 1, "optimizer": "adamw"},
        {"model": "llama", "dp": 2, "zero": 1, "microbatch": 1, "optimizer": "adamw"},
        {"model": "llama", "dp": 2, "zero": 2, "microbatch": 1, "optimizer": "adamw"},
        # LoRA (q/v projections, rank 4; every other weight frozen: no gradient reduced, no
        # optimizer state) and QLoRA (the frozen weights in NF4: the same quantized model on
        # one device, rtol 1e-4)
        {"model": "llama+lora", "dp": 2, "optimizer": "adamw"},
        {"model": "llama+lora", "tp": 2, "cluster": FAST, "optimizer": "adamw"},
        {"model": "llama+qlora", "dp": 2, "optimizer": "adamw", "rtol": 1e-4},
        # CPU offload (FSDP2's CPUOffloadPolicy: ZeRO-3's shards and the optimizer step on
        # the host; on a CPU machine the host is the device, but the offloading path runs)
        {"model": "llama", "dp": 2, "zero": 3, "offload": "optimizer+params",
         "optimizer": "adamw"},
        # Selective recomputation (attention scores only, on explicit attention).
        {"model": "gptmath", "tp": 2, "recompute": "selective", "cluster": FAST},
        # torchtitan's per-op policy under FSDP2, as its Llama 3 8B runs.
        {"model": "llama", "dp": 2, "zero": 3, "recompute": "op"},
        # compiled layers (torch.compile per outlined layer) under FSDP2's hooks, and in
        # pipeline stages
        {"model": "gpt", "dp": 2, "zero": 3, "compile": True},
        {"model": "llama", "pp": 2, "microbatches": 2, "compile": True},
        # Recomputation per layer: some layers full, some per-op, some none; and a pipeline
        # whose first stage recomputes and whose second does not.
        {"model": "gpt", "layers": 4, "dp": 2, "zero": 3,
         "recompute_layers": ["full", "none", "op", "none"]},
        {"model": "llama", "layers": 4, "pp": 2, "microbatches": 2,
         "recompute_layers": ["full", "full", "none", "none"]},
        # Context parallelism: each sequence split over 2 ranks (zigzag chunks unless said),
        # keys and values all-gathered; GPT (learned positions) and HF Llama (rotary, GQA, the
        # mask it computes, labels shifted with an ignored last token).
        *[{"model": m, "cp": 2, "cp_algorithm": a} for m in ("gpt", "llama")
          for a in ("all_gather", "ring", "ulysses")],
        {"model": "llama", "cp": 2, "microbatches": 2},
        {"model": "gpt", "cp": 2, "cp_layout": "contiguous"},
    ]),
    "4ranks": (4, [
        {"model": "gpt", "dp": 2, "tp": 2, "cluster": FAST},
        {"model": "llama", "dp": 2, "tp": 2, "cluster": FAST},
        {"model": "llama", "dp": 2, "tp": 2, "zero": 3, "cluster": FAST},
        # Full recomputation: checkpointed layers, with sequence parallelism's re-gathered
        # shards.
        {"model": "gpt", "dp": 2, "tp": 2, "recompute": "full", "cluster": FAST},
        # Pipelines composed with tensor and data parallelism.
        *[{"model": m, "pp": 2, "tp": 2, "microbatches": 4, "cluster": FAST}
          for m in ("gpt", "llama")],
        *[{"model": m, "pp": 2, "dp": 2, "microbatches": 2} for m in ("gpt", "llama")],
        {"model": "llama", "pp": 2, "dp": 2, "zero": 2, "microbatches": 2, "optimizer": "adamw"},
        # HSDP 2 x 2: ZeRO shards within 2 ranks, the 2 groups replicate (FSDP2, 2-D mesh)
        {"model": "gpt", "dp": 4, "zero": 3, "dp_replicate": 2, "optimizer": "adamw"},
        {"model": "llama", "dp": 4, "zero": 2, "dp_replicate": 2, "optimizer": "adamw"},
        # context parallelism composed with dp, tp, ZeRO-3, pipelines and HSDP
        {"model": "llama", "cp": 2, "dp": 2},
        *[{"model": m, "cp": 2, "tp": 2, "cluster": FAST} for m in ("gpt", "llama")],
        # The rotary tables (whole over cp, sliced to each rank's tokens) split on tp along
        # the sequence too: the slice over cp must undo the tp split first (a layout the
        # solver picks on some of its ties; plan_edits.py)
        {"model": "llama", "cp": 2, "tp": 2, "cluster": FAST, "edit": "nest_cp_tp"},
        *[{"model": m, "cp": 2, "dp": 2, "zero": 3} for m in ("gpt", "llama")],
        *[{"model": m, "cp": 2, "pp": 2, "microbatches": 2} for m in ("gpt", "llama")],
        # HSDP with cp: ZeRO-3 shards over the 2 cp ranks of each dp group, the 2 groups
        # replicate, all-reducing their shards at the last of 2 microbatches only
        {"model": "llama", "dp": 2, "cp": 2, "zero": 3, "dp_replicate": 2, "microbatches": 2,
         "optimizer": "adamw"},
    ]),
}


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_matches_single_device(launch: str, tmp_path: Path) -> None:
    nproc, cases = LAUNCHES[launch]
    results = run_cases(nproc, tmp_path, cases)
    for rank in results:
        for case, r in zip(cases, rank):
            assert r["ok"], r
            if "edit" in case:  # the edit found something to edit
                assert r["edited"], r
            if case.get("forward"):  # logits split on tp, made whole for a forward call only
                assert r["code_counts"]["redistribute_output"] > 0, r
            mesh = r["mesh"]
            for axis in ("dp", "tp", "pp", "cp"):
                if axis in case:
                    assert mesh.get(axis, 1) == case[axis], (case, mesh)
            if "tp" in case:
                # The solver really sharded weights (not a replicated "tp=2" in name only).
                assert r["sharded"], ("expected tensor-parallel weights", case)
            if "offload" in case:
                assert r["offload"] == case["offload"], r
            assert r["dp_replicate"] == case.get("dp_replicate", 1), r
            if "dp_replicate" in case:  # FSDP2 on (replicate, shard): each state sharded
                assert r["dp_mesh_dims"] == 2 and r["dp_sharded"] > 0, r
            if "zero" in case:
                assert r["zero"] == case["zero"]
                # ZeRO 1-3: the optimizer steps shards of the weights, so its state is sharded
                assert (r["dp_sharded"] > 0) == (case["zero"] > 0), r
            if "microbatch" in case:
                assert r["microbatches"] == 4 // case.get("dp", 1) // case["microbatch"]
            if "microbatches" in case:
                assert r["microbatches"] == case["microbatches"]
            if "recompute" in case:
                assert r["recompute"] == case["recompute"]
            if "recompute_layers" in case:
                assert r["recompute"] == "mixed"
                assert r["recompute_layers"] == case["recompute_layers"]
                # every layer a mode other than none recomputes is checkpointed in this
                # rank's program, and no other (a pipeline rank prints its own stage)
                mine = case["recompute_layers"][r["layer_span"][0]:r["layer_span"][1] + 1]
                assert r["checkpointed"] == sum(m != "none" for m in mine), r
