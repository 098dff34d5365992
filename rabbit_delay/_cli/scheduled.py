"""`rabbit-delay scheduled list|show|cancel|reschedule|sweep`: the schedule of a topology
with a [schedule] table, by key (docs/operations.md, "rabbit-delay scheduled").

`list`, `show` and `cancel` read and write the topology's idempotency store only (no
broker); `reschedule` and `sweep` publish, so they connect a Publisher. What is shown
and what an outcome means: rabbit_delay._ops.scheduled.rules; the store calls and the
publishes: rabbit_delay.sync.Schedule.
"""

from __future__ import annotations

import shlex
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

import rabbit_delay._cli.options as opt
from rabbit_delay._durations import format_ms, parse_ms
from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import ConfigError, DurationError
from rabbit_delay._ops.scheduled import rules
from rabbit_delay._schedule.records import MAX_PAGE, RECORD_STATES, ScheduleRecord
from rabbit_delay._urls import redact

if TYPE_CHECKING:
    from rabbit_delay._schedule.operations import SweepResult

scheduled_app = typer.Typer(
    name="scheduled",
    help="List, show, cancel and reschedule the delayed messages of a topology with a "
    "schedule (its `schedule` table), by key; sweep what should have fired.",
    no_args_is_help=True,
)

KeyArg = Annotated[
    str,
    typer.Argument(
        help="The schedule key (the key= of the publish; default: its message_id).",
        show_default=False,
    ),
]
_STATES = ", ".join(s.value for s in RECORD_STATES)
# The kind of the JSON error for a key the schedule does not know.
UNKNOWN_KEY = "UnknownKey"
# The kind of the error of a reschedule that found the key handled, cancelled or parked.
NOT_SCHEDULED = "NotScheduled"


def _usage(fn: Any, *args: Any) -> Any:
    """`fn(*args)`, its ConfigError a usage error (bad command-line input: exit 1)."""
    try:
        return fn(*args)
    except ConfigError as exc:
        opt.fail(str(exc))


def _instant(text: str | None, option: str, now: int) -> datetime | None:
    if text is None:
        return None
    ms = _usage(rules.parse_instant, text, option, now)
    return datetime.fromtimestamp(ms / 1000, UTC)


def _print_lines(title: str, lines: list[tuple[str, str]]) -> None:
    opt.out.print(escape(redact(title)), style="bold")
    for label, value in lines:
        opt.out.print(f"  {label}: ", end="", markup=False)
        opt.out.print(redact(value), markup=False, highlight=False)


# -- list ---------------------------------------------------------------------------------


def _page_table(records: list[ScheduleRecord], now: int) -> Table:
    table = Table(title="schedule, in due order", title_justify="left")
    for column in rules.LIST_COLUMNS:
        if column in ("gen", "attempts"):
            table.add_column(column, justify="right", no_wrap=True, min_width=len(column))
        elif column in ("state", "due"):
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, overflow="fold")
    for record in records:
        table.add_row(*(escape(redact(cell)) for cell in rules.list_row(record, now)))
    return table


