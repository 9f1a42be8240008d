"""Per-node precision: the default policy, overrides, what the plan records, what the cost
model makes of it, and that the rank program computes in exactly the planned dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import autopar
from autopar.analysis.precision import assign_precision
from autopar.core.cluster import load_cluster
from autopar.core.errors import AutoparError, PlanError
from autopar.core.graph_facts import META_KEY
from autopar.core.plan import Plan
from autopar.models import GPT, GPTConfig, resolve_model
from autopar.ops.fp8_ops import fp8_linear
from autopar.solver.search.pinned import PinnedConfig, estimate_graph

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx)


@pytest.fixture(scope="module")
def llama():
    spec = resolve_model(LLAMA)
    with torch.device("meta"):
        model = spec.build()
    return autopar.trace(model, spec.example_inputs(2, 32))


def _targets(gm: fx.GraphModule, words: dict[str, str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(META_KEY)
        if facts is not None and node.name in words:
            out.setdefault(facts.target, set()).add(words[node.name])
    return out


def test_default_policy_lowers_matmuls_and_keeps_norms_softmax_loss_fp32(llama) -> None:
    a = assign_precision(llama, "bf16")
    by_target = _targets(llama, a.nodes)
    assert by_target["aten.linear.default"] == {"bf16"}
    assert by_target["aten.scaled_dot_product_attention.default"] == {"bf16"}
    assert by_target["aten.cross_entropy_loss.default"] == {"fp32"}
    norm = [n.name for n in llama.graph.nodes if n.meta.get(META_KEY) is not None
            and n.meta[META_KEY].module_type.endswith("RMSNorm") and n.name in a.nodes]
    assert norm and {a.nodes[n] for n in norm} == {"fp32"}
    assert set(a.kept_fp32.values()) == {"normalisation", "loss"}
    # the residual stream adds a bf16 matmul output to fp32: promotion gives fp32
    adds = [n.name for n in llama.graph.nodes if n.meta.get(META_KEY) is not None
            and n.meta[META_KEY].module_type == "LlamaDecoderLayer"
            and n.meta[META_KEY].target == "aten.add.Tensor"]
    assert adds and {a.nodes[n] for n in adds} == {"fp32"}


def test_fp8_takes_aligned_linears_only_and_leaves_attention_bf16(llama) -> None:
    a = assign_precision(llama, "fp8")
    by_target = _targets(llama, a.nodes)
    assert by_target["aten.linear.default"] == {"fp8"}  # every dim here is a multiple of 16
    assert by_target["aten.scaled_dot_product_attention.default"] == {"bf16"}
    assert by_target["aten.cross_entropy_loss.default"] == {"fp32"}


def test_router_logits_stay_fp32() -> None:
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(32, 8)
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            probs = torch.softmax(self.gate(x), dim=-1)
            weights, _ = torch.topk(probs, 2, dim=-1)
            return (self.proj(x) * weights.sum(-1, keepdim=True)).mean()

    gm = autopar.trace(Router(), (torch.randn(4, 32),))
    a = assign_precision(gm, "bf16")
    gate = next(n.name for n in gm.graph.nodes if n.meta.get(META_KEY) is not None
                and n.meta[META_KEY].module_path == "gate" and n.op == "call_function")
    proj = next(n.name for n in gm.graph.nodes if n.meta.get(META_KEY) is not None
                and n.meta[META_KEY].module_path == "proj" and n.op == "call_function")
    assert a.nodes[gate] == "fp32" and a.kept_fp32[gate] == "router"
    assert a.nodes[proj] == "bf16"


def test_overrides_by_node_and_module_path(llama) -> None:
    a = assign_precision(llama, "bf16", {"linear": "fp32", "model.layers.1.mlp": "fp32"})
    assert a.nodes["linear"] == "fp32" and a.kept_fp32["linear"] == "override"
    mlp = [n.name for n in llama.graph.nodes if n.meta.get(META_KEY) is not None
           and n.meta[META_KEY].module_path.startswith("model.layers.1.mlp")
           and n.name in a.nodes]
    assert mlp and {a.nodes[n] for n in mlp} == {"fp32"}


def test_override_naming_nothing_is_an_error_with_suggestions(llama) -> None:
    with pytest.raises(AutoparError) as e:
        assign_precision(llama, "bf16", {"linear_99x": "fp32"})
    assert e.value.where == "precision_overrides['linear_99x']"
    assert "linear" in e.value.fix
    model, inputs = _gpt()
    with pytest.raises(AutoparError) as e:
        autopar.plan(model, "1xcpu", inputs, precision="bf16",
                     precision_overrides={"transformer.h.7": "fp32"})
    assert "transformer.h.7" in e.value.what


@pytest.mark.parametrize(("precision", "cluster", "needs"), [
    ("fp8", "1xA100-80GB", "fp8 tensor cores"),
    ("bf16", "1xV100-32GB", "bf16"),
    ("fp64", "1xH100-80GB", "unknown precision"),
])
def test_precision_the_device_cannot_run_fails_at_plan_time(precision, cluster, needs) -> None:
    model, inputs = _gpt()
    with pytest.raises(AutoparError) as e:
        autopar.plan(model, cluster, inputs, precision=precision)
    assert needs in e.value.what
    assert e.value.where.startswith("precision")


def test_auto_picks_bf16_where_the_device_has_it() -> None:
    model, inputs = _gpt()
    assert autopar.plan(model, "1xH100-80GB", inputs, precision="auto").training[
        "precision"] == "bf16"
    assert autopar.plan(model, "1xV100-32GB", inputs, precision="auto").training[
        "precision"] == "fp32"


def test_plan_records_the_map_and_the_schema_checks_it() -> None:
    model, inputs = _gpt()
    plan = autopar.plan(model, "1xH100-80GB", inputs, precision="bf16", zero=0)
    assert set(plan.precision) <= set(plan.strategies)
    assert plan.precision_policy["compute"] == "bf16"
    assert plan.precision_policy["kept_fp32"]["loss"] == ["cross_entropy_loss"]
    assert Plan.from_json(plan.to_json()) == plan
    data = plan.to_dict()
    data["precision"]["no_such_node"] = "bf16"
    with pytest.raises(PlanError) as e:
        Plan.from_dict(data)
    assert e.value.where == "precision.no_such_node"
    data = plan.to_dict()
    data["precision"][next(iter(data["precision"]))] = "fp4"
    with pytest.raises(PlanError):
        Plan.from_dict(data)


def test_cost_model_prices_each_precision(llama) -> None:
    """Each precision is priced by its rate, its bytes and its casts: on layers large
    enough for the matmuls to dominate, fp8 < bf16 < fp32; on tiny ones the fp8 linears'
    quantization kernels (an amax pass and a cast per input and output gradient) cost more
    than their matmuls save, as torchao's float8 documents for small shapes (modelled)."""
    cluster = load_cluster("1xH100-80GB")

    def computes(gm, batch: int) -> dict:
        return {p: estimate_graph(gm, cluster, PinnedConfig(
            precision=p, microbatch=batch, global_batch=batch)) for p in ("fp32", "bf16", "fp8")}

    # Llama 3 8B's layer widths: fp8's matmuls reach 0.9 of bf16's efficiency on Hopper
    # (measured), so narrower layers barely gain from fp8 once quantization is paid
    spec = resolve_model("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=1024,"
                         "seq=4096")
    with torch.device("meta"):
        large = autopar.trace(spec.build(), spec.example_inputs(1, 4096))
    est = computes(large, 1)
    compute = {p: e.prediction.compute_s for p, e in est.items()}
    assert compute["fp8"] < compute["bf16"] < compute["fp32"], compute
    acts = {p: sum(e.prediction.layer_activations.values()) for p, e in est.items()}
    assert acts["bf16"] < acts["fp32"], acts
    tiny = {p: e.prediction.compute_s for p, e in computes(llama, 2).items()}
    assert tiny["bf16"] < tiny["fp32"] and tiny["fp8"] > tiny["bf16"], tiny


