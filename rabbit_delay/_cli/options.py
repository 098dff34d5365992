"""What every `rabbit-delay` command shares: the option types, the consoles, JSON output,
error reporting and exit codes, and how the topology, the broker URLs, the management
API, the log level and an application are resolved. Imports no command (the commands
import it; `rabbit_delay._cli.app` registers them).

Errors are reported here only (`fail`, `errors_to_exit`, `exit_on_failure`, and click's
usage errors in `CommandGroup`), so every command reports them alike: one redacted
`error: ...` line on stderr, exit code 1; with `--json`, also one JSON document on
stdout, `{"error": "...", "kind": "<error class name, or usage>"}`, so a script reading
stdout always gets JSON (docs/operations.md, "Exit codes and JSON errors").
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, Protocol, TypeVar

import typer
from rich.console import Console
from typer.core import TyperGroup

from rabbit_delay._cli.unreachable import describe_unavailable
from rabbit_delay._consumer.app import App
from rabbit_delay._errors import BrokerUnavailable, RabbitDelayError
from rabbit_delay._io.management import access_for
from rabbit_delay._observe.logs import JsonFormatter, TextFormatter
from rabbit_delay._topology.model import Topology, load_topology
from rabbit_delay._urls import URL_ENV, broker_urls, redact

TOPOLOGY_ENV = "RABBIT_DELAY_TOPOLOGY"
DEFAULT_TOPOLOGY = Path("topology")

# Exit codes (plan: 0 in sync, 2 changes pending, 1 error). A usage error (unknown
# option, bad option value) is an error too: 1, not click's 2, which would read as
# "changes pending" to a script running `plan`.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_PENDING = 2

# The `kind` of a JSON error that is not a library exception: bad command-line input.
USAGE = "usage"
JSON_FLAG = "--json"

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# -- errors, JSON, exit codes ---------------------------------------------------------------

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


class CommandGroup(TyperGroup):
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


def exit_on_failure(error: str | None, *, as_json: bool) -> None:
    """Exit 1 when a run that printed its report stopped on `error`: under --json the
    report says why (it is the one document); otherwise the `error:` line says it."""
    if error is None:
        return
    if as_json:
        raise typer.Exit(EXIT_ERROR)
    fail(error)


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


class Reported(Protocol):
    """A command's result: what it says to scripts (`as_json`)."""

    def as_json(self) -> Any: ...


ResultT = TypeVar("ResultT", bound=Reported)


def print_result(result: ResultT, as_json: bool, show: Callable[[ResultT], None]) -> None:
    """A command's result: its JSON document under --json, else `show(result)` renders
    it for people."""
    if as_json:
        print_json(result.as_json())
    else:
        show(result)


def count_cell(value: int | None) -> str:
    """A count in a table: `?` when it is not known."""
    return "?" if value is None else str(value)


JsonOpt = Annotated[
    bool,
    typer.Option(
        JSON_FLAG,
        help='Print machine-readable JSON instead of a table; errors too: {"error", "kind"}.',
    ),
]


# -- the topology ---------------------------------------------------------------------------

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


# -- the broker and its management API ----------------------------------------------------

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
MgmtOpt = Annotated[
    str | None,
    typer.Option(
        "--management-url",
        help="Management API base URL (default: derived from --url; $RABBIT_DELAY_MANAGEMENT_URL).",
        show_default=False,
    ),
]
NoMgmtOpt = Annotated[
    bool,
    typer.Option(
        "--no-management", help="Do not use the management API; probe with passive declares."
    ),
]


def url_for(url: Sequence[str] | None) -> tuple[str, ...]:
    """The broker URLs to try, in order. Raises ConfigError for a malformed list."""
    return broker_urls(url)


# The one rule of which management API a command may use (rabbit_delay._io.management).
management_access = access_for


# -- logging --------------------------------------------------------------------------------


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


# The AMQP clients: pika (sync), aio-pika and aiormq under it (async).
CLIENT_LOGGERS = ("pika", "aio_pika", "aiormq")


def configure_logging(level: LogLevel, log_format: LogFormat = LogFormat.TEXT) -> None:
    """rabbit-delay's loggers at `level`; the AMQP clients' only at debug; records as
    text lines or JSON objects (rabbit_delay._observe.logs), on stderr, redacted.

    The workers log every connection problem themselves, redacted and once. The clients
    log the same failure again as a handful of ERROR lines and a traceback (pika's
    `LOGGER.exception` on a refused login), and pika logs each 404 of a passive declare
    as a warning: details for --log-level debug, noise otherwise.
    """
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(JsonFormatter() if log_format is LogFormat.JSON else TextFormatter())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("rabbit_delay").setLevel(level.upper())
    client_level = logging.INFO if level is LogLevel.DEBUG else logging.CRITICAL
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(client_level)


LogLevelOpt = Annotated[
    LogLevel,
    typer.Option(
        "--log-level",
        help="Level of rabbit-delay's loggers; debug also shows the AMQP client's (pika, aiormq).",
    ),
]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=0,
        max=65535,
        help="Serve Prometheus /metrics, and /healthz and /readyz, on this port.",
        show_default=False,
    ),
]


# -- the application (worker, reconcile) ----------------------------------------------------

TargetArg = Annotated[
    str, typer.Argument(metavar="MODULE:APP", help="The App, e.g. myapp.workers:app.")
]
AppDirOpt = Annotated[
    Path, typer.Option("--app-dir", help="Directory to import MODULE from (default: current).")
]


def load_app(target: str, app_dir: Path) -> App:
    """Import `MODULE:ATTR` (ATTR may be dotted, or a factory returning an App)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        fail(f"{target!r}: give the app as MODULE:APP, e.g. myapp.workers:app")
    sys.path.insert(0, str(app_dir.resolve()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            fail(
                f"cannot import module {module_name!r} from {app_dir.resolve()} "
                "(or sys.path): use --app-dir to name its directory"
            )
        raise
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            fail(f"module {module_name!r} has no attribute {attr!r}")
    if not isinstance(obj, App) and callable(obj):
        obj = obj()
    if not isinstance(obj, App):
        fail(f"{target!r} is a {type(obj).__name__}, not a rabbit_delay._consumer.app.App")
    return obj


__all__ = [
    "CLIENT_LOGGERS",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_PENDING",
    "USAGE",
    "AppDirOpt",
    "CommandGroup",
    "JsonOpt",
    "LogFormat",
    "LogLevel",
    "LogLevelOpt",
    "MetricsPortOpt",
    "MgmtOpt",
    "NoMgmtOpt",
    "TargetArg",
    "TopologyArg",
    "TopologyOpt",
    "UrlOpt",
    "configure_logging",
    "count_cell",
    "err",
    "errors_to_exit",
    "exit_on_failure",
    "fail",
    "load_app",
    "management_access",
    "out",
    "print_json",
    "print_result",
    "report_error",
    "resolve_topology",
    "url_for",
    "wants_json",
]
