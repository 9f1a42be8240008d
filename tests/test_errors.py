"""The text of every bad-input error: what is wrong, where, and what to do.

Each case is checked through the Python API (an ``AutoparError`` subclass with ``what``,
``where`` and ``fix``, all three in ``str()``) and, where a user can reach it from the
command line, through ``autopar`` itself: exit status 2, and stderr that starts with
``autopar:`` and holds no traceback.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.cli.main import main
from autopar.core.cluster.presets import PRESETS
from autopar.core.errors import (
    AutoparError,
    ClusterError,
    ModelSpecError,
    NoFeasiblePlanError,
    PlanError,
    RuntimeSetupError,
    TraceError,
)
from autopar.core.graph_facts import graph_facts
from autopar.models import GPT, GPTConfig, resolve_model
from autopar.trace import TensorSpec

TINY_SPEC = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16,batch=4"
OTHER_SPEC = "gpt:layers=3,hidden=32,heads=4,vocab=64,seq=16,batch=4"


def assert_well_formed(err: AutoparError) -> None:
    """Every error has all three parts, and its message shows all three."""
    assert err.what and err.where and err.fix, (err.what, err.where, err.fix)
    text = str(err)
    assert err.what in text
    assert f"where: {err.where}" in text
    assert f"fix:   {err.fix}" in text


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``autopar argv``; it must fail cleanly (status 2, ``autopar: ...``). Its stderr."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (code, captured.out, captured.err)
    assert captured.err.startswith("autopar: "), captured.err[:2000]
    assert "Traceback" not in captured.err
    return captured.err


def tiny_gpt(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=n_layer, n_head=4, n_embd=32))


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, 64, (4, 16), generator=gen) for _ in range(2))


# --- clusters -----------------------------------------------------------------------------

# name -> (file text, phrases the message must contain, phrases the location must contain)
CLUSTER_FILES = {
    "malformed-yaml": (
        "nodes: 1\ndevices_per_node: 2\ndevice: preset: cpu\nbackend: gloo\n",
        ["not valid YAML", "mapping values are not allowed"],
        ["line 3"],
    ),
    "unknown-preset": (
        "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: H1000\n",
        ["unknown device preset 'H1000'"],
        ["device.preset"],
    ),
    "unknown-key": (
        "nodes: 1\ndevices_per_node: 2\ndevice:\n  preset: cpu\n  memroy_gib: 3\n",
        ["unknown key 'memroy_gib'"],
        ["device.memroy_gib"],
    ),
    "unknown-top-level-key": (
        "nodes: 1\ndevice_per_node: 2\ndevice: cpu\n",
        ["unknown key 'device_per_node'"],
        ["device_per_node"],
    ),
}


@pytest.fixture(params=sorted(CLUSTER_FILES))
def bad_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    path = tmp_path / f"{request.param}.yaml"
    path.write_text(CLUSTER_FILES[request.param][0])
    return request.param, path


def _check_cluster_fix(name: str, fix: str) -> None:
    if name == "malformed-yaml":
        assert "fix the YAML syntax" in fix
    elif name == "unknown-preset":
        assert "did you mean H100-80GB" in fix
        assert all(preset in fix for preset in PRESETS)  # lists the presets
    elif name == "unknown-key":
        assert "did you mean 'memory_gib'" in fix and "peak_tflops" in fix
    else:
        assert "did you mean 'devices_per_node'" in fix and "inter_node_link" in fix


def test_bad_cluster_file_through_the_api(bad_cluster: tuple[str, Path]) -> None:
    name, path = bad_cluster
    _, says, at = CLUSTER_FILES[name]
    with pytest.raises(ClusterError) as info:
        autopar.load_cluster(path)
    err = info.value
    assert_well_formed(err)
    assert str(path) in err.what  # which file
    for phrase in says:
        assert phrase in err.what
    assert str(path) in err.where
    for phrase in at:
        assert phrase in err.where
    _check_cluster_fix(name, err.fix)
    with pytest.raises(ClusterError):
        autopar.load_cluster(str(path))  # a path given as text is read the same way


def test_bad_cluster_file_through_the_cli(
    bad_cluster: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name, path = bad_cluster
    _, says, at = CLUSTER_FILES[name]
    err = run_cli(["cluster", "show", str(path)], capsys)
    for phrase in [*says, *at, "where:", "fix:"]:
        assert phrase in err
    with pytest.raises(ClusterError) as info:
        autopar.load_cluster(path)
    assert err.strip() == f"autopar: {info.value}"


def test_unknown_preset_in_a_shorthand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ClusterError) as info:
        autopar.load_cluster("2xH1000")
    assert_well_formed(info.value)
    assert "'H1000'" in info.value.what and "2xH1000" in info.value.where
    assert all(preset in info.value.fix for preset in PRESETS)
    err = run_cli(["plan", TINY_SPEC, "--cluster", "2xH1000"], capsys)
    assert "unknown device preset 'H1000'" in err and "H100-80GB" in err


# --- tracing -----------------------------------------------------------------------------


class DataDependentGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # control flow on a tensor's value
            return y * 2
        return y


class ModelWithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Identity(), DataDependentGate()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.sum()


class Result:
    """A user's own output type, not registered with pytree."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class ModelReturningObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Result:
        return Result(self.proj(x))


