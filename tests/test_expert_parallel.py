"""Expert parallelism: experts spread over ``ep`` data-parallel ranks, tokens dispatched to
them and combined back by all-to-all, training equal to one device.

The planner offers ``ep`` where the model's experts are grouped matmuls over stacked
weights (autopar.analysis.expert_sites); ``passes/expert_parallel`` keeps each rank's block of experts and
moves the rows; the runtime sums expert gradients over the ranks holding the same block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopar
from autopar.analysis.expert_sites import expert_regions
from autopar.core.errors import AutoparError, ModelSpecError
from autopar.core.plan import Plan
from autopar.models.moe import MoEConfig, MoEGPT
from tests.distributed import FAST, run_cases

IDX = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))


def _moe(routing: str = "sorted", experts: int = 4) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                            experts=experts, top_k=2, expert_ffn=32, routing=routing))


def test_regions_are_the_grouped_matmuls_of_each_layer() -> None:
    regions = expert_regions(autopar.trace(_moe(), (IDX, IDX)))
    assert [r.experts for r in regions] == [4, 4]
    assert [r.weight_fqns for r in regions] == [("h.0.moe.experts.w_in", "h.0.moe.experts.w_out"),
                                                ("h.1.moe.experts.w_in", "h.1.moe.experts.w_out")]
    for r in regions:  # the gelu between the two matmuls runs on the experts' rows
        assert any(n.target is torch.ops.aten.gelu.default for n in r.members)


def test_hf_mixtral_regions_read_through_transposed_weights() -> None:
    pytest.importorskip("transformers")
    from autopar.models.hf import build_mixtral

    model = build_mixtral(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=96, seq=16,
                          experts=4, top_k=2)
    gm = autopar.trace(model, ((), {"input_ids": IDX, "labels": IDX, "use_cache": False}))
    regions = expert_regions(gm)
    assert [r.weight_fqns[0] for r in regions] == [
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj"]


def test_pinned_ep_is_in_the_plan() -> None:
    plan = autopar.plan(_moe(), "2xcpu", (IDX, IDX), dp=2, ep=2)
    assert plan.mesh == {"dp": 2, "ep": 2, "tp": 1} and plan.world_size == 2
    assert plan.params["h.0.moe.experts.w_in"]["ep"] == "S(0)"
    assert "ep" not in plan.params["h.0.attn.c_attn.weight"]
    assert Plan.from_json(plan.to_json()) == plan


def test_expert_parallelism_is_labelled_beyond_validated_ground() -> None:
    """No measured run prices ep's all-to-alls: a plan with ep says so (scheme ``ep``,
    extrapolated) beside its validated data parallelism, and carries the handicap."""
    plan = autopar.plan(_moe(), "2xcpu", (IDX, IDX), dp=2, ep=2)
    labels = {g["scheme"]: g for g in plan.predicted["ground"]}
    assert labels["ep"]["degree"] == 2 and not labels["ep"]["validated"], labels
    assert plan.predicted["ground_margin"] > 0 and "ep=2: not validated" in str(plan)


@pytest.mark.parametrize("kwargs, words", [
    (dict(ep=3, dp=6), ("ep=3", "does not divide the 4 experts", "h.0.moe.experts.w_in")),
    (dict(ep=8), ("ep=8", "more than the 6 devices")),
    (dict(ep=4, dp=6), ("ep=4", "does not divide dp=6")),
])
def test_bad_ep_is_refused_naming_why(kwargs: dict, words: tuple[str, ...]) -> None:
    with pytest.raises(AutoparError) as info:
        autopar.plan(_moe(), "6xcpu", (torch.cat([IDX] * 3)[:12],) * 2, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_dense_and_loop_experts_are_regions_too() -> None:
    """GShard's einsums over capacity slots (experts on dim 1), and experts written as
    modules of a list, each picking its rows with nonzero (one region per expert)."""
    dense = expert_regions(autopar.trace(_moe("dense"), (IDX, IDX)))
    assert [(r.kind, r.expert_dim, r.experts) for r in dense] == [("dense", 1, 4)] * 2
    loop = expert_regions(autopar.trace(_moe("loop"), (IDX, IDX)))
    assert [(r.kind, r.expert_dim, r.experts) for r in loop] == [
        ("loop", e, 4) for _ in range(2) for e in range(4)]
    assert loop[1].weight_fqns == ("h.0.moe.experts.1.0.weight", "h.0.moe.experts.1.2.weight")
    plan = autopar.plan(_moe("loop"), "2xcpu", (IDX, IDX), dp=2, ep=2)
    assert plan.mesh["ep"] == 2  # whole experts live on one ep rank each: no placement
    assert "ep" not in plan.params["h.0.moe.experts.1.0.weight"]


def test_experts_are_priced_by_the_tokens_they_expect() -> None:
    """An expert picking its rows with ``where(indices == e)`` has a row count known only at
    run time: it is priced at tokens x top-k / experts, as grouped matmuls over the sorted
    tokens are, not at one row (free) nor at every token."""
    from autopar.core.graph_facts import META_KEY

    def expert_flops(routing: str) -> int:
        gm = autopar.trace(_moe(routing, experts=8), (IDX, IDX))
        return sum(n.meta[META_KEY].fwd_flops for n in gm.graph.nodes
                   if META_KEY in n.meta and ".experts" in (n.meta[META_KEY].module_path or "")
                   or "grouped_mm" in str(n.target))

    tokens, top_k, hidden, ffn = IDX.numel(), 2, 32, 32
    per_layer = 2 * tokens * top_k * hidden * ffn * 2  # two matmuls, 2 FLOPs a MAC
    assert expert_flops("loop") == expert_flops("sorted") == 2 * per_layer


def test_plan_reports_load_imbalance_and_capacity_drops() -> None:
    """Under balanced routing by chance alone (modelled): the busiest ep rank's excess over
    its share, and the pairs GShard's capacity slots drop, as a binomial count gives
    (checked against simulation in cost_models/expert_load.py's examples)."""
    from autopar.cost_models.expert_load import dropped_fraction

    model = MoEGPT(MoEConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                             experts=4, top_k=2, expert_ffn=32, routing="dense",
                             capacity_factor=1.0))
    plan = autopar.plan(model, "2xcpu", (IDX, IDX), dp=2, ep=2)
    load = plan.explanation["experts"]["load"]
    assert load["capacity_slots"] == 8  # capacity factor 1 x 16 tokens x top-2 / 4 experts
    assert load["dropped_fraction"] == pytest.approx(dropped_fraction(32, 4, 8))
    assert 0 < load["busiest_rank_excess"] < 0.5
    unspread = autopar.plan(_moe(), "2xcpu", (IDX, IDX), dp=2, ep=1)
    assert unspread.explanation["experts"]["load"]["busiest_rank_excess"] == 0.0


