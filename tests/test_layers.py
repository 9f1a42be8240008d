"""Imports go down the layer table of docs/design.md, never up, and no two folders import
each other in a circle: every import counts, at a module's top and inside its functions
(``if TYPE_CHECKING:`` blocks aside, since they never run)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package (pyproject.toml's package-dir)
SOURCES = {"autopar": "autopar", "passes": "autopar.passes", "kernels": "autopar.kernels",
           "cost_models": "autopar.cost_models"}
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`\s*\|")


def layer_table() -> dict[str, int]:
    """``{package: rank}`` from docs/design.md's table between its layer markers."""
    text = (ROOT / "docs" / "design.md").read_text()
    body = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    rows = {m.group(2): int(m.group(1)) for line in body.splitlines()
            if (m := _ROW.match(line.strip()))}
    assert rows, "docs/design.md has no layer rows between <!-- layers --> and <!-- /layers -->"
    return rows


@functools.cache
def source_modules() -> dict[str, Path]:
    found = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Every autopar module ``name`` imports, with the line of the first such import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: dict[str, int] = {}

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    named.setdefault(alias.name, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                for alias in child.names:
                    whole = f"{base}.{alias.name}"
                    named.setdefault(whole if whole in modules else base, child.lineno)
            visit(child)

    visit(ast.parse(path.read_text()))
    out = {}
    for target, line in named.items():
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        if target in modules and target != name and target.startswith("autopar"):
            out.setdefault(target, line)
    return out


def folder_of(name: str, modules: dict[str, Path]) -> str:
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def layer_of(name: str, table: dict[str, int]) -> str:
    """The longest row of the table ``name`` falls in (the root row takes only the root)."""
    rows = [row for row in table if name == row or (name.startswith(row + ".") and "." in row)]
    assert rows, f"{name} is in no layer of docs/design.md's table: add its folder there"
    return max(rows, key=len)


@functools.cache
def _graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    modules = source_modules()
    return modules, {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_imports_only_go_down_the_layer_table() -> None:
    table = layer_table()
    modules, graph = _graph()
    upward = []
    for name, targets in graph.items():
        mine = layer_of(name, table)
        for target, line in targets.items():
            theirs = layer_of(target, table)
            if theirs != mine and table[theirs] >= table[mine]:
                upward.append(f"{modules[name].relative_to(ROOT)}:{line}: {mine} "
                              f"(layer {table[mine]}) imports {target} ({theirs}, layer "
                              f"{table[theirs]})")
    assert not upward, "imports that do not go down the layer table:\n" + "\n".join(upward)


def test_no_cycle_crosses_folders() -> None:
    modules, graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len({folder_of(m, modules) for m in component}) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not cycles, "import cycles across folders:\n" + "\n".join(map(str, cycles))


def test_every_module_is_in_a_layer() -> None:
    table = layer_table()
    for name in source_modules():
        layer_of(name, table)


def test_the_version_is_pyprojects() -> None:
    import tomllib

    from autopar.core.version import __version__

    assert __version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "version"]


def test_every_package_is_installed() -> None:
    """pyproject.toml lists packages one by one (passes/, kernels/, cost_models/ install
    under autopar.): a sub-package left out would be missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {name for name, path in source_modules().items() if path.name == "__init__.py"}
    assert found == listed, f"in the tree, not listed: {sorted(found - listed)}; listed, " \
        f"not in the tree: {sorted(listed - found)}"


def test_the_top_level_kernels_folder_shadows_no_installed_package() -> None:
    """Run from the repository root (``python -m pytest``, the demo), ``import kernels`` finds
    the kernels/ folder first; transformers imports Hugging Face's ``kernels`` by that name, so
    the folder must hand it the installed package (or none), never itself."""
    import importlib.metadata
    import subprocess
    import sys

    probe = ("import importlib.util, kernels, autopar.kernels as ours\n"
             "assert kernels is not ours and not hasattr(kernels, 'reference_attention')\n"
             "assert ours.reference_attention\n")
    try:
        missing = not importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        missing = True
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    if missing:  # no Hugging Face kernels installed: the name is simply absent
        assert "No module named 'kernels'" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
