"""benchmarks/data/*.csv: every row cited, every number parses, the published configs add up."""

from __future__ import annotations

import csv
import doctest
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "published_data", ROOT / "benchmarks" / "published_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pd = _module()
SOURCES = pd.sources()
CITATION = ("source", "table_or_figure", "page_or_section", "url")


def test_there_is_data() -> None:
    assert len(SOURCES) >= 3
    readme = (pd.DATA_DIR / "README.md").read_text()
    for name in SOURCES:
        assert f"{name}.csv" in readme, f"{name}.csv is not described in benchmarks/data/README.md"


@pytest.mark.parametrize("name", SOURCES)
def test_rows_cited_and_numeric(name: str) -> None:
    rows = pd.load(name)
    assert rows, f"{name}.csv has no rows"
    for r in rows:
        where = f"{name}.csv line {r['_line']}"
        for column in CITATION:
            assert r[column], f"{where}: no {column}"
        assert r["url"].startswith("http"), f"{where}: url {r['url']!r}"
        assert r["throughput_value"] > 0, where
        for column in pd.INT_COLUMNS:
            assert r.get(column) is None or r[column] > 0, f"{where}: {column}={r[column]}"
        for column in ("mfu", "hfu"):
            assert r.get(column) is None or 0 < r[column] < 1, f"{where}: {column}={r[column]}"
        if r["throughput_unit"] == "MFU":
            assert r["throughput_value"] < 1, f"{where}: MFU is a fraction"


@pytest.mark.parametrize("name", SOURCES)
def test_published_configs_add_up(name: str) -> None:
    """dp*tp*pp*cp = GPUs and dp*local = global where all are given, unless flagged."""
    for r in pd.load(name):
        where = f"{name}.csv line {r['_line']}"
        flagged = "SOURCE INCONSISTENCY" in (r.get("notes") or "")
        degrees = [r.get(k) for k in ("dp", "tp", "pp", "cp")]
        if r.get("gpus") and all(degrees) and not flagged:
            product = degrees[0] * degrees[1] * degrees[2] * degrees[3]
            assert product == r["gpus"], f"{where}: dp*tp*pp*cp={product} != gpus={r['gpus']}"
        if r.get("dp") and r.get("local_batch") and r.get("global_batch") and (r.get("cp") or 1) == 1:
            assert r["dp"] * r["local_batch"] == r["global_batch"], where


@pytest.mark.parametrize("name", SOURCES)
def test_comparisons_resolve(name: str) -> None:
    """A baseline named without a printed speedup must be a row of the same table."""
    rows = pd.load(name)
    for r in rows:
        if r.get("baseline_scheme") and r.get("speedup_vs_baseline") is None:
            base = pd.baseline_of(r, rows)
            assert base is not None, f"{name}.csv line {r['_line']}: no row {r['baseline_scheme']!r}"


def test_loader_names_file_and_line(tmp_path, monkeypatch) -> None:
    good = pd.load(SOURCES[0])[0]
    header = [k for k in good if not k.startswith("_")]
    monkeypatch.setattr(pd, "DATA_DIR", tmp_path)

    def write(name: str, changes: dict, columns=header) -> None:
        with (tmp_path / f"{name}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerow({k: "" if v is None else v for k, v in {**good, **changes}.items()})

    write("no_url", {"url": ""})
    with pytest.raises(pd.PublishedDataError, match=r"no_url\.csv line 2: .*url"):
        pd.load("no_url")
    write("bad_number", {"gpus": "eight"})
    with pytest.raises(pd.PublishedDataError, match=r"bad_number\.csv line 2: column 'gpus'"):
        pd.load("bad_number")
    write("bad_unit", {"throughput_unit": "tok/s"})
    with pytest.raises(pd.PublishedDataError, match=r"bad_unit\.csv line 2: column 'throughput_unit'"):
        pd.load("bad_unit")
    write("no_column", {}, columns=[c for c in header if c != "source"])
    with pytest.raises(pd.PublishedDataError, match=r"no_column\.csv line 1: header lacks source"):
        pd.load("no_column")
    with pytest.raises(FileNotFoundError, match="available"):
        pd.load("does_not_exist")


def test_docstring_examples() -> None:
    result = doctest.testmod(pd, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and result.failed == 0
