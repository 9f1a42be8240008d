"""Constraints the solver must obey, and the error that names the ones that conflict."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.cli.load import trace_model
from autopar.cli.main import main
from autopar.core.cluster import load_cluster
from autopar.core.constraints import (
    Constraint,
    ConstraintError,
    LayoutView,
    MemoryCap,
    SettingView,
    parse_constraint,
    parse_constraints,
)
from autopar.core.errors import ClusterError, NoFeasiblePlanError
from autopar.models import GPT, GPTConfig
from autopar.solver.model.stages import StageLoad, balance
from autopar.solver.options import PlanOptions
from autopar.solver.search.memory_floors import mesh_memory_floors
from tests.distributed import FAST

WIDE = "gpt:layers=1,hidden=4096,heads=32,vocab=50304,seq=1024"


def _gpt(layers: int = 4, batch: int = 8):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=128, n_layer=layers, n_head=2, n_embd=64))
    idx = torch.randint(0, 128, (batch, 32))
    return model, (idx, idx)


@pytest.mark.parametrize("text", ["tp<=4", "dp>=2", "pp==2", "devices<=64", "memory<=40GiB",
                                  "schedule in 1f1b,zb_v", "cut after 11", "replicate lm_head",
                                  "dtype lm_head=fp32"])
def test_texts_read_back_as_written(text: str) -> None:
    assert str(parse_constraint(text)) == text


@pytest.mark.parametrize("text, names", [("tp<=x", "'x'"), ("zz<=2", "'zz'"),
                                         ("memory>=4GiB", "upper bound"),
                                         ("schedule in nope", "nope"), ("hello", "hello"),
                                         ("dtype lm_head=fp12", "fp12")])
def test_a_bad_constraint_names_itself(text: str, names: str) -> None:
    with pytest.raises(ConstraintError, match=names):
        parse_constraint(text)


def test_degree_schedule_and_device_constraints_are_obeyed() -> None:
    model, batch = _gpt()
    plan = autopar.plan(model, FAST, batch, constraints=["pp==2", "tp<=1", "schedule in gpipe"])
    assert plan.mesh.get("pp") == 2 and plan.mesh.get("tp", 1) == 1
    assert plan.pipeline["schedule"] == "gpipe"
    assert plan.constraints == ["pp==2", "tp<=1", "schedule in gpipe"]
    plan = autopar.plan(model, "4xcpu", batch, constraints=["devices<=2"])
    assert plan.world_size <= 2


@pytest.mark.parametrize("after", [0, 2])
def test_a_pipeline_cut_after_layer_k_is_obeyed(after: int) -> None:
    model, batch = _gpt(layers=4)
    plan = autopar.plan(model, FAST, batch, constraints=[f"cut after {after}"])
    assert plan.mesh.get("pp", 1) > 1
    ends = [chunk["layers"][1] for chunk in plan.pipeline["chunks"]]
    assert after in ends, plan.pipeline["chunks"]


def test_a_cut_after_the_last_layer_is_refused_before_solving() -> None:
    model, batch = _gpt(layers=2)
    with pytest.raises(ConstraintError, match="cut after 1: the model has 2 repeated layer"):
        autopar.plan(model, FAST, batch, constraints=["cut after 1"])


def test_balance_keeps_required_boundaries() -> None:
    load = StageLoad(pre_time=0.0, post_time=0.0, layer_time=(1.0,) * 8, pre_state=0.0,
                     post_state=0.0, layer_state=(0.0,) * 8, pre_act=0.0, post_act=0.0,
                     layer_act=(0.0,) * 8)
    assert balance(load, 2, "1f1b", 1, 4, 1e18) == (4, 4)
    assert balance(load, 2, "1f1b", 1, 4, 1e18, frozenset({3})) == (3, 5)
    assert balance(load, 2, "1f1b", 1, 4, 1e18, frozenset({2, 5})) is None  # 3 stages' worth
    assert sum(balance(load, 2, "interleaved", 2, 4, 1e18, frozenset({1}))[:1]) == 1


def test_a_memory_cap_is_obeyed() -> None:
    model, batch = _gpt()
    free = autopar.plan(model, FAST, batch, dp=1, tp=1, pp=1, zero=(0,), devices=1)
    peak = free.predicted["peak_memory_bytes"]
    cap = int(peak * 0.8)
    plan = autopar.plan(model, FAST, batch, constraints=[MemoryCap(cap)], devices=4)
    assert plan.predicted["peak_memory_bytes"] <= cap


def test_a_replicated_module_keeps_its_weights_whole() -> None:
    model, batch = _gpt(layers=2)
    plan = autopar.plan(model, FAST, batch, tp=2, dp=2)
    assert any(ax.get("tp", "R") != "R" for fqn, ax in plan.params.items() if ".mlp." in fqn)
    plan = autopar.plan(model, FAST, batch, tp=2, dp=2, constraints=["replicate mlp"])
    mlp = {fqn: ax.get("tp", "R") for fqn, ax in plan.params.items() if ".mlp." in fqn}
    assert mlp and all(p == "R" for p in mlp.values()), mlp


def test_a_constraint_plugin_can_restrict_a_layout() -> None:
    class NoShardedEmbedding(Constraint):
        def restrict(self, layout: LayoutView) -> None:
            for d in layout.decisions:
                if d.op == "aten.embedding.default":
                    for i, whole in enumerate(d.replicated):
                        if not whole:
                            layout.forbid(d, i)

        def __str__(self) -> str:
            return "embedding whole"

    model, batch = _gpt(layers=2)
    plan = autopar.plan(model, FAST, batch, tp=2, dp=2, constraints=[NoShardedEmbedding()])
    emb = [n for n in plan.strategies if "embedding" in n]
    assert emb and all("S(" not in plan.strategies[n]["tp"] for n in emb)
    assert plan.constraints == ["embedding whole"]


def _lows(zero: tuple[int, ...]) -> dict[int, float]:
    traced = trace_model(WIDE, None, None)
    options = PlanOptions(global_batch=traced.batch, zero=zero, precision="bf16")
    return {s.tp: m.total for s, m in mesh_memory_floors(traced.gm, load_cluster(
        "4xA100-80GB"), options)}


def test_conflicting_constraints_are_named_together(capsys) -> None:
    lows = _lows((0,))  # ZeRO-0: only tensor parallelism splits the weights (one layer)
    cap = (lows[2] + lows[4]) / 2  # tp=4 fits under it, tp=2 does not
    gib = f"memory<={cap / 2**30:.2f}GiB"
    code = main(["plan", WIDE, "--cluster", "4xA100-80GB", "--zero", "0", "--constraint",
                 "tp<=2", "--constraint", gib])
    err = capsys.readouterr().err
    assert code == 2
    assert "no plan satisfies tp<=2 and memory<=" in err
    assert "where: constraints: tp<=2, memory<=" in err
    assert "dropping tp<=2 allows e.g. tp=4" in err


def test_constraints_from_a_cluster_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 1\ndevices_per_node: 4\ndevice: cpu\nbackend: gloo\n"
                    "constraints: [\"tp<=1\", \"pp==2\"]\n")
    cluster = load_cluster(str(path))
    assert cluster.constraints == ("tp<=1", "pp==2")
    model, batch = _gpt()
    plan = autopar.plan(model, cluster, batch)
    assert plan.mesh.get("pp") == 2 and plan.mesh.get("tp", 1) == 1
    path.write_text("nodes: 1\ndevices_per_node: 4\ndevice: cpu\nconstraints: [\"tp<<1\"]\n")
    with pytest.raises(ClusterError, match=r"constraints\[0\]"):
        load_cluster(str(path))


def test_views_are_stable() -> None:
    view = SettingView(dp=2, tp=4, pp=2)
    assert view.devices == 16
    assert [f.name for f in dataclasses.fields(SettingView)][:5] == ["dp", "tp", "pp", "cp", "ep"]
    assert parse_constraints(["tp<=2", parse_constraint("dp>=2")])[1].allows(view)


def test_a_pinned_degree_in_conflict_is_named_as_a_pin() -> None:
    model, batch = _gpt()
    with pytest.raises(NoFeasiblePlanError, match=r"tp>=2 and tp=1 \(pinned\)"):
        autopar.plan(model, FAST, batch, tp=1, constraints=["tp>=2"])


def test_a_module_dtype_constraint_sets_its_precision() -> None:
    model, batch = _gpt(layers=2)
    plan = autopar.plan(model, "8xA100-80GB", batch, constraints=["dtype lm_head=fp32"])
    assert plan.training["precision"] == "bf16"
    assert plan.precision_policy["overrides"] == {"lm_head": "fp32"}
    (head,) = plan.precision_policy["kept_fp32"]["override"]  # the lm_head's linear
    assert plan.precision[head] == "fp32"