def test_top_k_above_experts_is_refused() -> None:
    with pytest.raises(ModelSpecError, match="top_k"):
        MoEConfig(block_size=16, vocab_size=96, n_layer=1, n_head=4, n_embd=32, experts=2,
                  top_k=3)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, cases", [
    (2, [*({"model": f"moe-{r}", "dp": 2, "ep": 2} for r in ("loop", "dense", "sorted")),
         {"model": "mixtral", "dp": 2, "ep": 2},
         {"model": "zoo:qwen2_moe", "dp": 2, "ep": 2},  # Hugging Face's, tiny
         {"model": "zoo:deepseek_v3", "dp": 2, "ep": 2, "zero": 3},
         # experts as users write them outside any layer: a loop picking rows with
         # any().nonzero(), biases in the experts (tests/hand_models.py); and OLMoE's
         {"model": "hand:moe_loop", "dp": 2, "ep": 2},
         {"model": "zoo:olmoe", "dp": 2, "ep": 2}]),
    # ep x tp; ZeRO-3 shards the experts over the ranks holding the same ones (edp=2 with
    # dp=4, ep=2), the rest over dp; ep + pp: with the balancing loss over the global batch,
    # one microbatch per rank (GPipe); with the z-loss alone, several, under every schedule
    # (one launch: they share its models and traces)
    (4, [{"model": "moe-loop", "dp": 2, "ep": 2, "tp": 2, "cluster": FAST},
         *({"model": f"moe-{r}", "dp": 2, "ep": 2, "tp": 2, "zero": 3, "cluster": FAST}
           for r in ("dense", "sorted")),
         {"model": "mixtral", "dp": 2, "ep": 2, "tp": 2, "zero": 3, "cluster": FAST},
         {"model": "mixtral", "dp": 4, "ep": 2, "zero": 3},
         {"model": "moe-loop", "dp": 4, "ep": 2, "zero": 3},
         {"model": "moe-dense", "dp": 4, "ep": 4},
         *({"model": f"moe-{r}", "dp": 2, "ep": 2, "pp": 2, "microbatches": 1,
            "schedule": "gpipe"} for r in ("loop", "dense", "sorted")),
         {"model": "mixtral", "dp": 2, "ep": 2, "pp": 2, "microbatches": 1,
          "schedule": "gpipe", "zero": 3},
         {"model": "moe-sorted-zloss", "dp": 2, "ep": 2, "pp": 2, "microbatches": 2,
          "schedule": "1f1b"},
         {"model": "moe-loop-zloss", "dp": 2, "ep": 2, "pp": 2, "microbatches": 2,
          "schedule": "zb_v", "layers": 4}]),
], ids=["2ranks", "4ranks"])
def test_expert_parallel_matches_single_device(nproc: int, cases: list[dict],
                                               tmp_path: Path) -> None:
    """Every loss and every gradient (expert weights compared block by block, or whole on
    the rank holding the expert) on every rank equal one device's (fp32, 3 steps), in each
    routing style, with the balancing loss over the global batch."""
    cases = [{"zero": 0, **case} for case in cases]  # ZeRO-0 unless the case says 3
    pytest.importorskip("transformers")
    for rank in run_cases(nproc, tmp_path, cases):
        for case, r in zip(cases, rank):
            assert r["ok"], r
            assert r["mesh"]["ep"] == case["ep"] and r["mesh"]["dp"] == case["dp"]
            assert r["zero"] == case["zero"]
            assert r["mesh"].get("pp", 1) == case.get("pp", 1)
            if "tp" in case:
                assert r["sharded"], ("expected tensor-parallel weights", case)


