"""Property-based fuzzing of what users type and write: model specs, cluster shorthands,
cluster YAML/JSON documents and files of arbitrary bytes. Whatever comes in, the parsers
return a valid result or raise an ``AutoparError``; nothing else (no ``ValueError``,
``OverflowError``, ``RecursionError``, ``UnicodeDecodeError`` ...) may escape.

Only parsing and validation run: a spec that resolves is checked with ``example_inputs`` on
the meta device, never built or traced.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from autopar.core.cluster import Cluster, load_cluster
from autopar.core.cluster.presets import PRESETS
from autopar.core.errors import AutoparError
from autopar.models import ModelSpec, resolve_model
from tests.fuzzing import FUZZ

pytestmark = pytest.mark.slow


# --- values a user might type where a number belongs ------------------------------------------

NUMBER_TEXT = st.one_of(
    st.integers(min_value=-10, max_value=10**6).map(str),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "0", "-0", "00", "1_000", "1e3", "1e999", "-1e999", "nan", "inf",
                     "0x10", "0b1", "٣", "１", "²", "1.", ".5", "+4", "4 4", "true", "None",
                     "9" * 5000, "1" + "0" * 30]),
    st.text(max_size=8),
)

SPEC_KEYS = ["layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "dropout",
             "bias", "tie", "math_attention", "rope_theta", "experts", "top_k", "Layers",
             " hidden", "colour", "", "layers "]
SMALL_SIZES = {"layers": "2", "hidden": "32", "heads": "4", "kv_heads": "2", "ffn": "64",
               "vocab": "64", "seq": "16"}


def _check_resolves_or_explains(text: str, batch: int, seq: int) -> None:
    try:
        spec = resolve_model(text)
    except AutoparError as err:
        assert err.what and err.where and err.fix
        return
    assert isinstance(spec, ModelSpec)
    try:
        spec.example_inputs(batch, seq, device="meta")
    except AutoparError:
        pass


@FUZZ
@given(text=st.text(max_size=60), batch=st.integers(-5, 2**40), seq=st.integers(-5, 2**40))
def test_model_spec_parser_on_arbitrary_text(text: str, batch: int, seq: int) -> None:
    _check_resolves_or_explains(text, batch, seq)


@st.composite
def near_valid_specs(draw: st.DrawFn) -> str:
    """A family, mostly valid sizes, and a few keys changed, dropped, doubled or mangled."""
    family = draw(st.sampled_from(["gpt", "gpt2hf", "llama", "mixtral", "GPT", " llama ", "gtp"]))
    items = dict(SMALL_SIZES)
    for key in draw(st.lists(st.sampled_from(SPEC_KEYS), max_size=4)):
        items[key] = draw(NUMBER_TEXT)
    for key in draw(st.lists(st.sampled_from(list(items)), max_size=2)):
        items.pop(key, None)
    parts = [f"{k}={v}" for k, v in items.items()]
    if draw(st.booleans()):
        parts.append(draw(st.sampled_from(["layers=3", "layers", "=", ",", "x=y=z", " "])))
    parts = draw(st.permutations(parts))
    separator = draw(st.sampled_from([",", ", ", ";", ",,"]))
    return f"{family}:{separator.join(parts)}"


@FUZZ
@given(text=near_valid_specs(), batch=st.integers(1, 2**22), seq=st.integers(1, 2**22))
def test_model_spec_parser_on_near_valid_specs(text: str, batch: int, seq: int) -> None:
    _check_resolves_or_explains(text, batch, seq)


# --- cluster shorthands -------------------------------------------------------------------

PRESET_NAMES = sorted(PRESETS) + ["h100-80gb", "H100", "cpu ", "CPU", "x", "H1000", ""]


@st.composite
def shorthands(draw: st.DrawFn) -> str:
    counts = draw(st.lists(st.one_of(st.integers(0, 2**12), st.integers(0, 10**25),
                                     st.sampled_from(["", "-1", "08", "１", "1.5"])).map(str),
                           max_size=3))
    name = draw(st.one_of(st.sampled_from(PRESET_NAMES), st.text(max_size=10)))
    joiner = draw(st.sampled_from(["x", "X", "×", "*", " x "]))
    return joiner.join([*counts, name])


def _check_cluster(spec: object) -> None:
    try:
        cluster = load_cluster(spec)
    except AutoparError as err:
        assert err.what and err.where and err.fix
    else:
        assert isinstance(cluster, Cluster) and cluster.world_size >= 1


@FUZZ
@given(text=st.one_of(shorthands(), st.text(max_size=30)))
def test_cluster_shorthand(text: str) -> None:
    _check_cluster(text)


# --- cluster documents ----------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["cpu", "H100-80GB", "gloo", "nccl", "1e12", "fp32", "bf16"]),
)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), inner,
                                            max_size=5)),
    max_leaves=20,
)
DEVICE_KEYS = ["preset", "name", "memory_gib", "memory_bytes", "memory_bandwidth_gb_per_s",
               "memory_bandwidth_bytes_per_s", "matmul_efficiency", "kernel_floor_us",
               "kernel_floor_s", "allocation_ns_per_byte", "memory_efficiency", "peak_tflops",
               "peak_flops", "matmul_efficiency_curve", "memroy_gib"]
LINK_KEYS = ["bandwidth_gb_per_s", "bandwidth_bytes_per_s", "latency_us", "latency_s", "lat"]
TOP_KEYS = ["name", "nodes", "devices_per_node", "backend", "profile", "device",
            "intra_node_link", "inter_node_link", "sources", "node"]


@st.composite
def near_valid_clusters(draw: st.DrawFn) -> dict:
    """A valid description (preset-based) with some values replaced by odd ones, some keys
    dropped and some misspelt keys added."""
    data: dict = {"nodes": 2, "devices_per_node": 4,
                  "device": {"preset": draw(st.sampled_from(PRESET_NAMES))},
                  "intra_node_link": {"bandwidth_gb_per_s": 100.0, "latency_us": 3.0},
                  "inter_node_link": {"bandwidth_gb_per_s": 25.0, "latency_us": 10.0}}
    value = st.one_of(SCALARS, DOCUMENTS)
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=3)):
        data[key] = draw(value)
    for section, keys in (("device", DEVICE_KEYS), ("intra_node_link", LINK_KEYS),
                          ("inter_node_link", LINK_KEYS)):
        if isinstance(data.get(section), dict):
            for key in draw(st.lists(st.sampled_from(keys), max_size=3)):
                data[section][key] = draw(st.one_of(value, st.dictionaries(
                    st.sampled_from(["fp32", "bf16", "fp8", "fp64"]), SCALARS, max_size=3)))
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=2)):
        data.pop(key, None)
    return data


@FUZZ
@given(document=st.one_of(DOCUMENTS, near_valid_clusters()))
def test_cluster_dicts(document: object) -> None:
    _check_cluster(document if isinstance(document, dict) else {"device": document})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _dump(document: object, suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(document, default=str)
    return yaml.safe_dump(document, allow_unicode=True)


@FUZZ
@given(document=st.one_of(DOCUMENTS, near_valid_clusters()),
       suffix=st.sampled_from([".yaml", ".yml", ".json"]))
def test_cluster_files(folder: Path, document: object, suffix: str) -> None:
    try:
        text = _dump(document, suffix)
    except (ValueError, OverflowError, yaml.YAMLError):
        return  # not representable in that format
    path = folder / f"cluster{suffix}"
    path.write_text(text, encoding="utf-8")
    _check_cluster(path)


@FUZZ
@given(content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
       suffix=st.sampled_from([".yaml", ".json"]))
def test_cluster_files_of_arbitrary_bytes(folder: Path, content: bytes, suffix: str) -> None:
    path = folder / f"bytes{suffix}"
    path.write_bytes(content)
    _check_cluster(str(path))