def _line_of(func: object, code: str) -> int:
    lines, start = inspect.getsourcelines(func)
    (offset,) = [i for i, line in enumerate(lines) if code in line]
    return start + offset


def test_data_dependent_control_flow_names_module_and_line() -> None:
    with pytest.raises(TraceError) as info:
        autopar.trace(ModelWithGate(), (torch.randn(4, 8),))
    err = info.value
    assert_well_formed(err)
    assert "data-dependent control flow" in err.what
    assert "'blocks.1'" in err.where and "DataDependentGate" in err.where
    line = _line_of(DataDependentGate.forward, "if y.sum() > 0")
    assert f"{__file__}:{line}" in err.where
    assert "torch.where" in err.fix or "torch.cond" in err.fix


def test_unsupported_output_type() -> None:
    with pytest.raises(TraceError) as info:
        autopar.trace(ModelReturningObject(), (torch.randn(4, 8),))
    err = info.value
    assert_well_formed(err)
    assert "unsupported output type" in err.what
    assert "Result" in err.what  # names the offending type
    assert "register" in err.fix and "tuple" in err.fix


def test_bad_example_inputs() -> None:
    with pytest.raises(TraceError) as info:
        autopar.trace(tiny_gpt(), "not a tensor")
    assert_well_formed(info.value)
    assert "str" in info.value.what and "(args, kwargs)" in info.value.fix
    with pytest.raises(TraceError) as info:
        TensorSpec((8, 16), "int13")
    assert_well_formed(info.value)
    assert "int13" in info.value.what and "int64" in info.value.fix
    with pytest.raises(TraceError) as info:
        TensorSpec((8, 0))
    assert_well_formed(info.value)
    assert "(8, 0)" in info.value.what


def test_tensor_spec_with_a_model_on_cpu() -> None:
    """TensorSpecs become meta tensors: with a model on CPU, tracing must either work or
    say to build the model under torch.device("meta")."""
    spec = TensorSpec((4, 16))
    try:
        gm = autopar.trace(tiny_gpt(), (spec, spec))
    except TraceError as err:
        assert_well_formed(err)
        assert "meta" in err.fix, str(err)
    else:
        assert graph_facts(gm).batch_size == 4


MODEL_FILE = """
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:
            return y * 2
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.gate(x).sum()


def make():
    return Net(), (torch.randn(4, 8),), {}
"""


def test_untraceable_model_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "user_model.py"
    path.write_text(MODEL_FILE)
    err = run_cli(["plan", f"{path}:make", "--cluster", "2xcpu"], capsys)
    assert "data-dependent control flow" in err
    line = [i for i, text in enumerate(MODEL_FILE.splitlines(), 1) if "if y.sum()" in text][0]
    assert "'gate'" in err and f"{path}:{line}" in err


# --- plans ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_plan() -> autopar.Plan:
    return autopar.plan(tiny_gpt(), "2xcpu", token_batch(), devices=2)


