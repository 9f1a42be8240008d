"""Plugins by entry point: a separately installed package's pass changes every rank's
program (under ``autopar emit`` and ``parallelize``), its rule and constraint join, and a
broken plugin is reported by name and package while everything else works."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import autopar
from autopar.cli.main import main
from autopar.cli.plugins_cmd import format_plugins
from autopar.core.errors import AutoparError, PassError
from autopar.core.plugins import PluginWarning, discover
from autopar.passes import GraphPass, PassResult, place_passes, program_passes
from autopar.passes.program import program_for
from tests.distributed import FAST, run_cases
from tests.plugin_dist import install_broken, install_costly, install_example

SMALL = "gpt:layers=2,hidden=64,heads=2,vocab=128,seq=32"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The example plugin and a broken one, installed into a folder on ``sys.path``."""
    folder = tmp_path_factory.mktemp("site")
    install_example(folder)
    install_broken(folder)
    sys.path.insert(0, str(folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginWarning)
        discover(refresh=True)
    yield folder, [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]
    sys.path.remove(str(folder))
    for name in [m for m in sys.modules if m.startswith("autopar_example_plugin")]:
        del sys.modules[name]
    discover(refresh=True)


def test_both_plugins_are_discovered_and_the_broken_one_is_named(site) -> None:
    _, warned = site
    found = {p.name: p for p in discover()}
    assert found["erf-gelu"].status == "loaded" and found["erf-gelu"].where == \
        "after insert-collectives"
    assert found["scaled-tanh"].status == "loaded"
    assert found["dp-power-of-two"].status == "loaded"
    broken = found["broken-pass"]
    assert broken.status == "failed" and broken.package == "autopar-broken-plugin"
    assert "broken on purpose" in broken.error
    assert len(warned) == 1 and "broken-pass" in warned[0] and "autopar-broken-plugin" in warned[0]


def test_autopar_plugins_lists_both_with_status(site, capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "erf-gelu" in out and "autopar-example-plugin" in out and "loaded" in out
    assert "broken-pass" in out and "failed: ImportError: this plugin is broken on purpose" in out
    assert format_plugins() in out


def test_the_plugin_rule_is_registered(site) -> None:
    from autopar.strategies.registry import rule_for

    assert rule_for(torch.ops.autopar_example.scaled_tanh.default) is not None


def test_emit_runs_the_plugin_pass_on_every_rank(site, capsys) -> None:
    for rank in (0, 1):
        assert main(["emit", SMALL, "--cluster", FAST, "--tp", "2", "--rank", str(rank)]) == 0
        out = capsys.readouterr().out
        assert "# pass erf-gelu: 2 change(s)" in out
        assert "erf_gelu" in out and "aten.gelu" not in out
        # it ran after the collectives were inserted, as it asked
        assert out.index("# pass insert-collectives") < out.index("# pass erf-gelu")
    assert main(["emit", SMALL, "--cluster", FAST, "--tp", "2", "--disable-pass", "erf-gelu"]) == 0
    out = capsys.readouterr().out
    assert "erf_gelu" not in out and "aten.gelu" in out


def test_a_plugin_constraint_is_used_by_name(site) -> None:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (6, 16))
    plan = autopar.plan(model, "6xcpu", (idx, idx), constraints=["dp-power-of-two"],
                        devices=6)
    assert plan.mesh["dp"] & (plan.mesh["dp"] - 1) == 0
    assert plan.constraints == ["dp-power-of-two"]


@pytest.mark.slow
def test_parallelize_runs_the_plugin_pass_on_every_rank_and_trains_the_same(site) -> None:
    folder, _ = site
    case = {"model": "gpt", "tp": 2, "count_in_code": ["erf_gelu", "aten.gelu"]}
    results = run_cases(2, folder / "out", [case], path=(str(folder),))
    for rank in results:
        (record,) = rank
        assert record["ok"], record  # every loss and gradient equals one device's
        assert record["code_counts"]["erf_gelu"] >= 2
        assert record["code_counts"]["aten.gelu"] == 0


class _Tag(GraphPass):
    name = "tag"

    def __init__(self, after=None, before=None):
        self.runs_after, self.runs_before = after, before

    def run(self, gm, ctx):
        return PassResult(gm, modified=False)


def _plan(**pins):
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (4, 16))
    return autopar.plan(model, FAST, (idx, idx), **pins)


def test_passes_are_placed_where_they_say() -> None:
    plan = _plan(tp=2, dp=2)
    names = [p.name for p in program_passes(plan)]
    placed = [p.name for p in place_passes(program_passes(plan), [_Tag(after="localize-shapes")])]
    assert placed.index("tag") == placed.index("localize-shapes") + 1
    placed = [p.name for p in place_passes(program_passes(plan), [_Tag(before="shard-parameters")])]
    assert placed[0] == "tag"
    assert [p.name for p in place_passes(program_passes(plan), [_Tag()])][-1] == "tag"
    # anchored on a pass this program does not run: where that one would have run
    placed = [p.name for p in place_passes(program_passes(plan), [_Tag(after="pipeline-split")])]
    assert placed[-1] == "tag" and placed[:-1] == names
    with pytest.raises(PassError, match="insert-colectives.*no built-in pass"):
        place_passes(program_passes(plan), [_Tag(after="insert-colectives")])


def test_a_plugin_pass_that_raises_names_itself() -> None:
    from autopar.passes import PassContext, PassManager

    class Boom(GraphPass):
        name = "boom"
        runs_after = "insert-collectives"

        def run(self, gm, ctx):
            raise ValueError("kaboom")

    plan = _plan(tp=2, dp=2)
    from autopar.cli.load import trace_model

    gm = trace_model(SMALL, 4, 32).gm
    with pytest.raises(PassError, match="pass 'boom' failed: ValueError: kaboom"):
        PassManager(program_for(plan, [Boom()])).run(gm, PassContext(plan, {"dp": 0, "tp": 0}))


def test_required_passes_cannot_be_disabled() -> None:
    plan = _plan(tp=2, dp=2)
    with pytest.raises(AutoparError, match="insert-collectives.*needs them"):
        program_for(plan, disable=["insert-collectives"])
    with pytest.raises(AutoparError, match="does not run"):
        program_for(plan, disable=["no-such-pass"])
    assert "chunked-loss" not in [p.name for p in program_for(plan, disable=["chunked-loss"])]


def test_built_in_order_lists_every_built_in_pass() -> None:
    import autopar.passes as builtin

    names = {cls.name for cls in vars(builtin).values()
             if isinstance(cls, type) and issubclass(cls, GraphPass) and cls.name}
    assert names == set(builtin.BUILTIN_ORDER)


def test_a_cost_model_plugin_prices_its_op(tmp_path) -> None:
    from autopar.cost_models import op_costs

    install_costly(tmp_path)
    before = _plan(tp=1, dp=1, devices=1).predicted["compute_s"]
    sys.path.insert(0, str(tmp_path))
    try:
        found = {p.name: p for p in discover(refresh=True)}
        assert found["slow-gelu"].status == "loaded"
        assert found["slow-gelu"].package == "autopar-costly-plugin"
        after = _plan(tp=1, dp=1, devices=1).predicted["compute_s"]
        assert after >= 2 * 3.0 > 100 * before  # two GELUs, 1 s forward + 2 s backward each
    finally:
        sys.path.remove(str(tmp_path))
        op_costs._COSTS.pop("aten.gelu.default", None)
        sys.modules.pop("autopar_costly_plugin", None)
        discover(refresh=True)
