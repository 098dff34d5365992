"""One home per name: every header name, default and outcome is defined in exactly one
module, and every other module refers to it by its constant (read from the source, so a
second copy anywhere fails here)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import rabbit_delay
from rabbit_delay import _headers
from rabbit_delay._consumer.decide import ParkReason, RepublishReason
from rabbit_delay._consumer.outcome import Outcome

PACKAGE = Path(rabbit_delay.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _strings(tree: ast.Module) -> Iterator[ast.Constant]:
    """Every string constant that is not a docstring."""
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_text and id(node) not in docstrings:
            yield node


def _where(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


HEADER_NAMES = {
    value: name
    for name, value in vars(_headers).items()
    if name.isupper() and isinstance(value, str)
}


def test_the_headers_module_names_every_header_once() -> None:
    assert len(HEADER_NAMES) == len(set(HEADER_NAMES)), "two constants for one header"
    assert all(v.startswith(("rd-", "x-")) or v in _headers.TRACE_HEADERS for v in HEADER_NAMES)
    # every rabbit-delay header is the project's own (rd-*), never x-* (the broker's)
    assert "rd-due-at" in HEADER_NAMES
    assert "rd-attempt" in HEADER_NAMES


def test_no_header_name_is_written_outside_the_headers_module() -> None:
    found = []
    for path in MODULES:
        if path.name == "_headers.py":
            continue
        for node in _strings(_tree(path)):
            if node.value in HEADER_NAMES:
                found.append(f"{_where(path)}:{node.lineno}: {node.value!r}")
    assert found == [], "use the constant of rabbit_delay._headers instead"


def _defaults() -> dict[str, list[str]]:
    homes: dict[str, list[str]] = defaultdict(list)
    for path in MODULES:
        for name, _ in _assigned_defaults(path):
            homes[name].append(_where(path))
    return homes


def _assigned_defaults(path: Path) -> Iterator[tuple[str, ast.expr | None]]:
    for node in _tree(path).body:
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id.startswith("DEFAULT_"):
            yield target.id, node.value


def _default_values() -> dict[str, object]:
    """stem -> value of every DEFAULT_ constant whose value is a literal."""
    values: dict[str, object] = {}
    for path in MODULES:
        for name, value in _assigned_defaults(path):
            try:
                values[_stem(name)] = ast.literal_eval(value) if value is not None else None
            except ValueError:
                continue
    return values


def test_every_default_has_one_home() -> None:
    homes = _defaults()
    assert len(homes) > 10  # the scan sees them
    assert {n: m for n, m in homes.items() if len(m) > 1} == {}


def _stem(name: str) -> str:
    """DEFAULT_SHUTDOWN_TIMEOUT_S -> shutdown_timeout; DEFAULT_LEASE_MS -> lease."""
    return re.sub(r"_(S|MS)$", "", name.removeprefix("DEFAULT_")).lower()


def test_a_parameter_named_after_a_default_takes_it_by_name_not_as_a_copy() -> None:
    """`shutdown_timeout: float = 30.0` beside DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0 would be
    a second home of the same value: a parameter named after a default refers to it."""
    defaults = _default_values()
    assert defaults["shutdown_timeout"] == 30.0  # the scan reads them
    copies = []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            positional = (args.posonlyargs + args.args)[
                len(args.posonlyargs + args.args) - len(args.defaults) :
            ]
            pairs = list(zip(positional, args.defaults, strict=True))
            keywords = zip(args.kwonlyargs, args.kw_defaults, strict=True)
            pairs += [(a, d) for a, d in keywords if d is not None]
            for arg, default in pairs:
                if not isinstance(default, ast.Constant) or arg.arg not in defaults:
                    continue
                value = defaults[arg.arg]
                if default.value == value and type(default.value) is type(value):
                    copies.append(f"{_where(path)}:{node.lineno}: {arg.arg}={default.value!r}")
    assert copies == []


# What became of a delivery, and why: one vocabulary (rabbit_delay._consumer.outcome),
# whose values no other enum of it repeats, written nowhere but in their enums.
VOCABULARY = {
    "rabbit_delay/_consumer/outcome.py": Outcome,
    "rabbit_delay/_consumer/decide.py": (ParkReason, RepublishReason),
}


def test_outcomes_and_reasons_do_not_overlap() -> None:
    values = (
        [o.value for o in Outcome]
        + [r.value for r in ParkReason]
        + [r.value for r in RepublishReason]
    )
    assert len(values) == len(set(values))


@pytest.mark.parametrize("enum", [Outcome, ParkReason, RepublishReason])
def test_outcome_and_reason_strings_are_only_written_in_their_enum(enum: type) -> None:
    home = Path(rabbit_delay.__file__).parent.parent / enum.__module__.replace(".", "/")
    home = home.with_suffix(".py")
    values = {member.value for member in enum}
    found = []
    for path in MODULES:
        if path == home:
            continue
        for node in _strings(_tree(path)):
            if node.value in values and _means_the_enum(path, node.value):
                found.append(f"{_where(path)}:{node.lineno}: {node.value!r}")
    assert found == [], f"use {enum.__name__} instead of its value"


# The same word, another concept: a store's answer, the broker's x-death reason, a config
# field, a queue role or a publish error reason, not what became of a delivery.
_ELSEWHERE = {
    ("cancelled", "_idempotency/guard.py"),  # ClaimResult.CANCELLED: the store's answer
    ("cancelled", "_stores/"),  # the stores' record state
    ("superseded", "_idempotency/guard.py"),  # ClaimResult.SUPERSEDED: the store's answer
    # The schedule's record states (ScheduleState), its verdicts and its kinds of result
    # (Finished.RETRY), and the stores' statements that write them.
    ("cancelled", "_schedule/"),
    ("superseded", "_schedule/"),
    ("parked", "_schedule/"),
    ("retry", "_schedule/records.py"),
    ("superseded", "_stores/"),
    ("parked", "_stores/"),
    ("rejected", "testing/_broker.py"),  # the x-death reason the emulated broker writes
    ("max_attempts", "_topology/"),  # the [queues.*.retry] field
    ("retry", "_observe/tracing.py"),  # the name of a span ("retry {queue}")
    ("parked", "_cli/"),  # a column or field of the CLI's own output
    ("parked", "_ops/"),  # the dashboard's parking lot pages
    ("cancelled", "_ops/scheduled/"),  # `scheduled cancel --json`: was the key cancelled
    ("retried", "_cli/relay.py"),  # the relay's JSON field (outbox rows), not a delivery
    ("stale", "_consumer/delivery.py"),  # Signal.STALE: a driver's reply
}


def _means_the_enum(path: Path, value: str) -> bool:
    where = _where(path).removeprefix("rabbit_delay/")
    return not any(value == word and where.startswith(prefix) for word, prefix in _ELSEWHERE)