def test_rank_program_computes_in_the_planned_dtypes() -> None:
    """Run the bf16 rank program once on one process and compare the dtype every planned
    node's output really has with the dtype the plan stores it in."""
    model, inputs = _gpt()
    pm = autopar.parallelize(model, "1xcpu", inputs, precision="bf16", recompute=("none",))
    program = pm._program
    seen: dict[str, str] = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            facts = n.meta.get(META_KEY)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and facts is not None:
                seen[facts.name] = {torch.float32: "fp32", torch.bfloat16: "bf16"}[out.dtype]
            return out

    args, _ = pm.shard_batch(*inputs)
    Record(program).run(*args)
    words = pm.plan.precision
    checked = [n for n in seen if n in words]
    assert len(checked) > 20
    wrong = {n: (words[n], seen[n]) for n in checked if words[n] != seen[n]}
    assert not wrong, wrong
    assert "cast_to(" in pm.code and "torch.bfloat16" in pm.code


def test_fp8_linear_is_close_to_the_fp32_one() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(96, 128, requires_grad=True)
    y = fp8_linear(x, w)
    ref = x @ w.T
    assert y.dtype == torch.bfloat16
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # quantised (not exact), but close
    g = torch.randn_like(ref)
    (y.float() * g).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (ref * g).sum().backward()
    for got, want in ((gx, x.grad), (gw, w.grad)):
        assert ((got - want).norm() / want.norm()).item() < 0.15


