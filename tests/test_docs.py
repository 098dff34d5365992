"""Docs that run: every code block of README.md, CONTRIBUTING.md and the docs site's pages
(docs/, subfolders included) is run or checked here, or is marked as a fragment (an HTML
comment `<!-- fragment -->` on the line before it).

What each kind of block gets:

    python        run as a script (integration): in a scratch copy of the project whose
                  topology files carry a namespace of their own, declared before and
                  deleted after, against the broker under test. A block whose first line
                  is `# NAME.py` is that file: the later blocks of its page find it in
                  their scratch copy (a tutorial's test imports the tutorial's app)
    toml          parsed; validated as a topology (a table alone, such as `[scaling]`,
                  is validated inside a minimal topology)
    json          parsed
    text          shows output: not code, nothing to run
    fragment      not run (a command line with placeholders, a piece of a larger file);
                  any `rabbit-delay ...` line in a bash fragment is still checked: the
                  command and every `--option` it uses must exist

Blocks without a language and indented code blocks are refused: say what the block is.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main
from markdown_it import MarkdownIt

from rabbit_delay import load_topology, topology_from_dict
from rabbit_delay._cli.app import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
FRAGMENT = "<!-- fragment -->"
RUN = {"python"}
CHECKED = {"toml", "json"}
OUTPUT = {"text"}
SHELL = {"bash", "sh", "console"}
KNOWN = (
    RUN
    | CHECKED
    | OUTPUT
    | SHELL
    | {"yaml", "ini", "dockerfile", "systemd", "promql", "sql", "javascript"}
)
RUN_TIMEOUT_S = 90


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "" for none, "indented" for an indented code block
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    tokens = MarkdownIt("commonmark").parse(path.read_text())
    found: list[Block] = []
    previous = None
    for token in tokens:
        if token.type in ("fence", "code_block"):
            line = (token.map[0] + 1) if token.map else 0
            lang = token.info.split()[0] if token.type == "fence" and token.info else ""
            if token.type == "code_block":
                lang = "indented"
            marked = (
                previous is not None
                and previous.type == "html_block"
                and FRAGMENT in previous.content
            )
            found.append(Block(path, line, lang, token.content, marked))
        previous = token
    return found


ALL = [b for path in DOCS for b in blocks_of(path)]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


# -- every block says what it is ----------------------------------------------------------


def test_the_docs_have_code_blocks() -> None:
    assert len(ALL) > 20, "the docs parser found almost no code blocks"
    assert any(b.fragment for b in ALL)
    assert any(not b.fragment for b in ALL)


def test_every_block_has_a_language() -> None:
    bad = [f"{b.where} ({b.lang or 'no language'})" for b in ALL if b.lang not in KNOWN]
    assert not bad, (
        "fence every code block and name its language (python, toml, json, bash, text for "
        "output, ...); indented code blocks are not checked:\n  " + "\n  ".join(bad)
    )


def test_every_block_is_run_checked_or_a_fragment() -> None:
    unchecked = [
        f"{b.where} ({b.lang})"
        for b in ALL
        if not b.fragment and b.lang not in RUN | CHECKED | OUTPUT
    ]
    assert not unchecked, (
        f"these blocks are neither run nor checked: mark each as a fragment ({FRAGMENT} on "
        "the line before the fence) or make it one of the kinds tests/test_docs.py runs:\n  "
        + "\n  ".join(unchecked)
    )


# -- toml and json ------------------------------------------------------------------------

_BASE: dict[str, Any] = {
    "namespace": "docs",
    "tiers": {"5s": "5s", "3s": "3s", "5m": "5m", "30m": "30m", "2h": "2h"},
    "queues": {"orders.cancel-unpaid": {}},
}


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _tier_names(data: dict[str, Any]) -> dict[str, str]:
    """Tiers a snippet names in `[scaling] tier_shards` or retry tiers, so a table alone
    validates against tiers it expects."""
    names: dict[str, str] = {}
    for tier in (data.get("scaling") or {}).get("tier_shards", {}):
        names[tier] = tier
    for cfg in (data.get("queues") or {}).values():
        for tier in (cfg.get("retry") or {}).get("tiers", []) + list(cfg.get("tiers") or []):
            names[tier] = tier
    return names


TOML = [b for b in ALL if b.lang == "toml" and not b.fragment]


@pytest.mark.parametrize("block", TOML, ids=_ids(TOML))
def test_toml_block_is_a_valid_topology(block: Block) -> None:
    data = tomllib.loads(block.code)
    if "namespace" not in data:
        base = _merged(_BASE, {"tiers": _tier_names(data)})
        data = _merged(base, data)
    topology_from_dict(data, source=block.where)


JSON = [b for b in ALL if b.lang == "json" and not b.fragment]


@pytest.mark.parametrize("block", JSON, ids=_ids(JSON))
def test_json_block_parses(block: Block) -> None:
    json.loads(block.code)


# -- command lines: the commands and options exist -----------------------------------------


def _cli() -> Any:
    """The click command tree typer builds for the `rabbit-delay` app."""
    return typer.main.get_command(app)


def _command_lines(code: str) -> list[str]:
    lines: list[str] = []
    for raw in code.replace("\\\n", " ").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line.startswith("$ "):
            line = line[2:]
        for part in re.split(r"&&|\|\||;|\|", line):
            part = part.strip()
            if part.startswith(("rabbit-delay ", "python -m rabbit_delay ")):
                lines.append(part)
    return lines


CLI_LINES = [(b, line) for b in ALL if b.lang in SHELL for line in _command_lines(b.code)]


@pytest.mark.parametrize(
    ("block", "line"), CLI_LINES, ids=[f"{b.where}:{line[:40]}" for b, line in CLI_LINES]
)
def test_cli_line_uses_real_commands_and_options(block: Block, line: str) -> None:
    root = _cli()
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    words = words[3:] if words[0] == "python" else words[1:]
    command = root
    while getattr(command, "commands", None) and words and not words[0].startswith("-"):
        sub = command.commands.get(words[0])
        if sub is None:
            assert command is not root, f"{block.where}: `{line}`: no command {words[0]!r}"
            break
        command, words = sub, words[1:]
    known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    known |= {"--help"}
    if command is root:
        known |= {"--version"}
    for word in words:
        if word.startswith("--"):
            option = word.split("=", 1)[0]
            assert option in known, (
                f"{block.where}: `{line}`: {option} is not an option of "
                f"`{command.name}` (it has: {', '.join(sorted(known))})"
            )


# -- python: run -------------------------------------------------------------------------

PYTHON = [b for b in ALL if b.lang == "python" and not b.fragment]
_NAMESPACE = re.compile(r'^namespace\s*=\s*"[^"]*"', re.MULTILINE)
_FILE_NAME = re.compile(r"^# (?P<name>[A-Za-z_][A-Za-z0-9_]*\.py)\b")


def _named_files_before(block: Block) -> dict[str, str]:
    """The files (`# NAME.py` blocks) that come before `block` on its page."""
    files: dict[str, str] = {}
    for earlier in PYTHON:
        if earlier.path == block.path and earlier.line < block.line:
            m = _FILE_NAME.match(earlier.code)
            if m:
                files[m["name"]] = earlier.code
    return files


def _scratch_project(tmp: Path, namespace: str) -> list[Path]:
    """topology/ and examples/ copied with `namespace` in every topology file."""
    for folder in ("topology", "examples"):
        shutil.copytree(ROOT / folder, tmp / folder)
    files = [*(tmp / "topology").glob("*.toml"), *(tmp / "examples").rglob("*.toml")]
    for i, toml in enumerate(files):
        toml.write_text(_NAMESPACE.sub(f'namespace = "{namespace}{i}"', toml.read_text()))
    return files


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
def test_python_block_runs(block: Block, broker_url: str, tmp_path: Path) -> None:
    from rabbit_delay._ops.delete.execute import delete_topology
    from rabbit_delay.sync import connected, declare

    files = _scratch_project(tmp_path, "doc" + uuid.uuid4().hex[:8])
    used = [f for f in files if str(f.relative_to(tmp_path)) in block.code]
    topologies = [load_topology(f) for f in used]
    for name, code in _named_files_before(block).items():
        (tmp_path / name).write_text(code)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    with connected(broker_url, name="docs test") as connection:
        for topology in topologies:
            declare(connection, topology)
    try:
        env = {**os.environ, "RABBIT_DELAY_URL": broker_url, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    finally:
        with connected(broker_url, name="docs test cleanup") as connection:
            for topology in topologies:
                delete_topology(connection, topology)
    assert proc.returncode == 0, (
        f"{block.where} exited {proc.returncode}\n--- code\n{block.code}\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