@scheduled_app.command("list")
def list_command(
    file: opt.TopologyOpt = None,
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue", "-q", help="Only this business queue (logical name).", show_default=False
        ),
    ] = None,
    state: Annotated[
        str | None,
        typer.Option("--state", help=f"Only records in this state: {_STATES}.", show_default=False),
    ] = None,
    due_before: Annotated[
        str | None,
        typer.Option(
            "--due-before",
            help="Only records due before T: ISO-8601 with a timezone "
            "(2026-12-05T10:00:00Z) or a duration from now (+10m, -1h).",
            show_default=False,
            metavar="T",
        ),
    ] = None,
    due_after: Annotated[
        str | None,
        typer.Option(
            "--due-after",
            help="Only records due at or after T (the same forms).",
            show_default=False,
            metavar="T",
        ),
    ] = None,
    limit: Annotated[
        int,
        typer.Option("--limit", "-n", min=1, max=MAX_PAGE, help="Show at most N records."),
    ] = rules.DEFAULT_LIST_LIMIT,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            help="Start after this cursor: the `next` of the previous page.",
            show_default=False,
            metavar="CURSOR",
        ),
    ] = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """List one page of the schedule in due order: key, state, queue, due time, generation,
    attempts, last error. All states unless --state; the next page starts at the printed
    `--after` cursor. Reads the topology's idempotency store; connects to no broker.

    JSON: {"records": [...], "next": cursor or null}.
    """
    from rabbit_delay.sync import Schedule

    now = now_ms()
    before = _instant(due_before, "--due-before", now)
    since = _instant(due_after, "--due-after", now)
    with opt.errors_to_exit():
        topology = opt.resolve_topology(None, file)
        rules.check_store(topology)
        with Schedule(topology) as schedule:
            page = schedule.list(
                queue=queue,
                state=state,
                due_before=before,
                due_after=since,
                limit=limit,
                after=after,
            )
            cursor = Schedule.next_cursor(page, limit)
    if as_json:
        opt.print_json({"records": [r.as_dict() for r in page], "next": cursor})
        raise typer.Exit(opt.EXIT_OK)
    if page:
        opt.out.print(_page_table(page, now))
    line = f"{len(page)} record(s)" if page else "no record matches"
    if cursor is not None:
        line += f"; next page: --after {shlex.quote(cursor)}"
    opt.out.print(escape(line))
    raise typer.Exit(opt.EXIT_OK)


# -- show ---------------------------------------------------------------------------------


