"""Bad plan files: every hand edit or broken file is a PlanError naming the field, from
``Plan.from_dict``/``Plan.load`` and from ``autopar emit --plan`` (exit 2, no traceback)."""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

import autopar
from autopar.cli.load import trace_model
from autopar.cli.main import main
from autopar.core.errors import PlanError
from autopar.core.plan import Plan
from tests.test_errors import assert_well_formed, run_cli

SPEC = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16,batch=8"
DROP = object()  # edit value: delete the key


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    """A data-parallel plan on 2 devices and an interleaved pipeline on 4, as JSON data."""
    gm = trace_model(SPEC, None, None).gm
    dp = autopar.plan(gm, "2xcpu", global_batch=8, dp=2, time_limit_s=5)
    pp = autopar.plan(gm, "4xcpu", global_batch=8, pp=2, dp=2, microbatches=2,
                      schedule="interleaved", virtual_stages=2, time_limit_s=5)
    assert dp.batch == {"global": 8, "microbatch": 4, "microbatches": 1, "seq": 16, "traced": 8}
    assert pp.pipeline["virtual_stages"] == 2 and len(pp.pipeline["chunks"]) == 4
    return {"dp": json.loads(dp.to_json()), "pp": json.loads(pp.to_json())}


def _keys(data: dict, path: str) -> list[str | int]:
    """``"batch.microbatch"`` / ``"pipeline.chunks[2].layers"`` as keys; ``{node}`` and
    ``{param}`` stand for the plan's first node and parameter (their names have dots)."""
    names = {"{node}": next(iter(data["strategies"])), "{param}": next(iter(data["params"]))}
    keys: list[str | int] = []
    for name, index in re.findall(r"(\{\w+\}|[^.\[\]]+)|\[(\d+)\]", path):
        keys.append(int(index) if index else names.get(name, name))
    return keys


def _where(data: dict, path: str) -> str:
    return path.format(node=next(iter(data["strategies"])), param=next(iter(data["params"])))


def _edit(data: dict, path: str, value: Any) -> dict:
    *parents, last = _keys(data, path)
    target = data
    for key in parents:
        target = target[key]
    if value is DROP:
        del target[last]
    else:
        target[last] = value
    return data


