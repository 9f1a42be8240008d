"""Published, measured training throughput and memory rows (benchmarks/data/*.csv).

Each CSV holds the rows of one published source (a benchmark page, a performance summary, a
blog post), one run configuration per row, with the citation on every row. Column meanings
and the provenance of every file are in ``benchmarks/data/README.md``. The rows are for
comparing autopar's predictions with published measurements; never copy them into autopar.

    >>> rows = load("torchtitan_llama3_h100_202412")
    >>> r = rows[0]
    >>> (r["model"], r["gpus"], r["dp"], r["throughput_value"], r["throughput_unit"])
    ('llama3.1-8b', 8, 8, 5762.0, 'tokens/s/GPU')
    >>> r["memory_gib"], r["vpp"] is None
    (82.4, True)
    >>> "torchtitan_llama3_h100_202412" in sources()
    True
"""

from __future__ import annotations

import csv
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

#: Citation and identity columns that every row must fill.
REQUIRED = (
    "source", "table_or_figure", "page_or_section", "url", "hardware", "model", "scheme",
    "throughput_value", "throughput_unit",
)

INT_COLUMNS = (
    "gpus", "devices_per_node", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab",
    "seq_len", "global_batch", "local_batch", "micro_batch", "num_microbatches",
    "dp", "tp", "pp", "vpp", "cp", "ep",
)
FLOAT_COLUMNS = (
    "inter_node_gbps_per_gpu", "params_b", "throughput_value", "tflops_per_gpu", "mfu", "hfu",
    "memory_gib", "speedup_vs_baseline",
)

#: Allowed values of the enumerated columns ("" = not stated by the source).
CHOICES = {
    "throughput_unit": {"tokens/s/GPU", "TFLOPS/GPU", "MFU", "samples/s"},
    "recompute": {"", "none", "selective-op", "selective-layer", "full"},
    "compile": {"", "yes", "no"},
    "tp_comm_overlap": {"", "yes", "no"},
    "memory_kind": {"", "reserved", "active", "reserved_inferred", "unknown"},
}


class PublishedDataError(ValueError):
    """A CSV under benchmarks/data is malformed; the message names the file and the line."""


def sources() -> list[str]:
    """The names ``load`` accepts: the stems of benchmarks/data/*.csv, sorted."""
    return sorted(p.stem for p in DATA_DIR.glob("*.csv"))


def _path(source_name: str) -> Path:
    name = source_name[:-4] if source_name.endswith(".csv") else source_name
    path = DATA_DIR / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(
            f"no published data {name!r} in {DATA_DIR}; available: {', '.join(sources())}")
    return path


def _coerce(path: Path, line: int, column: str, text: str) -> int | float:
    kind = int if column in INT_COLUMNS else float
    try:
        return kind(text)
    except ValueError:
        raise PublishedDataError(
            f"{path.name} line {line}: column {column!r} is {text!r}, not {kind.__name__}"
        ) from None


def load(source_name: str) -> list[dict]:
    """The rows of benchmarks/data/<source_name>.csv as dicts.

    Empty cells become None; the columns in INT_COLUMNS and FLOAT_COLUMNS become int and
    float. Raises PublishedDataError naming the file and line when a header column is
    missing, a required cell is empty, a number does not parse, or an enumerated column
    holds a value outside CHOICES.
    """
    path = _path(source_name)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise PublishedDataError(f"{path.name} line 1: header lacks {', '.join(missing)}")
        rows = []
        for raw in reader:
            line = reader.line_num
            if None in raw:
                raise PublishedDataError(f"{path.name} line {line}: more cells than header columns")
            row: dict = {}
            for column, text in raw.items():
                if text is None:
                    raise PublishedDataError(f"{path.name} line {line}: too few cells")
                text = text.strip()
                if column in CHOICES and text not in CHOICES[column]:
                    raise PublishedDataError(
                        f"{path.name} line {line}: column {column!r} is {text!r}, "
                        f"expected one of {sorted(CHOICES[column])}")
                if text == "":
                    row[column] = None
                elif column in INT_COLUMNS or column in FLOAT_COLUMNS:
                    row[column] = _coerce(path, line, column, text)
                else:
                    row[column] = text
            empty = [c for c in REQUIRED if row.get(c) is None]
            if empty:
                raise PublishedDataError(
                    f"{path.name} line {line}: required column(s) empty: {', '.join(empty)}")
            row["_file"], row["_line"] = path.name, line
            rows.append(row)
    return rows


def baseline_of(row: dict, rows: list[dict]) -> dict | None:
    """The row that ``row`` is compared against in its source, or None.

    A comparison is a row whose ``baseline_scheme`` names the scheme of another row of the
    same table with the same model, GPU count and sequence length (for ranking checks:
    vanilla vs async TP, 1F1B vs interleaved, compile vs eager, with vs without CP).
    Raises PublishedDataError when the match is ambiguous.
    """
    want = row.get("baseline_scheme")
    if not want:
        return None
    keys = ("table_or_figure", "model", "gpus", "seq_len")
    found = [r for r in rows if r is not row and r["scheme"] == want
             and all(r.get(k) == row.get(k) for k in keys)]
    if len(found) > 1:
        raise PublishedDataError(
            f"{row['_file']} line {row['_line']}: baseline {want!r} matches {len(found)} rows")
    return found[0] if found else None
