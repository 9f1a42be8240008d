"""Reading the text files users hand autopar (cluster descriptions, profiles) so that every
way a file can be wrong is a ClusterError: missing, a directory, binary (a pickle, a zip),
malformed, a key given twice (which YAML and JSON parsers otherwise accept, keeping the
last), or nested too deeply to parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autopar.core import json_data
from autopar.core.errors import ClusterError


def read_text(path: Path, what: str, fix_missing: str) -> str:
    """The file's text; ``what`` names it in errors ("cluster file", "profile")."""
    shown = str(path)
    if "\x00" in shown:
        raise ClusterError(f"{what} path {shown!r} holds a NUL byte, which no file name can",
                           where=repr(shown), fix="check the path")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClusterError(f"{what} '{shown}' not found", where=shown, fix=fix_missing) from None
    except UnicodeDecodeError as err:
        raise ClusterError(
            f"{what} '{shown}' is binary, not text (byte 0x{err.object[err.start]:02x} at "
            f"offset {err.start} is not UTF-8); a pickle or a compressed file, perhaps",
            where=shown,
            fix="pass a YAML or JSON text file (`autopar cluster show 8xH100-80GB` shows the "
            "fields)",
        ) from None
    except OSError as err:
        problem = "is a directory" if path.is_dir() else f"cannot be read: {err.strerror or err}"
        raise ClusterError(f"{what} '{shown}' {problem}", where=shown,
                           fix="pass a readable file") from None


def parse_json(text: str, what: str, shown: str, example: str) -> Any:
    """JSON with unique keys; ``what`` and ``shown`` name the file ("profile", "p.json"),
    ``example`` says what it should hold."""
    desc = f"{what} '{shown}'"
    try:
        return json_data.loads(text)
    except json_data.DuplicateKey as err:
        raise ClusterError(f"{desc} is not valid JSON: key '{err.key}' is given twice", where=shown,
                           fix="keep one of the two; a JSON object's keys are unique") from None
    except RecursionError:
        raise too_deep(desc, shown) from None
    except json.JSONDecodeError as err:
        raise ClusterError(
            f"{desc} is not valid JSON: {err.msg}",
            where=f"{shown}, line {err.lineno}, column {err.colno}",
            fix=f"fix the JSON syntax there; the file is {example}",
        ) from None


def too_deep(desc: str, shown: str) -> ClusterError:
    return ClusterError(
        f"{desc} is nested too deeply to be a cluster description",
        where=shown,
        fix="write a mapping such as 'nodes: 2', 'devices_per_node: 8', "
        "'device: {preset: H100-80GB}'",
    )


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # unhashable: SafeLoader reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
        return super().construct_mapping(node, deep)