# (id, base plan, field path, new value or DROP, the field ``where`` names when not the path)
EDITS: list[tuple[str, str, str, Any, str | None]] = [
    # the examples
    ("mesh-edited-to-15-ranks", "dp", "mesh.dp", 15, "mesh"),
    ("microbatch-3-for-batch-8", "dp", "batch.microbatch", 3, None),
    ("zero-stage-5", "dp", "training.zero", 5, None),
    ("offload-without-zero3", "dp", "training.offload", "optimizer+params", None),
    ("offload-unknown", "dp", "training.offload", "optimizer", None),
    ("missing-microbatch", "dp", "batch.microbatch", DROP, None),
    ("string-for-a-number", "dp", "batch.global", "8", None),
    ("negative-tp", "dp", "mesh.tp", -1, None),
    ("nan-step-time", "dp", "predicted.step_time_s", math.nan, None),
    ("infinite-seq", "dp", "batch.seq", math.inf, None),
    ("huge-batch", "dp", "batch.global", 10**30, None),
    ("unknown-top-field", "dp", "extra", {"a": 1}, None),
    ("unknown-batch-field", "dp", "batch.tokens", 8, None),
    ("schema-version-1", "dp", "schema_version", 1, None),
    ("schema-version-as-text", "dp", "schema_version", "2", None),
    ("schema-version-missing", "dp", "schema_version", DROP, None),
    ("schema-version-as-float", "dp", "schema_version", 2.0, None),
    # mesh
    ("mesh-cp-axis-out-of-order", "dp", "mesh.cp", 1, "mesh"),
    ("mesh-missing-dp", "dp", "mesh.dp", DROP, None),
    ("mesh-float-size", "dp", "mesh.dp", 2.0, None),
    ("mesh-bool-size", "dp", "mesh.tp", True, None),
    ("mesh-as-list", "dp", "mesh", [2, 1], None),
    ("mesh-zero-size", "dp", "mesh.tp", 0, None),
    # cluster
    ("cluster-devices-wrong", "dp", "cluster.devices", 3, None),
    ("cluster-zero-nodes", "dp", "cluster.nodes", 0, None),
    ("cluster-unknown-backend", "dp", "cluster.backend", "mpi", None),
    ("cluster-negative-memory", "dp", "cluster.device.memory_bytes", -1, None),
    ("cluster-profile-file", "dp", "cluster.profile", "profile.json", None),
    ("cluster-missing-device-name", "dp", "cluster.device.name", DROP, None),
    # batch
    ("zero-microbatches", "dp", "batch.microbatches", 0, None),
    ("global-not-divisible-by-dp", "dp", "batch.global", 7, None),
    ("microbatches-do-not-multiply", "dp", "batch.microbatches", 2, None),
    ("traced-negative", "dp", "batch.traced", -8, None),
    # training
    ("precision-fp64", "dp", "training.precision", "fp64", None),
    ("optimizer-lion", "dp", "training.optimizer", "lion", None),
    ("recompute-some", "dp", "training.recompute", "some", None),
    ("training-missing", "dp", "training", DROP, None),
    ("zero-as-bool", "dp", "training.zero", False, None),
    ("zero-as-float", "dp", "training.zero", 3.0, None),
    # strategies and parameter placements
    ("shard-of-negative-dim", "dp", "strategies.{node}.tp.out[0]", "S(-1)", None),
    ("strategy-inputs-as-text", "dp", "strategies.{node}.tp.in", "R", None),
    ("strategy-missing-tp", "dp", "strategies.{node}.tp", DROP, None),
    ("strategy-unknown-impl", "dp", "strategies.{node}.tp.impl", "os.system", None),
    ("strategy-unknown-axis", "dp", "strategies.{node}.pp", {"in": [], "out": ["R"]}, None),
    ("param-placement-number", "dp", "params.{param}.tp", 3, None),
    ("param-placement-zero-groups", "dp", "params.{param}.tp", "S(0)g0", None),
    ("param-placement-unknown", "dp", "params.{param}.dp", "X", None),
    # model, predictions, reports
    ("empty-fingerprint", "dp", "model.fingerprint", "", None),
    ("trainable-over-params", "dp", "model.trainable_params", 10**9, None),
    ("negative-peak-memory", "dp", "predicted.peak_memory_bytes", -5, None),
    ("memory-without-total", "dp", "predicted.memory.total", DROP, None),
    ("candidates-as-object", "dp", "solver.candidates", {}, None),
    ("attention-fused-as-text", "dp", "attention[0].fused", "yes", None),
    ("unruled-count-zero", "dp", "unruled_ops", {"aten.foo": 0}, "unruled_ops.aten.foo"),
    ("layers-as-object", "dp", "layers", {}, None),
    ("pipeline-without-pp", "pp", "mesh", {"dp": 2, "tp": 2}, "pipeline"),
    ("lone-surrogate-name", "dp", "model.name", "\ud800", None),
    # pipelines
    ("chunk-layers-gap", "pp", "pipeline.chunks[2].layers", [3, 3], None),
    ("chunk-layers-backwards", "pp", "pipeline.chunks[3].layers", [3, 2], None),
    ("chunk-layers-one-number", "pp", "pipeline.chunks[0].layers", [0], None),
    ("chunk-on-wrong-rank", "pp", "pipeline.chunks[1].rank", 0, None),
    ("chunk-missing", "pp", "pipeline.chunks[3]", DROP, "pipeline.chunks"),
    ("virtual-stages-3-for-4-chunks", "pp", "pipeline.virtual_stages", 3, "pipeline.chunks"),
    ("gpipe-with-2-chunks-per-rank", "pp", "pipeline.schedule", "gpipe",
     "pipeline.virtual_stages"),
    ("old-schedule-spelling", "pp", "pipeline.schedule", "zero-bubble", None),
    ("pipeline-microbatches-differ", "pp", "pipeline.microbatches", 1, None),
    ("pipeline-missing-with-pp", "pp", "pipeline", DROP, None),
    ("stages-missing-a-rank", "pp", "pipeline.stages[1]", DROP, "pipeline.stages"),
    ("bubble-fraction-over-1", "pp", "pipeline.bubble_fraction", 1.5, None),
    ("mesh-reordered", "pp", "mesh", {"dp": 2, "pp": 2, "tp": 1}, None),
]


@pytest.mark.parametrize("name, base, path, value, where", EDITS, ids=[e[0] for e in EDITS])
def test_hand_edit_is_refused(plans: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              name: str, base: str, path: str, value: Any,
                              where: str | None) -> None:
    data = _edit(json.loads(json.dumps(plans[base])), path, value)
    where = _where(data, where or path)
    with pytest.raises(PlanError) as info:
        Plan.from_dict(data)
    assert_well_formed(info.value)
    assert info.value.where == where, (info.value.where, str(info.value))

    file = tmp_path / "edited.json"
    file.write_text(json.dumps(data))  # NaN and Infinity as JSON writes them
    with pytest.raises(PlanError) as info:
        Plan.load(file)
    assert info.value.where == where and str(file) in info.value.what
    err = run_cli(["emit", SPEC, "--cluster", "2xcpu", "--plan", str(file)], capsys)
    assert f"where: {where}\n" in err