def test_zero3_keeps_a_16bit_residual_stream_and_norms_hand_it_back(llama) -> None:
    """Under ZeRO-3 the parameters are gathered in bf16, so the residual stream is bf16; a
    norm normalises in fp32 and casts back before its weight (as HF's RMSNorm does), and the
    rotary tables meet q and k in their dtype. With fp32 parameters (ZeRO-0) the stream is
    fp32 and nothing is cast back."""
    a = assign_precision(llama, "bf16", params="bf16")
    adds = [n.name for n in llama.graph.nodes if n.meta.get(META_KEY) is not None
            and n.meta[META_KEY].module_type == "LlamaDecoderLayer"
            and n.meta[META_KEY].target == "aten.add.Tensor"]
    assert adds and {a.nodes[n] for n in adds} == {"bf16"}
    assert a.cast_back and set(a.cast_back.values()) == {"bf16"}
    assert all(a.nodes[n] == "fp32" for n in a.cast_back)  # normalised in fp32
    stats = [n for n, why in a.kept_fp32.items() if why == "normalisation"]
    assert stats and {a.nodes[n] for n in stats} == {"fp32"}
    rotary = [n.name for n in llama.graph.nodes if n.meta.get(META_KEY) is not None
              and n.meta[META_KEY].module_type == "LlamaAttention"
              and n.meta[META_KEY].target == "aten.mul.Tensor"]
    assert rotary and {a.nodes[n] for n in rotary} == {"bf16"}
    assert not assign_precision(llama, "bf16", params="fp32").cast_back


@pytest.mark.parametrize("zero", [0, 3])
def test_fp8_plan_peak_counts_its_weight_copies(llama, zero) -> None:
    """The plan's peak is the largest of its memory phases, and under fp8 both count the
    per-step fp8 weight copies (``step_copies.one_weight_copy_per_step``): a peak without them
    would call a plan fitting that does not (modelled)."""
    cluster = load_cluster("2xH100-80GB")
    est = {p: estimate_graph(llama, cluster, PinnedConfig(
        dp=2, zero=zero, precision=p, microbatch=2, global_batch=4)) for p in ("bf16", "fp8")}
    for p, e in est.items():
        pred = e.prediction
        assert pred.peak_memory_bytes == pytest.approx(max(pred.memory_phases.values())), p
    copies = sum(e.tables.step_copy_bytes(d, d.candidates[i]) * d.count
                 for e in (est["fp8"],) for d, i in zip(e.problem.decisions, e.choice)
                 if d.index in e.tables.fp8_readers)
    assert copies > 0
    assert est["fp8"].prediction.memory.buffers >= copies


def test_16bit_weight_copies_are_counted_once_a_step(llama) -> None:
    """A bf16 pipeline stage keeps one 16-bit copy of its weights for the step (buffers),
    where per-use casts (``weight_copies="use"``, torch.autocast) keep one per microbatch in
    flight (activations): the difference is the copies times the microbatches in flight
    less one (modelled)."""
    cluster = load_cluster("2xH100-80GB")
    est = {c: estimate_graph(llama, cluster, PinnedConfig(
        pp=2, precision="bf16", microbatch=1, global_batch=8, weight_copies=c))
        for c in ("step", "use")}
    step, use = (est[c].prediction for c in ("step", "use"))
    stage = max(range(2), key=lambda r: step.stages[r].memory.total)
    copies = step.memory.buffers
    assert copies > 0 and use.memory.buffers == 0
    flight = step.stages[stage].in_flight
    assert flight > 1
    assert use.memory.activations - step.memory.activations == pytest.approx(
        copies * flight, rel=0.02)
    assert step.peak_memory_bytes < use.peak_memory_bytes
    assert step.step_time_s < use.step_time_s  # cast once a step, not once a microbatch


def test_weight_copies_made_per_use_are_not_kept(llama) -> None:
    """A program that casts each weight where its linear runs (torchao's Float8Linear) keeps
    no fp8 weight copy across the step: ``weight_copies="use"`` prices it so, and an
    unknown lifetime is refused naming the field (modelled)."""
    cluster = load_cluster("2xH100-80GB")

    def buffers(copies: str) -> float:
        return estimate_graph(llama, cluster, PinnedConfig(
            dp=2, zero=3, precision="fp8", microbatch=2, global_batch=4,
            weight_copies=copies)).prediction.memory.buffers

    assert buffers("use") < buffers("step")
    with pytest.raises(AutoparError, match="weight_copies"):
        PinnedConfig(weight_copies="forever")
