"""`rabbit-delay parked list|show|purge QUEUE`: what waits in a parking lot.

Listing and showing peek (nothing is moved, the order is kept): rabbit_delay._ops.parked.execute
reads, rabbit_delay._ops.parked.rules decides what is shown. Moving messages back is
`rabbit-delay replay QUEUE`.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

import rabbit_delay._cli.options as opt
from rabbit_delay._ops.parked.rules import DEFAULT_LIMIT, ParkedDetail, ParkedPage
from rabbit_delay._urls import redact

parked_app = typer.Typer(
    name="parked",
    help="List, show and purge the messages parked for a business queue.",
    no_args_is_help=True,
)

QueueArg = Annotated[
    str,
    typer.Argument(
        help="Business queue (logical name, or its business-queue or parking-lot name).",
        show_default=False,
    ),
]


def _cell(value: object) -> str:
    return "" if value is None else escape(str(value))


def _page_table(p: ParkedPage) -> Table:
    table = Table(title=escape(f"parked for {p.queue} ({p.parking_queue})"), title_justify="left")
    table.add_column("#", justify="right")
    for column in ("message_id", "reason", "error", "attempts", "first failure", "last failure"):
        table.add_column(column, overflow="fold")
    for item in p.items:
        error = ": ".join(x for x in (item.error_type, item.error_message) if x is not None)
        table.add_row(
            str(item.position),
            _cell(item.message_id),
            _cell(item.reason),
            escape(error[:200]),
            _cell(item.attempts),
            _cell(item.first_failure),
            _cell(item.last_failure or item.parked_at),
        )
    return table


def _print_page(p: ParkedPage) -> None:
    if p.items:
        opt.out.print(_page_table(p))
    opt.out.print(escape(_summary_line(p)))


def _summary_line(p: ParkedPage) -> str:
    if not p.total:
        return f"{p.parking_queue} is empty"
    if not p.items:
        return f"no message at position {p.offset}: {p.parking_queue} holds {p.total}"
    first, last = p.items[0].position, p.items[-1].position
    line = f"messages {first}-{last} of {p.total} (0 = the oldest)"
    if p.next_offset is not None:
        line += f"; next page: --offset {p.next_offset}"
    return line


@parked_app.command("list")
def list_command(
    queue: QueueArg,
    file: opt.TopologyOpt = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, help="Show at most N messages.")
    ] = DEFAULT_LIMIT,
    offset: Annotated[
        int,
        typer.Option("--offset", min=0, help="Start at this position (0 = the oldest message)."),
    ] = 0,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """List parked messages, oldest first: message id, reason, error type and message,
    attempts, first and last failure. Nothing is moved and the order is kept."""
    from rabbit_delay._ops.parked.execute import list_parked
    from rabbit_delay.sync import connected

    with opt.errors_to_exit():
        topology = opt.resolve_topology(file)
        with connected(opt.url_for(url), name="rabbit-delay parked list") as connection:
            found = list_parked(connection, topology, queue, offset=offset, limit=limit)
    opt.print_result(found, as_json, _print_page)
    raise typer.Exit(opt.EXIT_OK)


def _print_detail(d: ParkedDetail, total: int) -> None:
    item = d.item
    opt.out.print(
        escape(f"message {item.message_id} (position {item.position} of {total})"), style="bold"
    )
    error = ": ".join(x for x in (item.error_type, item.error_message) if x is not None)
    for label, value in (
        ("reason", item.reason),
        ("error", error or None),
        ("attempts", item.attempts),
        ("first failure", item.first_failure),
        ("last failure", item.last_failure),
        ("parked at", item.parked_at),
        ("original queue", item.original_queue),
        ("target", item.target),
        ("content type", d.content_type),
        ("published at", d.timestamp),
        ("last exchange", f"{d.exchange} [{d.routing_key}]"),
    ):
        if value is not None:
            opt.out.print(f"  {label}: ", end="")
            opt.out.print(redact(str(value)), markup=False, highlight=False)
    opt.out.print("headers:", style="bold")
    for name, value in d.headers.items():
        opt.out.print(f"  {name}: ", end="", markup=False)
        opt.out.print(redact(repr(value) if not isinstance(value, str) else value), markup=False)
    if d.traceback is not None:
        opt.out.print("traceback:", style="bold")
        opt.out.print(d.traceback, markup=False)
    opt.out.print(f"body ({d.body.size} bytes, shown as {d.body.encoding}):", style="bold")
    opt.out.print(d.body.text, markup=False)


@parked_app.command("show")
def show_command(
    queue: QueueArg,
    message_id: Annotated[str, typer.Argument(help="The message_id of the parked message.")],
    file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Show one parked message in full: every header, the traceback and the body
    (pretty-printed JSON, text, or base64 for binary). Nothing is moved.

    Exit code 1 when no message of the lot has this id.
    """
    from rabbit_delay._ops.parked.execute import show_parked
    from rabbit_delay._ops.parked.rules import parking_lot
    from rabbit_delay.sync import connected

    with opt.errors_to_exit():
        topology = opt.resolve_topology(file)
        _, lot = parking_lot(topology, queue)
        with connected(opt.url_for(url), name="rabbit-delay parked show") as connection:
            total, copies = show_parked(connection, topology, queue, message_id)
    if not copies:
        opt.fail(
            f"no message with id {message_id!r} in {lot} ({total} message(s) there; "
            f"`rabbit-delay parked list {queue}` lists them)",
            kind="MessageNotFound",
        )
    if as_json:
        opt.print_json(
            {
                "parking_queue": lot,
                "message_id": message_id,
                "total": total,
                "copies": [d.as_json() for d in copies],
            }
        )
        raise typer.Exit(opt.EXIT_OK)
    for i, d in enumerate(copies):
        if i:
            opt.out.print()
        _print_detail(d, total)
    if len(copies) > 1:
        opt.out.print(f"{len(copies)} messages with this id (at-least-once: a copy parked twice)")
    raise typer.Exit(opt.EXIT_OK)