@scheduled_app.command("show")
def show_command(
    key: KeyArg,
    file: opt.TopologyOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Show a key's record in full: state, queue, due time, generation, attempts, last
    error, message id, when it was created and updated, when the sweeper would republish
    it, when it is purged, and its body's size. Connects to no broker.

    Exit code 1 for a key the schedule does not know.
    """
    from rabbit_delay.sync import Schedule

    _usage(rules.check_key, key)
    with opt.errors_to_exit():
        topology = opt.resolve_topology(None, file)
        rules.check_store(topology)
        with Schedule(topology) as schedule:
            record = schedule.lookup(key)
    if record is None:
        opt.fail(rules.unknown_key(key), kind=UNKNOWN_KEY)
    if as_json:
        opt.print_json(record.as_dict())
    else:
        _print_lines(record.key, rules.detail(record, now_ms()))
    raise typer.Exit(opt.EXIT_OK)


# -- cancel -------------------------------------------------------------------------------


@scheduled_app.command("cancel")
def cancel_command(
    key: KeyArg,
    file: opt.TopologyOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Cancel a key: its message (and any retry of it) is dropped when it comes due,
    however far away that is; a parked key's replay is dropped too. Connects to no broker.

    Exit code 0 when it was cancelled (it was scheduled or parked), and also, with a note,
    when there was nothing to cancel (already handled or cancelled: it will not run);
    1 for a key the schedule does not know.
    """
    from rabbit_delay.sync import Schedule

    _usage(rules.check_key, key)
    with opt.errors_to_exit():
        topology = opt.resolve_topology(None, file)
        rules.check_store(topology)
        with Schedule(topology) as schedule:
            found = schedule.cancel(key)
            record = schedule.lookup(key) if found is not None else None
    if found is None:
        opt.fail(rules.unknown_key(key), kind=UNKNOWN_KEY)
    outcome = rules.cancel_outcome(key, found)
    if as_json:
        opt.print_json(outcome.as_json(record))
    else:
        opt.out.print(redact(outcome.line), markup=False)
    raise typer.Exit(opt.EXIT_OK)


# -- reschedule -----------------------------------------------------------------------------


def _move(delay: str | None, at: str | None, now: int) -> tuple[timedelta | None, datetime | None]:
    if delay is None and at is None:
        opt.fail("say when: --in DURATION (e.g. 10m) or --at T (e.g. 2026-12-05T10:00:00Z)")
    if delay is not None and at is not None:
        opt.fail("give either --in or --at, not both")
    if delay is not None:
        try:
            return timedelta(milliseconds=parse_ms(delay)), None
        except DurationError as exc:
            opt.fail(f"--in: {exc}", kind=type(exc).__name__)
    return None, _instant(at, "--at", now)


@scheduled_app.command("reschedule")
def reschedule_command(
    key: KeyArg,
    delay: Annotated[
        str | None,
        typer.Option(
            "--in",
            help="Move it to this long from now: 90s, 10m, 2h, 1h30m.",
            show_default=False,
            metavar="DURATION",
        ),
    ] = None,
    at: Annotated[
        str | None,
        typer.Option(
            "--at",
            help="Move it to T: ISO-8601 with a timezone (2026-12-05T10:00:00Z) or a "
            "duration from now (+10m).",
            show_default=False,
            metavar="T",
        ),
    ] = None,
    file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Move a scheduled key to another time (--in or --at): its next generation is
    recorded and published (confirmed), and the copy already sent is dropped when it
    comes due. Prints the new due time and generation.

    Exit code 0 when it moved; 1 for an unknown key, and for a key that is not scheduled
    (handled, cancelled or parked: nothing is moved or published), a time in the past or
    beyond what the topology can delay, a broker or store error.
    """
    from rabbit_delay.sync import Publisher

    _usage(rules.check_key, key)
    now = now_ms()
    in_delay, at_time = _move(delay, at, now)
    with opt.errors_to_exit():
        topology = opt.resolve_topology(None, file)
        urls = opt.url_for(url)
        rules.check_store(topology)
        with Publisher(topology, ",".join(urls)) as publisher:
            found = publisher.schedule.reschedule(key, in_delay, at=at_time)
            record = publisher.schedule.lookup(key) if found is not None else None
    if found is None:
        opt.fail(rules.unknown_key(key), kind=UNKNOWN_KEY)
    outcome = rules.reschedule_outcome(key, found, record, now_ms())
    if as_json:
        report = outcome.as_json(record)
        if not outcome.done:  # the one document says why it failed, as declare's does
            report |= {"error": outcome.line, "kind": NOT_SCHEDULED}
        opt.print_json(report)
        raise typer.Exit(opt.EXIT_OK if outcome.done else opt.EXIT_ERROR)
    if not outcome.done:
        opt.fail(outcome.line, kind=NOT_SCHEDULED)
    opt.out.print(redact(outcome.line), markup=False)
    raise typer.Exit(opt.EXIT_OK)


# -- sweep ------------------------------------------------------------------------------------


def _sweep_line(result: SweepResult) -> str:
    late = (
        f"; the workers' recent lateness: {format_ms(result.lateness_ms)}"
        if result.lateness_ms is not None
        else ""
    )
    grace = f"past their due time + {format_ms(result.grace_ms)}{late}"
    if not result.republished:
        return f"nothing to republish: no record is still scheduled {grace}"
    keys = ", ".join(result.republished[:10])
    more = f" (+{len(result.republished) - 10} more)" if len(result.republished) > 10 else ""
    return f"republished {len(result.republished)} record(s) still scheduled {grace}: {keys}{more}"


@scheduled_app.command("sweep")
def sweep_command(
    file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Run the sweeper now: republish every record still scheduled past its due time plus
    the grace (more while the workers run late), under its key and generation, as the
    workers do every `sweep_every`. At most `sweep_batch` records per run.

    JSON: {"grace_ms", "lateness_ms", "republished": [keys], "message_ids": [...]}.
    """
    from rabbit_delay.sync import Publisher

    with opt.errors_to_exit():
        topology = opt.resolve_topology(None, file)
        urls = opt.url_for(url)
        rules.check_store(topology)
        with Publisher(topology, ",".join(urls)) as publisher:
            result = publisher.schedule.sweep()
    if as_json:
        opt.print_json(result.as_dict() | {"message_ids": list(result.message_ids)})
    else:
        opt.out.print(redact(_sweep_line(result)), markup=False)
    raise typer.Exit(opt.EXIT_OK)


__all__ = [
    "NOT_SCHEDULED",
    "UNKNOWN_KEY",
    "cancel_command",
    "list_command",
    "reschedule_command",
    "scheduled_app",
    "show_command",
    "sweep_command",
]
