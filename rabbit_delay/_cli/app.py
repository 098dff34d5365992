"""typer app, shared options and error handling for every command.

Errors are reported here only (`fail`, `errors_to_exit`, and click's usage errors in
`_Group.invoke`), so every command reports them alike: one redacted `error: ...` line
on stderr, exit code 1; with `--json`, also one JSON document on stdout,
`{"error": "...", "kind": "<error class name, or usage>"}`, so a script reading stdout
always gets JSON (docs/operations.md, "Exit codes and JSON errors").
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperGroup

from rabbit_delay._cli.unreachable import describe_unavailable
from rabbit_delay._errors import BrokerUnavailable, RabbitDelayError
from rabbit_delay._topology.model import Topology, load_topology
from rabbit_delay._urls import URL_ENV, broker_urls, redact

TOPOLOGY_ENV = "RABBIT_DELAY_TOPOLOGY"
DEFAULT_TOPOLOGY = Path("topology")
DIST_NAME = "rabbit-delay"

# Exit codes (plan: 0 in sync, 2 changes pending, 1 error). A usage error (unknown
# option, bad option value) is an error too: 1, not click's 2, which would read as
# "changes pending" to a script running `plan`.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_PENDING = 2

# The `kind` of a JSON error that is not a library exception: bad command-line input.
USAGE = "usage"
JSON_FLAG = "--json"

# click's UsageError (unknown option, missing argument, bad value): the base class of
# the BadParameter typer exports, found from it so that this works whether typer
# vendors click (0.29+) or depends on it.
_UsageError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)

# Set while a command invoked with --json runs; `_printed` once it wrote its document.
_json_mode: ContextVar[bool] = ContextVar("rabbit_delay_cli_json", default=False)
_printed: ContextVar[bool] = ContextVar("rabbit_delay_cli_printed", default=False)


def wants_json(args: Sequence[str]) -> bool:
    """Whether a command line asks for JSON: `--json` among the options (not after `--`).

    Read from the raw arguments, so that a usage error, found before the options are
    parsed, is reported as JSON too.
    """
    tokens = list(args)
    if "--" in tokens:
        tokens = tokens[: tokens.index("--")]
    return JSON_FLAG in tokens


class _Group(TyperGroup):
    """The command group: JSON errors and exit code 1 for usage errors, centrally."""

    _ARGV_KEY = "rabbit_delay.argv"

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta[self._ARGV_KEY] = list(args)
        try:
            return super().parse_args(ctx, args)
        except _UsageError as exc:  # before any command: `rabbit-delay --bogus`
            if type(exc).__name__ == "NoArgsIsHelpError":
                raise  # `rabbit-delay` alone: the help screen, as click shows it
            self._usage_error(exc, wants_json(ctx.meta[self._ARGV_KEY]))  # `args` is consumed

    def invoke(self, ctx: Any) -> Any:
        as_json = wants_json(ctx.meta.get(self._ARGV_KEY, ()))
        token, printed = _json_mode.set(as_json), _printed.set(False)
        try:
            return super().invoke(ctx)
        except _UsageError as exc:
            self._usage_error(exc, as_json)
        finally:
            _json_mode.reset(token)
            _printed.reset(printed)

    @staticmethod
    def _usage_error(exc: Exception, as_json: bool) -> NoReturn:
        if not as_json:
            exc.exit_code = EXIT_ERROR  # type: ignore[attr-defined]
            raise exc  # typer shows it as usual (the box with the usage line)
        token = _json_mode.set(True)
        try:
            report_error(exc.format_message(), USAGE)  # type: ignore[attr-defined]
        finally:
            _json_mode.reset(token)
        raise typer.Exit(EXIT_ERROR) from None


app = typer.Typer(
    name="rabbit-delay",
    cls=_Group,
    help=(
        "Reliable delayed delivery on RabbitMQ: declare TTL tiers, publish delayed messages, "
        "run workers."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def package_version() -> str:
    """The installed distribution's version (what pip installed), from its metadata."""
    try:
        return dist_version(DIST_NAME)
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        out.print(f"{DIST_NAME} {package_version()}", markup=False)
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print the version (rabbit-delay X.Y.Z) and exit.",
        ),
    ] = False,
) -> None:
    """Reliable delayed delivery on RabbitMQ: declare TTL tiers, publish delayed messages,
    run workers."""


