"""relay: publish the committed rows of a transactional outbox (rabbit_delay.outbox)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated

import typer

import rabbit_delay._cli.options as opt
from rabbit_delay._stop_signals import install_stop_signals
from rabbit_delay._urls import redact
from rabbit_delay.outbox import DEFAULT_TABLE, Relay, RelayStats
from rabbit_delay.outbox._core import (
    DEFAULT_MAX_POLL,
    DEFAULT_POLL,
    DEFAULT_RELAY_BATCH,
    DEFAULT_RELAY_LEASE,
    DEFAULT_RETENTION,
)

log = logging.getLogger("rabbit_delay.outbox")

DB_ENV = "RABBIT_DELAY_OUTBOX_DB"

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        help=(
            "The outbox's database: sqlite:///path/app.db (sqlite:////abs/path.db) or "
            f"postgresql://user:password@host:5432/dbname. Default: ${DB_ENV}."
        ),
        show_default=False,
    ),
]
TableOpt = Annotated[str, typer.Option("--table", help="The outbox table.")]
BatchOpt = Annotated[
    int, typer.Option("--batch", min=1, max=10_000, help="Rows claimed and published at once.")
]
OnceOpt = Annotated[
    bool,
    typer.Option("--once", help="Relay the rows there now, clean up, and exit (cron, tests)."),
]
RetentionOpt = Annotated[
    str, typer.Option("--retention", help="Delete sent rows this long after they were sent.")
]
PollOpt = Annotated[
    str, typer.Option("--poll", help="First wait when idle (doubles up to --max-poll).")
]
MaxPollOpt = Annotated[
    str, typer.Option("--max-poll", help="Longest wait between polls when idle.")
]
LeaseOpt = Annotated[
    str,
    typer.Option(
        "--lease", help="SQLite: how long a claim on rows lasts (a dead relay's rows wait it out)."
    ),
]
InstallOpt = Annotated[
    bool, typer.Option("--install", help="Create the outbox table and its indexes if missing.")
]
OnceJsonOpt = Annotated[bool, typer.Option("--json", help="With --once: print the result as JSON.")]


def relay(
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
    db: DbOpt = None,
    table: TableOpt = DEFAULT_TABLE,
    batch: BatchOpt = DEFAULT_RELAY_BATCH,
    once: OnceOpt = False,
    retention: RetentionOpt = DEFAULT_RETENTION,
    poll: PollOpt = DEFAULT_POLL,
    max_poll: MaxPollOpt = DEFAULT_MAX_POLL,
    lease: LeaseOpt = DEFAULT_RELAY_LEASE,
    install: InstallOpt = False,
    metrics_port: opt.MetricsPortOpt = None,
    log_level: opt.LogLevelOpt = opt.LogLevel.INFO,
    as_json: OnceJsonOpt = False,
    url: opt.UrlOpt = None,
) -> None:
    """Publish the committed rows of an outbox table, confirmed, and mark them sent.

    Runs until SIGINT/SIGTERM (the batch in progress is published and marked first);
    --once relays what is there and exits: 0, or 1 if a row could not be published
    (kept in the table with its error) or the broker or database failed.
    """
    opt.configure_logging(log_level)
    if file is not None and topology_file is not None:
        opt.fail("give the topology file once: as the FILE argument or with -f/--topology")
    db = db or os.environ.get(DB_ENV)
    if not db:
        opt.fail(f"name the outbox's database with --db URL (or ${DB_ENV})")
    with opt.errors_to_exit():
        topology = opt.resolve_topology(file or topology_file)
        metrics = None
        if metrics_port is not None:
            from rabbit_delay._io.endpoints import start_metrics_server
            from rabbit_delay._observe.metrics import default_metrics

            metrics = default_metrics()
            start_metrics_server(metrics_port)
        the_relay = Relay(
            topology,
            db,
            url=opt.url_for(url),
            table=table,
            batch=batch,
            poll=poll,
            max_poll=max_poll,
            retention=retention,
            lease=lease,
            metrics=metrics,
        )
        if install:
            the_relay.install()
            log.info("relay: table %r is in place on %s", table, the_relay.shown_db)
        with the_relay:
            if once:
                _once(the_relay, as_json)
                return
            log.info(
                "relay: relaying %s table %r to %s (batch %d)",
                the_relay.shown_db,
                table,
                the_relay.topology.names.prefix,
                batch,
            )
            restore = _install_signals(the_relay)
            try:
                stats = the_relay.run()
            finally:
                restore()
            log.info(
                "relay: stopped; relayed %d row(s), %d refused, %d cleaned up",
                stats.relayed,
                stats.refused,
                stats.cleaned,
            )


def _once(the_relay: Relay, as_json: bool) -> None:
    stats = the_relay.run_once()
    pending = the_relay.pending()
    if as_json:
        sys.stdout.write(redact(json.dumps(_stats_json(stats, pending), indent=2)) + "\n")
    else:
        opt.out.print(
            f"relayed {stats.relayed} row(s) from {the_relay.shown_db} table "
            f"{the_relay.table!r}; {stats.refused} refused, {stats.retried} taken again, "
            f"{stats.cleaned} sent row(s) cleaned up; {pending} pending",
            markup=False,
        )
    if stats.refused:
        for error in stats.errors:
            typer.echo(redact(f"error: {error}"), err=True)
        raise typer.Exit(1)


def _stats_json(stats: RelayStats, pending: int) -> dict[str, object]:
    return {
        "relayed": stats.relayed,
        "refused": stats.refused,
        "retried": stats.retried,
        "batches": stats.batches,
        "cleaned": stats.cleaned,
        "pending": pending,
        "errors": stats.errors,
    }


def _install_signals(the_relay: Relay) -> Callable[[], None]:
    """SIGINT/SIGTERM: finish the batch in progress, then stop; a second one stops at
    once (rows published but not marked are published again by the next relay)."""
    seen: list[str] = []

    def on_signal(name: str) -> None:
        if seen:
            raise KeyboardInterrupt(f"second {name}")
        seen.append(name)
        log.info("relay: %s: stopping after the batch in progress", name)
        the_relay.stop()

    return install_stop_signals(on_signal)


__all__ = ["relay"]