@pytest.fixture(scope="module")
def plan_file(tiny_plan: autopar.Plan, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    tiny_plan.save(path)
    return path


def test_plan_for_another_model(tiny_plan: autopar.Plan) -> None:
    other = autopar.trace(tiny_gpt(n_layer=3), token_batch())
    theirs = graph_facts(other).fingerprint
    ours = tiny_plan.model["fingerprint"]
    assert theirs != ours
    with pytest.raises(PlanError) as info:
        tiny_plan.check_model(theirs, "GPT-3-layers")
    err = info.value
    assert_well_formed(err)
    assert ours in err.what and theirs in err.what and "GPT-3-layers" in err.what
    assert "re-plan" in err.fix
    tiny_plan.check_model(ours)  # its own model passes


def _write_plan(tmp_path: Path, plan: autopar.Plan, **changes: object) -> Path:
    data = plan.to_dict()
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_with_another_schema_version(tiny_plan: autopar.Plan, tmp_path: Path) -> None:
    path = _write_plan(tmp_path, tiny_plan, schema_version=99)
    with pytest.raises(PlanError) as info:
        autopar.Plan.load(path)
    err = info.value
    assert_well_formed(err)
    assert str(path) in err.what
    version = tiny_plan.schema_version
    assert re.search(r"\b99\b", err.what) and re.search(rf"\b{version}\b", err.what)  # both
    assert "schema_version" in err.where and "re-plan" in err.fix


def test_plan_missing_a_field(tiny_plan: autopar.Plan, tmp_path: Path) -> None:
    path = _write_plan(tmp_path, tiny_plan, mesh=None)
    with pytest.raises(PlanError) as info:
        autopar.Plan.load(path)
    err = info.value
    assert_well_formed(err)
    assert "'mesh'" in err.what and str(path) in err.what
    assert err.where == "mesh"


def test_plan_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("mesh: {dp: 2}\n")
    with pytest.raises(PlanError) as info:
        autopar.Plan.load(path)
    err = info.value
    assert_well_formed(err)
    assert "not valid JSON" in err.what and str(path) in err.where
    assert re.search(r":1:1$", err.where)  # line and column


def test_missing_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as info:
        autopar.Plan.load(tmp_path / "nope.json")
    assert_well_formed(info.value)
    assert "not found" in info.value.what


def test_plan_errors_through_the_cli(
    tiny_plan: autopar.Plan, plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    versioned = _write_plan(tmp_path, tiny_plan, schema_version=99)
    err = run_cli(["emit", TINY_SPEC, "--cluster", "2xcpu", "--plan", str(versioned)], capsys)
    assert "schema version 99" in err and f"version {tiny_plan.schema_version}" in err

    err = run_cli(["emit", OTHER_SPEC, "--cluster", "2xcpu", "--plan", str(plan_file)], capsys)
    assert tiny_plan.model["fingerprint"] in err and "fingerprint" in err
    assert OTHER_SPEC in err  # names the model it was applied to


# --- no feasible plan, pinned degrees, runtime ---------------------------------------------

TINY_MEMORY = {"nodes": 1, "devices_per_node": 2, "device": {"preset": "cpu", "memory_gib": 0.0001}}


def test_model_that_fits_on_no_mesh() -> None:
    with pytest.raises(NoFeasiblePlanError) as info:
        autopar.plan(tiny_gpt(), TINY_MEMORY, token_batch())
    err = info.value
    assert_well_formed(err)
    for word in ("params", "grads", "optimizer", "activations", "more than", "per device"):
        assert word in err.what, word
    assert re.search(r"dp=\d+, tp=\d+", err.what)  # the mesh of the least-memory plan
    assert "more or larger devices" in err.fix


def test_model_that_fits_on_no_mesh_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text("nodes: 1\ndevices_per_node: 2\ndevice: {preset: cpu, memory_gib: 0.0001}\n")
    err = run_cli(["plan", TINY_SPEC, "--cluster", str(path)], capsys)
    assert "fits on no mesh" in err and "more than" in err and "activations" in err


def test_pinned_degrees_that_match_no_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(NoFeasiblePlanError) as info:
        autopar.plan(tiny_gpt(), "2xcpu", token_batch(), dp=3)
    err = info.value
    assert_well_formed(err)
    assert err.where == "dp"  # the pin that fails, not every degree
    assert "dp x tp" in err.fix
    err_text = run_cli(["plan", TINY_SPEC, "--cluster", "2xcpu", "--dp", "3"], capsys)
    assert "dp=3" in err_text


def test_world_size_mismatch(tiny_plan: autopar.Plan, monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.runtime.mesh import build_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert tiny_plan.world_size == 2
    with pytest.raises(RuntimeSetupError) as info:
        build_mesh(tiny_plan, "gloo")
    err = info.value
    assert_well_formed(err)
    assert re.search(r"\b2\b", err.what) and re.search(r"\b1\b", err.what)
    assert "torchrun --nproc-per-node 2" in err.fix


def test_pipeline_plan_world_size_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.runtime.mesh import build_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plan = autopar.plan(tiny_gpt(), "4xcpu", token_batch(), pp=2, microbatches=2)
    assert plan.mesh["pp"] == 2 and plan.world_size == 4
    with pytest.raises(RuntimeSetupError) as info:
        build_mesh(plan, "gloo")
    err = info.value
    assert_well_formed(err)
    assert re.search(r"\b4\b", err.what) and re.search(r"\b1\b", err.what) and "pp=2" in err.what
    assert "torchrun --nproc-per-node 4" in err.fix


# --- the command line ------------------------------------------------------------------------


def test_unknown_model_suggests(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["plan", "no-such-model", "--cluster", "2xcpu"], capsys)
    assert "unknown model 'no-such-model'" in err
    assert "llama3-70b" in err and "gpt:layers=" in err and ".py:" in err  # every form
    err = run_cli(["plan", "llama3-7b", "--cluster", "2xcpu"], capsys)
    assert "did you mean 'llama3-8b'" in err or "did you mean 'llama3-70b'" in err


def test_bad_spec_key_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(
        ["plan", "gpt:layers=x,hidden=32,heads=4,vocab=64,seq=16", "--cluster", "2xcpu"], capsys
    )
    assert "'layers'" in err and "'x'" in err and "integer" in err
    assert "required keys layers, hidden, heads, vocab, seq" in err
    err = run_cli(["plan", f"{TINY_SPEC},colour=1", "--cluster", "2xcpu"], capsys)
    assert "unknown key 'colour'" in err
    with pytest.raises(ModelSpecError):
        resolve_model(f"{TINY_SPEC},colour=1")


@pytest.fixture(scope="module")
def cli_plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan written by ``autopar plan SPEC --json``."""
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    assert main(["plan", TINY_SPEC, "--cluster", "2xcpu", "--devices", "2", "--json", str(path)]) == 0
    return path


def test_rank_out_of_range(cli_plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    err = run_cli(
        ["emit", TINY_SPEC, "--cluster", "2xcpu", "--rank", "99", "--plan", str(cli_plan_file)],
        capsys,
    )
    assert "rank 99" in err and "2 ranks" in err and "0 to 1" in err
    # also when emit solves the plan itself
    err = run_cli(["emit", TINY_SPEC, "--cluster", "2xcpu", "--devices", "2", "--rank", "99"], capsys)
    assert "rank 99" in err and "0 to 1" in err


def test_missing_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["plan", f"{tmp_path}/nope.py:make", "--cluster", "2xcpu"], capsys)
    assert "not found" in err
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(MODEL_FILE))
    err = run_cli(["plan", f"{path}:build_it", "--cluster", "2xcpu"], capsys)
    assert "no function 'build_it'" in err and "make" in err


def test_plan_from_the_api_applies_to_the_same_model_in_emit(
    plan_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No false alarm: ``tiny_plan`` was made with ``autopar.plan`` for exactly the model
    TINY_SPEC builds (on CPU, same batch); ``autopar emit TINY_SPEC --plan`` must accept it."""
    code = main(["emit", TINY_SPEC, "--cluster", "2xcpu", "--rank", "1", "--plan", str(plan_file)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "rank 1 of 2" in captured.out