@pytest.mark.parametrize("routing", ["dense", "sorted"])
def test_no_tensor_parallel_collective_splits_an_expert_region(routing: str) -> None:
    """With ep > 1 each expert region runs as one block between its all-to-alls (one module
    under ZeRO-3): every value passed between two of its ops keeps its tp placement, even
    where a redistribution inside would price the same (the tie that once split a dense
    region in two, and outline-experts failed)."""
    import yaml

    from autopar.core.values import tensor_inputs

    model = _moe(routing)
    cluster = yaml.safe_load(Path(FAST).read_text())
    cluster.update(nodes=1, devices_per_node=4)
    plan = autopar.plan(model, cluster, (IDX, IDX), dp=2, ep=2, tp=2, zero=3,
                        recompute=("none",))
    strategies = plan.to_dict()["strategies"]
    checked = 0
    for region in expert_regions(autopar.trace(model, (IDX, IDX))):
        for node in region.members:
            if node.name not in strategies:
                continue
            for slot, a in enumerate(tensor_inputs(node)):
                if a in region.members and a.name in strategies:
                    assert strategies[node.name]["tp"]["in"][slot] == \
                        strategies[a.name]["tp"]["out"][0], (node.name, a.name)
                    checked += 1
    assert checked >= 2


def test_why_experts_stay_whole_never_calls_a_faster_setting_slower() -> None:
    """A setting spreading the experts that was predicted faster but lost on the
    extrapolation handicap is said to be faster, and why it lost."""
    from autopar.solver.explain.explain_experts import _why

    spread = [{"ep": 8, "dp": 1024, "step_time_s": 44.7}]
    assert _why(1, None, spread, chosen_step_s=49.7).count("faster than the chosen 49.7 s")
    assert "extrapolation_margin" in _why(1, None, spread, chosen_step_s=49.7)
    assert _why(1, None, spread, chosen_step_s=40.0).endswith("slower")
