"""The docs site's generated reference pages (docs/_hooks/reference.py, run by MkDocs at
build time) cover everything the code has: every command and option of the typer app,
every table and key of the topology models (each with a description), every class of
the error tree, every header constant. The strict build in CI fails on the rest (links,
anchors); these fail first, without building."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import typer.main

import rabbit_delay
import rabbit_delay._errors as errors
import rabbit_delay._headers as h
from rabbit_delay._cli.app import app
from rabbit_delay._topology import model

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "reference"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference_hook", ROOT / "docs" / "_hooks" / "reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()


def _commands() -> list[tuple[str, object]]:
    found = []

    def walk(group: object, path: str) -> None:
        for name, command in group.commands.items():  # type: ignore[attr-defined]
            if command.hidden:
                continue
            found.append((f"{path} {name}", command))
            if hasattr(command, "commands"):
                walk(command, f"{path} {name}")

    walk(typer.main.get_command(app), "rabbit-delay")
    return found


def test_the_cli_reference_has_every_command_and_option() -> None:
    page = HOOKS.cli_reference()
    commands = _commands()
    assert len(commands) > 10
    for path, command in commands:
        heading = f"# `{path}`\n"
        assert heading in page, f"no section for {path}"
        section = page.split(heading, 1)[1].split("\n#", 1)[0]
        for param in command.params:  # type: ignore[attr-defined]
            if param.hidden:
                continue
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("-"):
                    assert opt in section, f"{path}: option {opt} missing from the reference"
    assert "`--version`" in page


def test_the_topology_reference_has_every_table_and_key() -> None:
    page = HOOKS.topology_reference()
    for table in ('[queues."NAME"]', '[queues."NAME".retry]', "[cascade]", "[plugin]"):
        assert f"## `{table}`" in page
    for table in ('[queues."NAME".retry.backoff]', "[scaling]", "[idempotency]"):
        assert f"## `{table}`" in page
    for cls in (
        model.Topology,
        model.QueueConfig,
        model.RetryPolicy,
        model.RetryBackoff,
        model.CascadeConfig,
        model.ScalingConfig,
        model.IdempotencyConfig,
    ):
        for field in cls.model_fields:
            assert f"| `{field}` |" in page, f"{cls.__name__}.{field} missing"
    assert "| `lease` | duration" in page
    assert '`"30s"`' in page  # a duration's default written as a user writes it


def test_every_topology_key_is_described() -> None:
    assert HOOKS.missing_topology_descriptions() == [], (
        "describe each of these beside it in rabbit_delay/_topology/model.py (a docstring "
        "under the field): the topology reference prints it"
    )


def test_the_error_reference_has_the_whole_tree() -> None:
    page = HOOKS.errors_reference()
    for cls in HOOKS._subclasses(errors.RabbitDelayError):
        assert cls.__name__ in page
        if cls.__name__ in rabbit_delay.__all__:
            assert f"## `rabbit_delay.{cls.__name__}`" in page
    assert "├── ConfigError (ValueError)" in page


def test_the_header_reference_has_every_constant() -> None:
    page = HOOKS.headers_reference()
    for name, value in vars(h).items():
        if name.isupper() and isinstance(value, str):
            assert f"| `{value}` | `{name}` |" in page
    for _, header, text in HOOKS.header_constants():
        assert text, f"{header} has no description in rabbit_delay/_headers.py"


@pytest.mark.parametrize("name", sorted(HOOKS.GENERATORS))
def test_each_generated_part_is_asked_for_by_a_page(name: str) -> None:
    marker = f"<!-- generated: {name} -->"
    assert any(marker in p.read_text() for p in (ROOT / "docs").rglob("*.md")), (
        f"no page asks for the generated part {name!r}"
    )


def test_an_unknown_marker_is_left_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    text = "intro\n<!-- generated: nothing-such -->\n"
    assert HOOKS.expand(text, "x.md") == text
    assert "unknown generated part" in caplog.text


def test_repository_links(tmp_path: Path) -> None:
    page = ROOT / "docs" / "getting-started" / "tutorial.md"
    text = (
        "[ex](../../examples/demo.py) [gone](../../examples/gone.py) [guide](../topology.md)\n"
        "```text\n[not a link](../../nowhere)\n```\n"
    )
    out, missing = HOOKS.repository_links(text, page, "https://example.org/r")
    assert "(https://example.org/r/blob/main/examples/demo.py)" in out
    assert "(../topology.md)" in out  # MkDocs checks links between pages
    assert missing == ["../../examples/gone.py"]
