"""The `rabbit-delay` typer app: the root options (`--version`) and every command,
registered here explicitly, in the order `rabbit-delay --help` lists them.

Each command lives in the module named after it; what they share (options, output,
errors, exit codes) is `rabbit_delay._cli.options`. Nothing but `rabbit_delay._cli`,
`python -m rabbit_delay` and the `rabbit-delay` console script imports this module.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Annotated

import typer

from rabbit_delay._cli.asyncapi import asyncapi_command
from rabbit_delay._cli.dashboard import dashboard
from rabbit_delay._cli.declare import declare, plan
from rabbit_delay._cli.delete import delete
from rabbit_delay._cli.hold import hold
from rabbit_delay._cli.options import EXIT_OK, CommandGroup, out
from rabbit_delay._cli.parked import parked_app
from rabbit_delay._cli.permissions import permissions_command
from rabbit_delay._cli.publish import publish
from rabbit_delay._cli.reconcile import reconcile
from rabbit_delay._cli.relay import relay
from rabbit_delay._cli.replay import replay
from rabbit_delay._cli.scheduled import scheduled_app
from rabbit_delay._cli.status import status
from rabbit_delay._cli.transfer import transfer_command
from rabbit_delay._cli.worker import worker

DIST_NAME = "rabbit-delay"

app = typer.Typer(
    name="rabbit-delay",
    cls=CommandGroup,
    help=(
        "Reliable delayed delivery on RabbitMQ: declare TTL tiers, publish delayed messages, "
        "run workers."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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


app.command()(plan)
app.command()(declare)
app.command()(publish)
app.command("permissions")(permissions_command)
app.command("asyncapi")(asyncapi_command)
app.command()(worker)
app.command()(dashboard)
app.command()(hold)
app.command()(delete)
app.command()(status)
app.command()(replay)
app.command()(reconcile)
app.command()(relay)
app.command("transfer")(transfer_command)
app.add_typer(parked_app)
app.add_typer(scheduled_app)


def main() -> None:
    app()


__all__ = ["app", "main", "package_version"]
