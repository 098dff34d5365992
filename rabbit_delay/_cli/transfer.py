"""transfer: move the pending messages of a topology to another topology or broker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import rabbit_delay._cli.options as opt
from rabbit_delay._durations import format_ms, iso_ms
from rabbit_delay._ops.transfer.rules import (
    DEFAULT_TRANSFER_BATCH,
    QueueTally,
    Transfer,
    TransferReport,
)
from rabbit_delay._topology.model import load_topology
from rabbit_delay._urls import redact

ToOpt = Annotated[
    Path | None,
    typer.Option(
        "--to",
        help="Target topology TOML file (default: the source topology, for a move to "
        "another broker with --to-url).",
        show_default=False,
    ),
]
ToUrlOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--to-url",
        help="Target broker URL(s), the same syntax as --url (default: the source broker).",
        show_default=False,
    ),
]


@contextmanager
def _progress_bar(shown: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar (messages moved / expected) on stderr, when it is a terminal."""
    if not shown:
        yield None
        return
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=opt.err,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(moved: int, expected: int) -> None:
            bar.update(task, completed=moved, total=expected)

        yield update


def _row_shown(q: QueueTally) -> bool:
    return bool(q.ready or q.moved or q.left or (q.skipped and q.ready is not None))


def _table(report: TransferReport) -> Table:
    moved = "would move" if report.dry_run else "moved"
    title = f"{'dry run: ' if report.dry_run else ''}{report.source} -> {report.target}"
    table = Table(title=escape(title), title_justify="left")
    for column in ("queue", "role"):
        table.add_column(column, overflow="fold")
    for column in ("ready", moved, "left"):
        table.add_column(column, justify="right")
    for column in ("goes to", "late by (max)", "last due"):
        table.add_column(column, overflow="fold")
    for q in report.queues:
        if not _row_shown(q):
            continue
        goes = "; ".join(f"{dest}: {n}" for dest, n in q.destinations.most_common(3))
        if len(q.destinations) > 3:
            goes += f"; {len(q.destinations) - 3} more"
        left = str(q.left_count) if q.left_count else ""
        table.add_row(
            escape(q.source.name),
            q.source.kind.value,
            opt.count_cell(q.ready),
            str(q.moved),
            f"[yellow]{left}[/]" if left else "",
            escape(goes or (q.skipped or "")),
            format_ms(q.added_max_ms) if q.moved else "",
            iso_ms(q.last_due_ms) or "",
        )
    return table


def _print_report(report: TransferReport) -> None:
    opt.out.print(_table(report))
    missing = [q.source.name for q in report.queues if q.ready is None]
    if missing:
        opt.out.print(escape(f"{len(missing)} source queue(s) do not exist: {', '.join(missing)}"))
    verb = "would move" if report.dry_run else "moved"
    line = f"{verb} {report.moved} message(s) from {report.source} to {report.target}"
    if not report.dry_run:
        line += f" in {report.elapsed_s:.1f} s ({report.rate:,.0f} msg/s, {report.passes} round(s))"
    opt.out.print(escape(line))
    if report.moved:
        if report.later:
            opt.out.print(
                escape(
                    f"lateness added by the target's route: {report.later} of {report.moved} "
                    f"later than due, by at most {format_ms(report.added_max_ms)} "
                    f"(mean {format_ms(round(report.added_mean_ms))})"
                )
            )
        else:
            opt.out.print("lateness added: none (every due time kept exactly)")
        if report.overdue_max_ms:
            opt.out.print(
                escape(
                    "some were due already when read (moved to be delivered now): the most "
                    f"overdue by {format_ms(report.overdue_max_ms)}"
                )
            )
    for line in report.left_lines():
        opt.err.print("[yellow]left in place:[/] ", end="")
        opt.err.print(redact(line), markup=False)
    if report.pending_after:
        still = ", ".join(
            f"{q.source.name}: {q.pending_after}" for q in report.queues if q.pending_after
        )
        if report.limit_reached:
            opt.out.print(escape(f"--limit {report.limit} reached; still in the source: {still}"))
        else:
            opt.err.print("[yellow]still in the source:[/] ", end="")
            opt.err.print(f"{report.pending_after} ({still}); run transfer again", markup=False)
    if report.people:
        held = ", ".join(f"{name}: {n}" for name, n in report.people.items())
        opt.err.print("[yellow]not moved (they wait for a human):[/] ", end="")
        opt.err.print(
            f"{held}; replay them (`rabbit-delay replay`) before retiring the source",
            markup=False,
        )
    for note in report.notes:
        opt.out.print(f"[cyan]note:[/] {escape(note)}")
    if report.dry_run:
        opt.out.print("dry run: nothing was changed (every message read was given back)")


def transfer_command(
    file: opt.TopologyOpt = None,
    to: ToOpt = None,
    url: opt.UrlOpt = None,
    to_url: ToUrlOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Read every pending message and give it back: what would move where, "
            "how late; nothing is published or acked.",
        ),
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option("--limit", "-n", min=1, help="Move at most N messages.", show_default=False),
    ] = None,
    ready: Annotated[
        bool,
        typer.Option(
            "--ready/--no-ready",
            help="Also move the ready (due) messages of business queues that have no consumers.",
        ),
    ] = True,
    batch: Annotated[
        int,
        typer.Option(
            "--batch", min=1, max=65_535, help="Messages read, published and acked at a time."
        ),
    ] = DEFAULT_TRANSFER_BATCH,
    as_json: opt.JsonOpt = False,
) -> None:
    """Move pending messages to another topology (--to) or broker (--to-url).

    Reads the tier buffers, the cascade levels and the ready messages nobody consumes.

    Each copy keeps its message_id, headers and due time (rd-due-at).

    It waits what remains: exactly with a cascade, else in the shortest tier not shorter.

    Every copy is confirmed before its original is acked; a re-run after a crash finishes the job.

    The delayed-message plugin's pending messages cannot be read (docs/transfer.md).

    Exit code 0 when everything moved; 1 on an error or when messages were left in place.
    """
    from rabbit_delay._ops.transfer.execute import transfer
    from rabbit_delay.sync import Publisher, connected

    with opt.errors_to_exit():
        source = opt.resolve_topology(file)
        target = load_topology(to) if to is not None else source
        urls = opt.url_for(url)
        to_urls = opt.url_for(to_url) if to_url else urls
        rules = Transfer(source, target)
        with connected(urls, name="rabbit-delay transfer") as connection:
            publisher = Publisher(target, list(to_urls), window=batch)
            try:
                shown = opt.err.is_terminal and not as_json
                with _progress_bar(shown, "reading" if dry_run else "moving") as progress:
                    report = transfer(
                        connection,
                        publisher,
                        rules,
                        dry_run=dry_run,
                        limit=limit,
                        ready=ready,
                        batch=batch,
                        progress=progress,
                    )
            finally:
                publisher.close()

    opt.print_result(report, as_json, _print_report)
    opt.exit_on_failure(report.error, as_json=as_json)
    raise typer.Exit(opt.EXIT_OK if report.complete else opt.EXIT_ERROR)


__all__ = ["transfer_command"]
