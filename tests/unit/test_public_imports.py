"""What a user reads imports only what a user may import: the README, CONTRIBUTING, the
docs (every page of the site, subfolders included) and the
examples name public modules only (rabbit_delay and its documented submodules), never a
private one (a name starting with an underscore)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {
    "rabbit_delay",
    "rabbit_delay.sync",
    "rabbit_delay.aio",
    "rabbit_delay.stores",
    "rabbit_delay.outbox",
    "rabbit_delay.testing",
    "rabbit_delay.metrics",
    "rabbit_delay.tracing",
}
FENCE = re.compile(r"^```(?:python|py)[^\n]*\n(.*?)^```", re.S | re.M)


def _sources() -> list[tuple[str, str]]:
    found = []
    for path in [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]:
        for n, block in enumerate(FENCE.findall(path.read_text()), 1):
            found.append((f"{path.relative_to(ROOT)} block {n}", block))
    for path in sorted((ROOT / "examples").rglob("*.py")):
        found.append((str(path.relative_to(ROOT)), path.read_text()))
    return found


def _imported(code: str) -> list[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a fragment that is not a whole program
        lines = [line for line in code.splitlines() if line.startswith(("from ", "import "))]
        tree = ast.parse("\n".join(lines))
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.append(node.module)
            modules.extend(f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            modules.extend(a.name for a in node.names)
    return [m for m in modules if m.split(".")[0] == "rabbit_delay"]


SOURCES = _sources()


def test_the_scan_reads_what_users_read() -> None:
    assert len(SOURCES) > 20
    assert any("rabbit_delay" in code for _, code in SOURCES)


@pytest.mark.parametrize(("where", "code"), SOURCES, ids=[w for w, _ in SOURCES])
def test_only_public_modules_are_imported(where: str, code: str) -> None:
    private = [m for m in _imported(code) if m not in PUBLIC]
    assert private == [], f"{where} imports private modules: import from {sorted(PUBLIC)}"