def _pickled(_: dict) -> bytes:
    return pickle.dumps({"schema_version": 2})


# (id, the file's bytes from the dp plan, words the message has)
FILES: list[tuple[str, Any, str]] = [
    ("binary", lambda d: bytes(range(256)) * 4, "not UTF-8"),
    ("pickle", _pickled, "pickle"),
    ("empty", lambda d: b"", "is empty"),
    ("whitespace-only", lambda d: b" \n\t\n", "is empty"),
    ("json-array", lambda d: b"[1, 2]", "JSON object"),
    ("json-null", lambda d: b"null", "JSON object"),
    ("json-string", lambda d: b'"plan"', "JSON object"),
    ("truncated", lambda d: json.dumps(d).encode()[:500], "not valid JSON"),
    ("yaml-not-json", lambda d: b"mesh: {dp: 2}\n", "not valid JSON"),
    ("duplicate-key", lambda d: json.dumps(d)[:-1].encode() + b', "mesh": {"dp": 2}}',
     "twice"),
    ("digits-beyond-python-limit", lambda d: b'{"schema_version": ' + b"9" * 5000 + b"}",
     "cannot be read"),
    ("nested-too-deep", lambda d: b"[" * 100_000 + b"]" * 100_000, "cannot be read"),
]


@pytest.mark.parametrize("name, content, words", FILES, ids=[f[0] for f in FILES])
def test_broken_plan_file_is_refused(plans: dict, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str], name: str,
                                     content: Any, words: str) -> None:
    file = tmp_path / "plan.json"
    file.write_bytes(content(plans["dp"]))
    with pytest.raises(PlanError) as info:
        Plan.load(file)
    assert_well_formed(info.value)
    assert words in info.value.what and str(file) in info.value.what + info.value.where
    err = run_cli(["emit", SPEC, "--cluster", "2xcpu", "--plan", str(file)], capsys)
    assert words in err


@pytest.mark.parametrize("name", ["directory", "missing"])
def test_plan_path_that_is_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   name: str) -> None:
    path = tmp_path if name == "directory" else tmp_path / "nope.json"
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert_well_formed(info.value)
    assert info.value.where == str(path)
    err = run_cli(["emit", SPEC, "--cluster", "2xcpu", "--plan", str(path)], capsys)
    assert f"where: {path}\n" in err


def test_the_cases_are_distinct() -> None:
    assert len({(b, p, repr(v)) for _, b, p, v, _ in EDITS}) == len(EDITS)
    assert len(EDITS) + len(FILES) + 2 >= 40


# --- emit --plan: flags that would change the plan ------------------------------------------

FLAGS = [["--tp", "2"], ["--dp", "1"], ["--pp", "2"], ["--seq", "32"], ["--global-batch", "16"],
         ["--microbatch", "2"], ["--microbatches", "2"], ["--schedule", "1f1b"],
         ["--virtual-stages", "2"], ["--precision", "bf16"], ["--zero", "3"],
         ["--recompute", "full"], ["--optimizer", "sgd"], ["--no-fuse-attention"],
         ["--time-limit", "3"]]


@pytest.fixture(scope="module")
def dp_plan_file(plans: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("plans") / "dp.json"
    file.write_text(json.dumps(plans["dp"]))
    return file


@pytest.mark.parametrize("flag", FLAGS, ids=[f[0] for f in FLAGS])
def test_emit_refuses_a_flag_that_would_change_the_plan(
        dp_plan_file: Path, capsys: pytest.CaptureFixture[str], flag: list[str]) -> None:
    err = run_cli(["emit", SPEC, "--cluster", "2xcpu", "--plan", str(dp_plan_file), *flag],
                  capsys)
    assert f"where: {flag[0]}\n" in err and "disagrees with the plan" in err


@pytest.mark.parametrize("cluster", ["4xcpu", "2x1xcpu", "2xH100-80GB"])
def test_emit_refuses_another_cluster(dp_plan_file: Path, capsys: pytest.CaptureFixture[str],
                                      cluster: str) -> None:
    err = run_cli(["emit", SPEC, "--cluster", cluster, "--plan", str(dp_plan_file)], capsys)
    assert "where: cluster\n" in err and "'2xcpu'" in err and f"'{cluster}'" in err


def test_emit_accepts_flags_that_agree_with_the_plan(
        dp_plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["emit", SPEC, "--cluster", "2xcpu", "--plan", str(dp_plan_file), "--seq", "16",
            "--global-batch", "8", "--dp", "2", "--tp", "1", "--zero", "0", "--precision", "fp32"]
    assert main(argv) == 0
    assert "def forward" in capsys.readouterr().out
