"""The README and docs/ stay short, linked and in step with CI.

- README.md is at most 200 lines (the rest belongs in docs/).
- Every relative markdown link in README.md and docs/*.md names a file or folder of the
  repository (resolved against the linking file's folder; an ``#anchor`` is not checked).
- The README's test command is the one .ci/run runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
TEST_COMMAND = "python -m pytest -q"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """The link targets of ``path`` outside code, external and same-page links left out."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return [target for target in LINK.findall(text)
            if not target.startswith(EXTERNAL) and not target.startswith("#")]


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of ``text``, stripped."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```[ \t]*$", text, re.M | re.S)
    return [block.strip() for block in blocks]


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/")


def test_docs_folder_exists() -> None:
    assert (ROOT / "docs" / "README.md").is_file()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = [target for target in relative_links(path)
              if not (path.parent / target.split("#", 1)[0]).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing paths: {broken}"


def test_readme_test_command_is_ci_s() -> None:
    """The Quickstart's test command is exactly the command .ci/run ends with."""
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci_commands = [line for line in ci_lines if line and not line.startswith("#")]
    assert ci_commands[-1] == TEST_COMMAND, (
        f".ci/run ends with {ci_commands[-1]!r}, not {TEST_COMMAND!r}")
    pytest_blocks = [block for block in code_blocks(README.read_text()) if "pytest" in block]
    assert pytest_blocks == [TEST_COMMAND], (
        f"README.md's test command block(s) {pytest_blocks!r} differ from .ci/run's "
        f"{TEST_COMMAND!r}")


def test_link_pattern() -> None:
    """The link scanner sees what it should, and skips code and external links."""
    sample = ("[a](x.md) [b](../y.md#part) [c](#here) [d](https://e.org) `[e](f.md)`\n"
              "```\n[g](h.md)\n```\n")
    text = INLINE_CODE.sub("", FENCE.sub("", sample))
    found = [t for t in LINK.findall(text) if not t.startswith(EXTERNAL) and not t.startswith("#")]
    assert found == ["x.md", "../y.md#part"]
