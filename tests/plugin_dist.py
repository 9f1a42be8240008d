"""Installed-package stand-ins for the plugin tests: a folder that holds a package and its
``*.dist-info`` (METADATA and entry_points.txt), which ``importlib.metadata`` reads as an
installed distribution once the folder is on ``sys.path`` (or ``PYTHONPATH``)."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin"


def _dist_info(site: Path, name: str, version: str, entry_points: dict[str, dict[str, str]]
               ) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))


def install_example(site: Path) -> dict[str, dict[str, str]]:
    """The example plugin (examples/plugin) as installed, with the entry points its
    pyproject.toml declares; those entry points."""
    import tomllib

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    shutil.copytree(EXAMPLE / "src" / "autopar_example_plugin", site / "autopar_example_plugin")
    entry_points = project["entry-points"]
    _dist_info(site, project["name"], project["version"], entry_points)
    return entry_points


def install_broken(site: Path) -> None:
    """A package whose ``autopar.passes`` entry point raises on import."""
    (site / "autopar_broken_plugin.py").write_text(
        'raise ImportError("this plugin is broken on purpose")\n')
    _dist_info(site, "autopar-broken-plugin", "0.0.1",
               {"autopar.passes": {"broken-pass": "autopar_broken_plugin:Pass"}})


def install_costly(site: Path) -> None:
    """A package whose ``autopar.cost_models`` entry point prices aten.gelu at 1 s forward
    and 2 s backward (an absurd cost, so its effect on a plan is plain)."""
    (site / "autopar_costly_plugin.py").write_text(
        "from autopar.cost_models.op_costs import register_op_cost\n\n\n"
        "def register():\n"
        "    register_op_cost('aten.gelu.default', replace=True)(lambda q: (1.0, 2.0))\n")
    _dist_info(site, "autopar-costly-plugin", "0.2.0",
               {"autopar.cost_models": {"slow-gelu": "autopar_costly_plugin:register"}})
