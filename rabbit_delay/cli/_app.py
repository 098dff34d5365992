"""typer app, shared options and error handling for every command."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from rabbit_delay.cli._unreachable import describe_unavailable
from rabbit_delay.errors import BrokerUnavailable, RabbitDelayError
from rabbit_delay.topology import Topology, load_topology
from rabbit_delay.urls import URL_ENV, broker_urls, redact

app = typer.Typer(
    name="rabbit-delay",
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

TOPOLOGY_ENV = "RABBIT_DELAY_TOPOLOGY"
DEFAULT_TOPOLOGY = Path("topology")

# Exit codes (plan: 0 in sync, 2 changes pending, 1 error).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_PENDING = 2

TopologyArg = Annotated[
    Path | None,
    typer.Argument(
        help=f"Topology TOML file (default: ${TOPOLOGY_ENV}, else the only *.toml in ./topology).",
        show_default=False,
    ),
]
# The one way every command takes the topology file (plan, declare, status and delete
# also take it as their argument).
TopologyOpt = Annotated[
    Path | None,
    typer.Option(
        "--topology",
        "-f",
        help=f"Topology TOML file (default: ${TOPOLOGY_ENV}, else the only *.toml in ./topology).",
        show_default=False,
    ),
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
    bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")
]


def resolve_topology(path: Path | None) -> Topology:
    chosen = path or Path(os.environ.get(TOPOLOGY_ENV) or DEFAULT_TOPOLOGY)
    return load_topology(chosen)


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    err.print("[bold red]error:[/] ", end="", markup=True)
    # the message quotes user input: never read it as markup ("[bold]" would vanish)
    err.print(redact(message), markup=False)
    raise typer.Exit(code)


@contextmanager
def errors_to_exit() -> Iterator[None]:
    """Every library error becomes one redacted line on stderr and exit code 1; a broker
    that cannot be reached is named by its cause (login, vhost, port, host name)."""
    try:
        yield
    except RabbitDelayError as exc:
        text = describe_unavailable(exc) if isinstance(exc, BrokerUnavailable) else str(exc)
        err.print("[bold red]error:[/] ", end="", markup=True)
        err.print(redact(text), markup=False)
        raise typer.Exit(EXIT_ERROR) from None


def print_json(data: Any) -> None:
    sys.stdout.write(redact(json.dumps(data, indent=2, default=str)) + "\n")


def url_for(url: Sequence[str] | None) -> tuple[str, ...]:
    """The broker URLs to try, in order. Raises ConfigError for a malformed list."""
    return broker_urls(url)


def main() -> None:
    # Commands live in their own modules; importing them registers them on `app`.
    load_commands()
    app()


def load_commands() -> None:
    """Import the command modules (each registers its commands on `app`)."""
    from rabbit_delay.cli import commands, delete, ops, parked, worker  # noqa: F401  # noqa: F401