_TOPOLOGY_HELP = (
    f"Topology TOML file (default: ${TOPOLOGY_ENV}, else the only *.toml in ./topology)."
)
TopologyArg = Annotated[
    Path | None,
    typer.Argument(
        help=f"{_TOPOLOGY_HELP} The same as -f FILE.", show_default=False, metavar="FILE"
    ),
]
# The one way every command takes the topology file (plan, declare, status, replay and
# delete also take it as their argument, as they always did).
TopologyOpt = Annotated[
    Path | None,
    typer.Option("--topology", "-f", help=_TOPOLOGY_HELP, show_default=False, metavar="FILE"),
]
UrlOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--url",
        help=(
            "Broker URL (amqp:// or amqps://). Repeat it, or separate URLs with commas, to "
            "name several nodes: the first that answers is used. Default: "
            f"${URL_ENV} (same syntax), else the local broker."
        ),
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        JSON_FLAG,
        help='Print machine-readable JSON instead of a table; errors too: {"error", "kind"}.',
    ),
]


def resolve_topology(path: Path | None, option: Path | None = None) -> Topology:
    """Load the topology named by the FILE argument `path` or the -f option `option`
    (at most one of them), else $RABBIT_DELAY_TOPOLOGY, else the only *.toml in
    ./topology. Raises TopologyError (through load_topology); exits for both given."""
    if path is not None and option is not None and path != option:
        fail(
            f"the topology file is given twice ({path} and -f {option}): give it once, "
            "as FILE or as -f FILE"
        )
    chosen = path or option or Path(os.environ.get(TOPOLOGY_ENV) or DEFAULT_TOPOLOGY)
    return load_topology(chosen)


def report_error(message: str, kind: str) -> None:
    """One error, redacted: the `error:` line on stderr; under --json also the JSON
    document on stdout, unless the command already printed its own (one document per
    run: a declare conflict prints its plan with the error)."""
    text = redact(message)
    if _json_mode.get() and not _printed.get():
        _write_json({"error": text, "kind": kind})
    err.print("[bold red]error:[/] ", end="", markup=True)
    # the message quotes user input: never read it as markup ("[bold]" would vanish)
    err.print(text, markup=False)


def fail(message: str, code: int = EXIT_ERROR, *, kind: str = USAGE) -> NoReturn:
    """Report an error (see `report_error`) and exit with `code`; `kind` names the error
    class when the message comes from one, else "usage" (bad command-line input)."""
    report_error(message, kind)
    raise typer.Exit(code)


@contextmanager
def errors_to_exit() -> Iterator[None]:
    """Every library error becomes one redacted line on stderr (and the JSON document
    under --json) and exit code 1; a broker that cannot be reached is named by its cause
    (login, vhost, port, host name)."""
    try:
        yield
    except RabbitDelayError as exc:
        text = describe_unavailable(exc) if isinstance(exc, BrokerUnavailable) else str(exc)
        report_error(text, type(exc).__name__)
        raise typer.Exit(EXIT_ERROR) from None


def _write_json(data: Any) -> None:
    sys.stdout.write(redact(json.dumps(data, indent=2, default=str)) + "\n")
    _printed.set(True)


def print_json(data: Any) -> None:
    """The command's result as one JSON document on stdout (redacted)."""
    _write_json(data)


def url_for(url: Sequence[str] | None) -> tuple[str, ...]:
    """The broker URLs to try, in order. Raises ConfigError for a malformed list."""
    return broker_urls(url)


def main() -> None:
    # Commands live in their own modules; importing them registers them on `app`.
    load_commands()
    app()


def load_commands() -> None:
    """Import the command modules (each registers its commands on `app`)."""
    from rabbit_delay._cli import (  # noqa: F401
        commands,
        dashboard,
        delete,
        ops,
        parked,
        reconcile,
        relay,
        transfer,
        worker,
    )
