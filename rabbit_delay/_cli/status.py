"""`rabbit-delay status`: what is waiting where, and what needs a human.

What the rows mean and what needs attention is decided in rabbit_delay._ops.status.rules;
this module reads (rabbit_delay._ops.status.execute) and renders."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import rabbit_delay._cli.options as opt
from rabbit_delay._durations import format_ms, iso_ms, parse_positive_ms
from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import RabbitDelayError
from rabbit_delay._ops.status.rules import (
    QueueRow,
    Status,
    oldest_cell,
    placement_cells,
    shows_placement,
)
from rabbit_delay._stop_signals import install_stop_signals
from rabbit_delay._urls import redact

# Something needs a human: a missing object, messages in a parking lot or the catch-all, a
# consumer on a delay buffer, a stuck buffer, a quorum queue without a majority.
EXIT_ATTENTION = 3
# `status --watch` refreshes this often unless --interval says otherwise.
WATCH_INTERVAL = "2s"


def _status_table(title: str, rows: list[QueueRow]) -> Table:
    table = Table(title=title, title_justify="left")
    placement = shows_placement(rows)
    table.add_column("role")
    table.add_column("queue", overflow="fold")
    table.add_column("ttl", justify="right")
    table.add_column("ready", justify="right")
    table.add_column("unacked", justify="right")
    table.add_column("consumers", justify="right")
    table.add_column("oldest", justify="right")
    if placement:
        table.add_column("leader", overflow="fold")
        table.add_column("members", justify="right")
    table.add_column("notes", overflow="fold")
    for row in rows:
        style = "bold red" if row.attention else ""
        notes = escape("; ".join(row.notes))
        cells = [
            row.role.value,
            escape(row.name),
            format_ms(row.ttl_ms) if row.ttl_ms is not None else "",
            opt.count_cell(row.ready),
            opt.count_cell(row.unacked),
            opt.count_cell(row.consumers),
            oldest_cell(row),
        ]
        if placement:
            cells += [escape(cell) for cell in placement_cells(row)]
        cells.append(f"[{style}]{notes}[/]" if style and notes else notes)
        table.add_row(*cells, style=None)
    return table


def _title(status: Status) -> str:
    if status.broker_description is not None:
        described = f" ({status.broker_description})"
    elif status.broker_version is not None:
        described = f" (RabbitMQ {status.broker_version}, from the management API)"
    else:
        described = ""
    return f"status of {status.namespace} on {redact(status.broker)}{described}"


def render_status(status: Status) -> Group:
    """The table and the lines under it, as `status` prints them."""
    parts: list[RenderableType] = [_status_table(escape(_title(status)), status.rows)]
    parts += [Text(redact(note)) for note in status.notes]
    if status.plugin is not None:
        held = opt.count_cell(status.plugin.delayed)
        parts.append(Text(f"plugin store ({status.plugin.exchange}): {held} message(s) delayed"))
    items = status.attention_items()
    for item in items:
        line = redact(f"{item.subject}: {item.hint}")
        parts.append(Text.assemble(("needs attention: ", "bold red"), line))
    if not items:
        parts.append(Text("nothing needs attention", style="green"))
    return Group(*parts)


def _watch(read: Callable[[], Status], interval_ms: int) -> None:
    """Re-read and re-render until Ctrl-C (or SIGTERM); a broker that stops answering is
    shown in place (and the next refresh tries again).

    The signal only sets a flag, checked between reads: a KeyboardInterrupt raised in
    the middle of pika can leave a connection that `close()` waits on forever, or one
    half open. A read ends within its connection timeouts; a second Ctrl-C interrupts
    at once, as usual."""
    every = format_ms(interval_ms)
    stop = threading.Event()

    def on_signal(_name: str) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # the second one: do not wait for the read
        stop.set()

    restore = install_stop_signals(on_signal)
    try:
        with Live(console=opt.out, auto_refresh=False) as live:
            while not stop.is_set():
                try:
                    view: RenderableType = render_status(read())
                except RabbitDelayError as exc:
                    view = Text.assemble(("error: ", "bold red"), redact(str(exc)))
                when = iso_ms(now_ms())
                footer = Text(f"refreshed {when}, every {every}; Ctrl-C to stop", style="dim")
                live.update(Group(view, footer), refresh=True)
                stop.wait(interval_ms / 1000)
    finally:
        restore()


def status(
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    management_url: opt.MgmtOpt = None,
    no_management: opt.NoMgmtOpt = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help=f"Exit {EXIT_ATTENTION} when something needs a human: an object of the "
            "topology is missing, a parking lot or the catch-all holds messages, a delay "
            "buffer has consumers or is stuck, or a quorum queue has lost the majority of "
            "its members (for monitoring scripts).",
        ),
    ] = False,
    watch: Annotated[
        bool,
        typer.Option("--watch", "-w", help="Refresh the table until Ctrl-C (not with --json)."),
    ] = False,
    interval: Annotated[
        str | None,
        typer.Option(
            "--interval",
            help=f"How often --watch refreshes (a duration, default {WATCH_INTERVAL}).",
            show_default=False,
        ),
    ] = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Every queue of the topology with its messages (ready / unacked) and consumers,
    the age of each buffer's oldest message, and what needs attention.

    Ready messages and consumers: live, from passive declares; so is whether each
    exchange exists. Unacked messages: from the management API, sampled every few
    seconds ('?' without it). A buffer's oldest message: peeked (basic.get, requeue)
    where that is safe (not on RabbitMQ 4.0-4.2 quorum queues). In a cluster, each
    quorum queue's leader and members online (management API).
    Exit code 0; 3 with --check when something needs a human; 1 on error.
    """
    from rabbit_delay._ops.status.execute import read_status
    from rabbit_delay._ops.status.rules import DEAD_LETTER_RECHECK_S

    if watch and as_json:
        opt.fail("--watch redraws a table for people; --json is for scripts: give one of them")
    if watch and check:
        opt.fail("--watch runs until Ctrl-C; --check is for scripts that read the exit code")
    if interval is not None and not watch:
        opt.fail("--interval applies to --watch only")
    with opt.errors_to_exit():
        every = parse_positive_ms(interval or WATCH_INTERVAL)
        topology = opt.resolve_topology(file, topology_file)
        urls = opt.url_for(url)

        def read() -> Status:
            return read_status(
                topology,
                urls,
                management_url=management_url,
                no_management=no_management,
                # --watch refreshes every few seconds: it shows pending dead letters again
                recheck_s=0 if watch else DEAD_LETTER_RECHECK_S,
            )

        if watch:
            with suppress(KeyboardInterrupt):  # a second Ctrl-C during a read
                _watch(read, every)
            raise typer.Exit(opt.EXIT_OK)
        found = read()
    opt.print_result(found, as_json, lambda status: opt.out.print(render_status(status)))
    raise typer.Exit(EXIT_ATTENTION if check and found.attention else opt.EXIT_OK)


__all__ = ["EXIT_ATTENTION", "render_status", "status"]
