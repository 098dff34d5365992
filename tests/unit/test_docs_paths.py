"""What the docs name exists: every repository path that README.md, CONTRIBUTING.md, the
docs site's pages (and the package's messages and docstrings, which point readers to
docs/) name is a file or folder of the repository; and the README stays short."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
README_LIMIT = 12 * 1024
TOP = ("topology", "examples", "rabbit_delay", "benchmarks", "docs", "deploy", "tests", ".ci")
PATH = re.compile(
    r"(?<![\w./-])(?P<path>(?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*{},-]*)"
)
BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def _expand(path: str) -> list[str]:
    """`a-{x,y}.json` -> `a-x.json`, `a-y.json` (a shell's brace expansion)."""
    m = BRACES.search(path)
    if m is None:
        return [path]
    return list(
        itertools.chain.from_iterable(
            _expand(path[: m.start()] + alt + path[m.end() :]) for alt in m[1].split(",")
        )
    )


def _exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def named_paths(text: str) -> set[str]:
    found = set()
    for m in PATH.finditer(text):
        path = m["path"].rstrip(".,;:")
        if "{" in path and "," not in path:  # a pattern such as docs/{name}.md
            continue
        found.update(_expand(path))
    return found


def _cases() -> list[tuple[str, str]]:
    cases = []
    for doc in DOCS:
        for path in sorted(named_paths(doc.read_text(encoding="utf-8"))):
            cases.append((str(doc.relative_to(ROOT)), path))
    for source in sorted((ROOT / "rabbit_delay").rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        for path in sorted(p for p in named_paths(text) if p.startswith("docs/")):
            cases.append((str(source.relative_to(ROOT)), path))
    return cases


CASES = _cases()


def test_the_scan_finds_the_paths_the_docs_name() -> None:
    named = {path for _, path in CASES}
    assert {"topology/orders.toml", "examples/demo.py", "docs/ARCHITECTURE.md"} <= named
    assert any(where.startswith("rabbit_delay/") for where, _ in CASES)


def test_the_scan_reads_paths_as_written() -> None:
    assert named_paths("see `topology/orders.toml`, and docs/topology.md.") == {
        "topology/orders.toml",
        "docs/topology.md",
    }
    assert named_paths("results/x-{before,after}.json") == set()  # not a repository root
    assert named_paths("benchmarks/r-{a,b}.json") == {"benchmarks/r-a.json", "benchmarks/r-b.json"}
    assert named_paths("my.topology/x and mytopology/x") == set()


@pytest.mark.parametrize(("where", "path"), CASES, ids=[f"{w}:{p}" for w, p in CASES])
def test_a_named_path_exists(where: str, path: str) -> None:
    assert _exists(path), f"{where} names {path}, which is not in the repository"


def test_the_readme_stays_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: it sells and starts (what and why, "
        "the two commands, install, the quickstart, links); the rest belongs in docs/"
    )


def test_the_readme_keeps_its_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "\nbash .ci/demo " in readme
    assert "\nbash .ci/test " in readme
