"""Property-based fuzzing of the plan loader: arbitrary JSON, mutated real plans, arbitrary
bytes. Only a PlanError (an AutoparError) or a valid Plan may come out, and a plan that loads
satisfies the cross-field rules, round-trips, and can be summarized.

Each property runs 10,000 examples, the same ones every run (tests/fuzzing.py)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import autopar
from autopar.cli.emit_cmd import rank_coords
from autopar.cli.load import trace_model
from autopar.core.errors import AutoparError
from autopar.core.plan import Plan
from autopar.core.plan_schema import CROSS_FIELD_RULES
from autopar.core.plan_summary import format_plan
from tests.fuzzing import FUZZ

pytestmark = pytest.mark.slow

SPEC = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16,batch=8"


def _trimmed(plan: Plan) -> dict:
    """The plan as JSON data, with its per-node maps cut to a few entries (each entry kind
    is kept, and a smaller plan is faster to mutate and check)."""
    data = json.loads(plan.to_json())
    for key in ("strategies", "params"):
        data[key] = dict(list(data[key].items())[:3])
    data["solver"]["candidates"] = data["solver"]["candidates"][:2]
    return data


@pytest.fixture(scope="module")
def bases() -> list[dict]:
    gm = trace_model(SPEC, None, None).gm
    return [
        _trimmed(autopar.plan(gm, "2xcpu", global_batch=8, dp=2, time_limit_s=5)),
        _trimmed(autopar.plan(gm, "4xcpu", global_batch=8, pp=2, dp=2, microbatches=2,
                              schedule="zb_v", time_limit_s=5)),
    ]


def _check_loaded(plan: Plan) -> None:
    """What every loaded plan must satisfy (restated, not only the schema's own rules)."""
    data = plan.to_dict()
    for rule in CROSS_FIELD_RULES:
        rule(data)
    assert math.prod(plan.mesh.values()) == plan.world_size == plan.cluster["devices"]
    b = plan.batch
    assert b["global"] == plan.mesh["dp"] * b["microbatch"] * b["microbatches"]
    pp = plan.mesh.get("pp", 1)
    if pp > 1:
        chunks = plan.pipeline["chunks"]
        assert len(chunks) == pp * plan.pipeline["virtual_stages"]
        assert [c["layers"][0] for c in chunks] == [0] + [c["layers"][1] + 1 for c in chunks[:-1]]
    for name, axes in plan.strategies.items():
        for axis in axes:
            plan.strategy(name, axis)
    for fqn, axes in plan.params.items():
        for axis in axes:
            plan.param_placement(fqn, axis)
    assert Plan.from_json(plan.to_json()) == plan
    format_plan(plan, "fuzz")
    rank_coords(plan, plan.world_size - 1)


def _load(load: Any, value: Any) -> None:
    try:
        plan = load(value)
    except AutoparError as e:
        assert e.what and e.where and e.fix
        event(f"refused: {e.where.split('[')[0].split('.')[0]}")
        return
    event("loaded")
    _check_loaded(plan)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=3),
    max_leaves=4,
)
numbers = (st.integers() | st.floats() | st.integers(-3, 10)
           | st.sampled_from([0, -1, 2**53 + 1, 10**30, -0.0, 1e308, math.nan, math.inf]))


TOP_KEYS = ("model", "cluster", "mesh", "batch", "training", "strategies", "params",
            "predicted", "solver", "pipeline", "layers", "attention", "unruled_ops")
plan_shaped = st.fixed_dictionaries(
    {"schema_version": st.just(2) | json_values},
    optional=dict.fromkeys(TOP_KEYS, json_values))


@FUZZ
@given(value=json_values | plan_shaped)
def test_arbitrary_json_values(value: Any) -> None:
    _load(Plan.from_dict, value)
    _load(Plan.from_json, json.dumps(value))


def _retype(value: Any) -> Any:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return str(value)
    return 0


def _mutate(data: st.DataObject, plan: Any) -> None:
    """Drop, replace, retype, renumber or add one key at some depth of ``plan``."""
    parent, key = None, None
    node = plan
    while isinstance(node, (dict, list)) and node and (parent is None
                                                       or data.draw(st.booleans())):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, data.draw(st.sampled_from(keys))
        node = node[key]
    if parent is None:
        return
    op = data.draw(st.sampled_from(["drop", "replace", "retype", "number", "nudge", "add"]))
    if op == "drop":
        del parent[key]
    elif op == "replace":
        parent[key] = data.draw(json_values)
    elif op == "retype":
        parent[key] = _retype(node)
    elif op == "number":
        parent[key] = data.draw(numbers)
    elif op == "nudge" and isinstance(node, int) and not isinstance(node, bool):
        parent[key] = node + data.draw(st.integers(-3, 3))
    elif op == "add" and isinstance(node, dict):
        node[data.draw(st.text(max_size=8))] = data.draw(json_values)
    else:
        parent[key] = data.draw(numbers)


@FUZZ
@given(data=st.data())
def test_mutated_real_plans(bases: list[dict], data: st.DataObject) -> None:
    plan = copy.deepcopy(data.draw(st.sampled_from(bases)))
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate(data, plan)
    _load(Plan.from_dict, plan)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "plan.json"


@pytest.fixture(scope="module")
def texts(bases: list[dict]) -> list[bytes]:
    return [json.dumps(base).encode() for base in bases]


@FUZZ
@given(data=st.data())
def test_arbitrary_bytes_as_a_file(texts: list[bytes], plan_file: Path,
                                   data: st.DataObject) -> None:
    """Random bytes, or a real plan's JSON text with bytes overwritten."""
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=200))
    else:
        edited = bytearray(data.draw(st.sampled_from(texts)))
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(edited) - 1))
            edited[at:at + 1] = data.draw(st.binary(max_size=3))
        raw = bytes(edited)
    plan_file.write_bytes(raw)
    _load(Plan.load, plan_file)