@parked_app.command("purge")
def purge_command(
    queue: QueueArg,
    file: opt.TopologyOpt = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Purge without asking (needed without a terminal).")
    ] = False,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Delete every message parked for QUEUE: they cannot be recovered. Asks first
    unless --yes. Exit code 1 when not confirmed (nothing purged)."""
    from rabbit_delay._ops.parked.execute import parked_count, purge_parked
    from rabbit_delay._ops.parked.rules import parking_lot
    from rabbit_delay.sync import connected

    with opt.errors_to_exit():
        topology = opt.resolve_topology(file)
        _, lot = parking_lot(topology, queue)
        with connected(opt.url_for(url), name="rabbit-delay parked purge") as connection:
            counted = parked_count(connection, topology, queue)
            purged = 0
            if counted:
                if not yes:
                    if not sys.stdin.isatty():
                        opt.fail(
                            f"{lot} holds {counted} message(s); not asking without a terminal "
                            "(stdin is not one): pass --yes to purge them. Nothing was purged"
                        )
                    question = f"Purge {counted} message(s) from {lot}? They cannot be recovered"
                    if not typer.confirm(question, default=False, err=True):
                        opt.err.print("nothing was purged")
                        raise typer.Exit(opt.EXIT_ERROR)
                purged = purge_parked(connection, topology, queue)
    if as_json:
        opt.print_json({"parking_queue": lot, "counted": counted, "purged": purged})
    elif not counted:
        opt.out.print(escape(f"{lot} is empty: nothing to purge"))
    else:
        opt.out.print(escape(f"purged {purged} message(s) from {lot}"))
        if purged != counted:
            opt.out.print(
                escape(f"({counted} were there when counted: the lot changed in between)")
            )
    raise typer.Exit(opt.EXIT_OK)


__all__ = ["list_command", "parked_app", "purge_command", "show_command"]
