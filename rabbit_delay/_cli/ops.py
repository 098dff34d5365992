"""status and replay: what is waiting where, and moving parked messages back.

What the rows mean and what needs attention is decided in rabbit_delay._ops.status.rules;
this module reads (rabbit_delay._ops.status.execute) and renders."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from rabbit_delay._cli.app import (
    EXIT_ERROR,
    EXIT_OK,
    JsonOpt,
    TopologyArg,
    TopologyOpt,
    UrlOpt,
    app,
    err,
    errors_to_exit,
    fail,
    out,
    print_json,
    resolve_topology,
    url_for,
)
from rabbit_delay._cli.commands import MgmtOpt, NoMgmtOpt
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

if TYPE_CHECKING:
    from rabbit_delay._ops.replay.rules import Moved, Preview

# Something needs a human: a missing object, messages in a parking lot or the catch-all, a
# consumer on a delay buffer, a stuck buffer, a quorum queue without a majority.
EXIT_ATTENTION = 3
# `status --watch` refreshes this often unless --interval says otherwise.
WATCH_INTERVAL = "2s"


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)


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
            _cell(row.ready),
            _cell(row.unacked),
            _cell(row.consumers),
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
        held = _cell(status.plugin.delayed)
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
        with Live(console=out, auto_refresh=False) as live:
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


@app.command()
def status(
    file: TopologyArg = None,
    topology_file: TopologyOpt = None,
    url: UrlOpt = None,
    management_url: MgmtOpt = None,
    no_management: NoMgmtOpt = False,
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
    as_json: JsonOpt = False,
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

    if watch and as_json:
        fail("--watch redraws a table for people; --json is for scripts: give one of them")
    if watch and check:
        fail("--watch runs until Ctrl-C; --check is for scripts that read the exit code")
    if interval is not None and not watch:
        fail("--interval applies to --watch only")
    with errors_to_exit():
        every = parse_positive_ms(interval or WATCH_INTERVAL)
        topology = resolve_topology(file, topology_file)
        urls = url_for(url)

        def read() -> Status:
            return read_status(
                topology, urls, management_url=management_url, no_management=no_management
            )

        if watch:
            with suppress(KeyboardInterrupt):  # a second Ctrl-C during a read
                _watch(read, every)
            raise typer.Exit(EXIT_OK)
        found = read()
    if as_json:
        print_json(found.as_json())
    else:
        out.print(render_status(found))
    raise typer.Exit(EXIT_ATTENTION if check and found.attention else EXIT_OK)


# -- replay -----------------------------------------------------------------------------


def _looks_like_file(text: str) -> bool:
    return text.endswith(".toml") or Path(text).exists()


def _preview_json(preview: Preview) -> dict[str, Any]:
    return {
        "dry_run": True,
        "source": preview.source,
        "destination": preview.destination,
        "held": preview.held,
        "via": preview.via,
        "would_move": sum(1 for p in preview.messages if p.moves),
        "messages": [p.message.summary() | {"action": p.action} for p in preview.messages],
    }


def _preview_table(preview: Preview) -> Table:
    title = f"dry run: {preview.source} -> {preview.destination} (read via {preview.via})"
    table = Table(title=escape(title), title_justify="left")
    for column in ("message_id", "error", "attempts", "reason", "parked at", "would go to"):
        table.add_column(column, overflow="fold")
    for p in preview.messages:
        s = p.message.summary()
        error = ": ".join(str(s[k]) for k in ("error_type", "error_message") if s[k] is not None)
        action = escape(p.action) if p.moves else f"[yellow]{escape(p.action)}[/]"
        table.add_row(
            escape(str(s["message_id"])),
            escape(error[:200]),
            _cell(s["attempts"] if isinstance(s["attempts"], int) else None),
            escape(str(s["park_reason"] or "")),
            escape(str(s["parked_at"] or "")),
            action,
        )
    return table


# A replay of fewer messages than this is over before a bar would tell anything.
PROGRESS_MIN = 50


def shows_progress(is_terminal: bool, wanted: bool, total: int) -> bool:
    """A progress bar for people watching a long run: on a terminal, not under --json,
    for at least PROGRESS_MIN messages."""
    return is_terminal and wanted and total >= PROGRESS_MIN


@contextmanager
def _progress(
    source: str, held: Callable[[], int], limit: int | None, *, wanted: bool
) -> Iterator[Callable[[Moved], None] | None]:
    """A callback advancing a rich progress bar (on stdout, gone when done) over the
    messages a replay from `source` moves at most (`held()` counts them, asked only
    when a bar may be shown); None when no bar is shown."""
    if not (wanted and out.is_terminal):
        yield None
        return
    total = held() if limit is None else min(limit, held())
    if not shows_progress(out.is_terminal, wanted, total):
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=out, transient=True) as bar:
        task = bar.add_task(escape(f"replaying from {source}"), total=total)
        yield lambda _moved: bar.advance(task)


# `replay --dry-run` used to peek through the management API, which puts messages back
# out of order (sync.replay.REQUEUE_BATCH); it reads over AMQP now. The options stay
# accepted, hidden and without effect, so scripts that pass them keep working.
_UnusedMgmtOpt = Annotated[
    str | None, typer.Option("--management-url", hidden=True, show_default=False)
]
_UnusedNoMgmtOpt = Annotated[bool, typer.Option("--no-management", hidden=True)]


@app.command()
def replay(
    queue: Annotated[
        str | None,
        typer.Argument(
            help="Business queue (logical name) whose parking lot to replay; with "
            "--unroutable, only catch-all messages for this queue.",
            show_default=False,
        ),
    ] = None,
    file: TopologyArg = None,
    topology_file: TopologyOpt = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", "-n", min=1, help="Move at most N messages.", show_default=False),
    ] = None,
    tier: Annotated[
        str | None,
        typer.Option("--tier", "-t", help="Replay after this delay tier instead of at once."),
    ] = None,
    now: Annotated[
        bool, typer.Option("--now", help="Replay at once, through the due exchange (default).")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="List what would be replayed; every message stays put."),
    ] = False,
    unroutable: Annotated[
        bool,
        typer.Option(
            "--unroutable",
            help="Re-route the catch-all's messages to their original target instead.",
        ),
    ] = False,
    message_id: Annotated[
        str | None,
        typer.Option(
            "--message-id",
            help="Replay only the (oldest) parked message with this id; the others stay, in "
            "their order. Exit code 1 when no parked message has it.",
            show_default=False,
        ),
    ] = None,
    url: UrlOpt = None,
    management_url: _UnusedMgmtOpt = None,
    no_management: _UnusedNoMgmtOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Move parked messages back to their business queue as first attempts (rd-attempt 1).

    Each copy is confirmed by the broker before the parked message is acked.
    On a failure the message stays parked and the command stops with exit code 1.
    """
    from rabbit_delay._ops.queues import passive_counts
    from rabbit_delay._ops.replay.execute import (
        preview_parked,
        preview_unroutable,
        replay_parked,
        replay_unroutable,
    )
    from rabbit_delay._ops.replay.rules import resolve_queue
    from rabbit_delay.sync._connection import close_quietly, connect_first

    if tier is not None and now:
        fail("give either --tier or --now, not both")
    if message_id is not None and (unroutable or dry_run or limit is not None):
        fail(
            "--message-id replays one parked message: not with --unroutable, --dry-run or "
            "--limit (`rabbit-delay parked show QUEUE ID` shows it)"
        )
    if unroutable:
        if tier is not None:
            fail("--tier does not apply to --unroutable: catch-all messages are already due")
        if queue is not None and file is None and topology_file is None and _looks_like_file(queue):
            file, queue = Path(queue), None
    elif queue is None or (file is None and topology_file is None and _looks_like_file(queue)):
        fail("name the QUEUE whose parking lot to replay, or pass --unroutable for the catch-all")

    with errors_to_exit():
        topology = resolve_topology(file, topology_file)
        connection, _ = connect_first(url_for(url), name="rabbit-delay replay")
        try:
            if dry_run:
                if unroutable:
                    preview = preview_unroutable(connection, topology, queue=queue, limit=limit)
                else:
                    assert queue is not None
                    preview = preview_parked(connection, topology, queue, tier=tier, limit=limit)
            else:
                source = (
                    topology.names.unroutable_queue()
                    if queue is None or unroutable
                    else topology.names.parking_queue(resolve_queue(topology, queue))
                )

                def held() -> int:
                    counts = passive_counts(connection, [source])[source]
                    return (counts.ready or 0) if counts is not None else 0

                with _progress(source, held, limit, wanted=not as_json) as advance:
                    if unroutable:
                        report = replay_unroutable(
                            connection, topology, queue=queue, limit=limit, progress=advance
                        )
                    else:
                        assert queue is not None
                        report = replay_parked(
                            connection,
                            topology,
                            queue,
                            tier=tier,
                            limit=limit,
                            progress=advance,
                            message_id=message_id,
                        )
        finally:
            close_quietly(connection)

    if dry_run:
        if as_json:
            print_json(_preview_json(preview))
        else:
            out.print(_preview_table(preview))
            moving = sum(1 for p in preview.messages if p.moves)
            shown = len(preview.messages)
            more = f" (showing {shown} of {preview.held})" if shown < preview.held else ""
            out.print(f"would move {moving} message(s){escape(more)}; nothing was changed")
        raise typer.Exit(EXIT_OK)

    if as_json:
        print_json(report.as_json())
    else:
        moved = f"moved {len(report.moved)} message(s) from {report.source} to {report.destination}"
        out.print(escape(moved))
        for message_id, why in report.left:
            err.print("[yellow]left in place:[/] ", end="")
            err.print(redact(f"{message_id}: {why}"), markup=False)
    if report.error is not None:
        if as_json:
            raise typer.Exit(EXIT_ERROR)
        fail(report.error)
    if message_id is not None and not report.moved:
        if as_json:
            raise typer.Exit(EXIT_ERROR)
        fail(f"no message with id {message_id!r} in {report.source}: nothing was replayed")
    raise typer.Exit(EXIT_OK)


__all__ = [
    "EXIT_ATTENTION",
    "PROGRESS_MIN",
    "render_status",
    "replay",
    "shows_progress",
    "status",
]
