"""`rabbit-delay replay`: move parked messages back to their business queue, or the
catch-all's to their original target (the copies: rabbit_delay._ops.replay.rules; the
moving: rabbit_delay._ops.replay.execute)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

import rabbit_delay._cli.options as opt
from rabbit_delay._urls import redact

if TYPE_CHECKING:
    from rabbit_delay._ops.replay.rules import Moved, Preview


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
            opt.count_cell(s["attempts"] if isinstance(s["attempts"], int) else None),
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
    if not (wanted and opt.out.is_terminal):
        yield None
        return
    total = held() if limit is None else min(limit, held())
    if not shows_progress(opt.out.is_terminal, wanted, total):
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=opt.out, transient=True) as bar:
        task = bar.add_task(escape(f"replaying from {source}"), total=total)
        yield lambda _moved: bar.advance(task)


# `replay --dry-run` used to peek through the management API, which puts messages back
# out of order (rabbit_delay._ops.queues.REQUEUE_BATCH); it reads over AMQP now. The options stay
# accepted, hidden and without effect, so scripts that pass them keep working.
_UnusedMgmtOpt = Annotated[
    str | None, typer.Option("--management-url", hidden=True, show_default=False)
]
_UnusedNoMgmtOpt = Annotated[bool, typer.Option("--no-management", hidden=True)]


def replay(
    queue: Annotated[
        str | None,
        typer.Argument(
            help="Business queue (logical name) whose parking lot to replay; with "
            "--unroutable, only catch-all messages for this queue.",
            show_default=False,
        ),
    ] = None,
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
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
    url: opt.UrlOpt = None,
    management_url: _UnusedMgmtOpt = None,
    no_management: _UnusedNoMgmtOpt = False,
    as_json: opt.JsonOpt = False,
) -> None:
    """Move parked messages back to their business queue as first attempts (rd-attempt 1).

    Each copy is confirmed by the broker before the parked message is acked.
    On a failure the message stays parked and the command stops with exit code 1.
    """
    from rabbit_delay._ops.queues import queue_counts
    from rabbit_delay._ops.replay.execute import (
        preview_parked,
        preview_unroutable,
        replay_parked,
        replay_unroutable,
    )
    from rabbit_delay._ops.replay.rules import resolve_queue
    from rabbit_delay.sync import connected

    if tier is not None and now:
        opt.fail("give either --tier or --now, not both")
    if message_id is not None and (unroutable or dry_run or limit is not None):
        opt.fail(
            "--message-id replays one parked message: not with --unroutable, --dry-run or "
            "--limit (`rabbit-delay parked show QUEUE ID` shows it)"
        )
    if unroutable:
        if tier is not None:
            opt.fail("--tier does not apply to --unroutable: catch-all messages are already due")
        if queue is not None and file is None and topology_file is None and _looks_like_file(queue):
            file, queue = Path(queue), None
    elif queue is None or (file is None and topology_file is None and _looks_like_file(queue)):
        opt.fail(
            "name the QUEUE whose parking lot to replay, or pass --unroutable for the catch-all"
        )

    with opt.errors_to_exit():
        topology = opt.resolve_topology(file, topology_file)
        with connected(opt.url_for(url), name="rabbit-delay replay") as connection:
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
                    counts = queue_counts(connection, source)
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

    if dry_run:
        if as_json:
            opt.print_json(_preview_json(preview))
        else:
            opt.out.print(_preview_table(preview))
            moving = sum(1 for p in preview.messages if p.moves)
            shown = len(preview.messages)
            more = f" (showing {shown} of {preview.held})" if shown < preview.held else ""
            opt.out.print(f"would move {moving} message(s){escape(more)}; nothing was changed")
        raise typer.Exit(opt.EXIT_OK)

    if as_json:
        opt.print_json(report.as_json())
    else:
        moved = f"moved {len(report.moved)} message(s) from {report.source} to {report.destination}"
        opt.out.print(escape(moved))
        for message_id, why in report.left:
            opt.err.print("[yellow]left in place:[/] ", end="")
            opt.err.print(redact(f"{message_id}: {why}"), markup=False)
    opt.exit_on_failure(report.error, as_json=as_json)
    if message_id is not None and not report.moved:
        nothing = f"no message with id {message_id!r} in {report.source}: nothing was replayed"
        opt.exit_on_failure(nothing, as_json=as_json)
    raise typer.Exit(opt.EXIT_OK)


__all__ = ["PROGRESS_MIN", "replay", "shows_progress"]
