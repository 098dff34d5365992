"""The relay: publishes committed outbox rows, confirmed, and marks them sent.

One batch: claim up to `batch` rows (PostgreSQL: rows locked with SKIP LOCKED; SQLite:
a lease), turn each into its message (`_core.outgoing`: the due time counts from the
row's creation), publish them with the sync publisher (pipelined confirms, its own
recovery from a lost connection), then in one statement per outcome mark the confirmed
rows sent, keep refused rows back with their error, release the others. A relay killed
between the publish and the marks leaves rows that were published but not marked: the
next relay publishes them again, under the same message_id (at least once; the
consumers' idempotency guard absorbs the copy).

The relay owns its database connection (a URL, or a function returning a new one) and,
unless given one, its publisher; pika is imported only when it opens one.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

import rabbit_delay.outbox._sql as _sql
from rabbit_delay._connection import DEFAULT_BLOCKED_TIMEOUT_S, ConnectionSettings, ReconnectBackoff
from rabbit_delay._durations import DurationLike, parse_ms
from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import (
    ConfigError,
    DurationError,
    NackError,
    OutboxError,
    RabbitDelayError,
    UnroutableError,
)
from rabbit_delay._io.sql import check_table_name
from rabbit_delay._opened import Opened
from rabbit_delay._publishing.confirms import DEFAULT_RECOVERY_TIMEOUT_S
from rabbit_delay._topology.delays import Router
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact
from rabbit_delay.outbox._core import (
    DEFAULT_CLEANUP_INTERVAL,
    DEFAULT_MAX_POLL,
    DEFAULT_POLL,
    DEFAULT_RELAY_BATCH,
    DEFAULT_RELAY_LEASE,
    DEFAULT_RETENTION,
    DEFAULT_TABLE,
    POSTGRESQL,
    SQLITE,
    Database,
    Refusal,
    Settlement,
    parse_database,
    plan_batch,
    settle,
)

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics
    from rabbit_delay._publishing.core import URLs
    from rabbit_delay._sync.publisher import Publisher

log = logging.getLogger("rabbit_delay.outbox")

MAX_BATCH = 10_000
# After a failure (broker or database unreachable): 1 s, doubling up to 30 s.
ERROR_BACKOFF = ReconnectBackoff(initial_s=1.0, max_s=30.0)
# PostgreSQL: a relay idle this long inside its claim transaction is cut off by the
# server (rows unlocked). Above the longest a publish can legitimately take: the
# publisher's recovery deadline plus a blocked broker's, with margin.
PG_IDLE_TIMEOUT_MS = int(
    2 * (DEFAULT_RECOVERY_TIMEOUT_S + DEFAULT_BLOCKED_TIMEOUT_S) * 1000 + 60_000
)
SQLITE_BUSY_TIMEOUT_S = 5.0


@dataclass(slots=True)
class BatchResult:
    claimed: int = 0
    sent: int = 0
    refused: int = 0
    retried: int = 0


@dataclass(slots=True)
class RelayStats:
    """What a relay did since it was made (`Relay.stats`), or in one `run_once()`."""

    relayed: int = 0  # published, confirmed, marked sent
    refused: int = 0  # kept back with their error, tried again later
    retried: int = 0  # no confirm: released, taken again
    batches: int = 0
    cleaned: int = 0  # sent rows deleted past the retention
    errors: list[str] = field(default_factory=list)  # the last refusals, for a report

    def add(self, batch: BatchResult) -> None:
        self.relayed += batch.sent
        self.refused += batch.refused
        self.retried += batch.retried
        self.batches += 1 if batch.claimed else 0


def _ms(value: DurationLike, name: str, *, minimum: int = 0) -> int:
    try:
        ms = parse_ms(value)
    except DurationError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if ms < minimum:
        raise ConfigError(f"{name} must be at least {minimum} ms, got {value!r}")
    return ms


class Relay(Opened):
    """Publishes the committed rows of an outbox table, confirmed, and marks them sent.

    `db` is a database URL (`sqlite:///app.db`, `postgresql://user:pw@host/db`) or a
    function returning a new connection for the relay's own use (sqlite3 or psycopg 3).
    The broker: `url` (default $RABBIT_DELAY_URL, else the local one), or `publisher=`
    (a `rabbit_delay.sync.Publisher` of yours, never closed by the relay).

    `run_once()` relays what is there and returns (cron, tests, in-process use);
    `run()` relays until `stop()` (from any thread, or a signal handler), polling
    `poll` after a partial batch and backing off up to `max_poll` while idle. Sent rows
    are deleted `retention` after they were sent (checked every `cleanup_interval`).
    SQLite: a claim lasts `lease` (the rows of a relay that died are taken again after
    it). Not thread-safe: one thread runs a relay; several relays may share a table.

    Raises ConfigError for bad options.
    """

    def __init__(
        self,
        topology: Topology,
        db: str | Callable[[], Any],
        *,
        url: URLs | None = None,
        publisher: Publisher | None = None,
        table: str = DEFAULT_TABLE,
        batch: int = DEFAULT_RELAY_BATCH,
        poll: DurationLike = DEFAULT_POLL,
        max_poll: DurationLike = DEFAULT_MAX_POLL,
        retention: DurationLike = DEFAULT_RETENTION,
        cleanup_interval: DurationLike = DEFAULT_CLEANUP_INTERVAL,
        lease: DurationLike = DEFAULT_RELAY_LEASE,
        metrics: Metrics | None = None,
        settings: ConnectionSettings | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        if publisher is not None and url is not None:
            raise ConfigError(
                "give either url= (the relay opens a publisher) or publisher=, not both"
            )
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            raise ConfigError(f"batch must be a whole number from 1 to {MAX_BATCH}, got {batch!r}")
        self.topology = topology
        self.router = Router(topology)
        self.table = check_table_name(table, "outbox")
        self.batch = batch
        self.poll_ms = _ms(poll, "poll", minimum=1)
        self.max_poll_ms = max(_ms(max_poll, "max_poll", minimum=1), self.poll_ms)
        self.retention_ms = _ms(retention, "retention")
        self.cleanup_interval_ms = _ms(cleanup_interval, "cleanup_interval", minimum=1)
        self.lease_ms = _ms(lease, "lease", minimum=1_000)
        self.metrics = metrics
        self.clock = clock
        self.url = url
        self.settings = settings
        self.database: Database | None = None
        if isinstance(db, str):
            self.database = parse_database(db)
            self._connect: Callable[..., Any] = self._open_database
        elif callable(db):
            self._connect = db
        else:
            raise ConfigError(
                "db must be a database URL or a function returning a connection, got "
                f"{type(db).__name__}"
            )
        self.owner = f"relay-{uuid.uuid4().hex[:12]}"  # its SQLite leases
        self.stats = RelayStats()
        self._publisher = publisher
        self._owns_publisher = publisher is None
        self._store: _sql.RelayStore | None = None
        self._stop = threading.Event()
        self._next_cleanup = 0.0  # monotonic s

    @property
    def shown_db(self) -> str:
        """The database, for messages (password redacted)."""
        return self.database.shown if self.database is not None else "(connection factory)"

    # -- lifecycle -----------------------------------------------------------------------

    def open(self) -> Self:
        """Connect to the database (checking the table) and the broker; idempotent.
        Raises OutboxError (database unreachable, table missing), BrokerUnavailable,
        AccessRefused."""
        self._open_store()
        self._open_publisher()
        return self

    def close(self) -> None:
        """Close the database connection, and the publisher unless it was given."""
        store, self._store = self._store, None
        if store is not None:
            with self._database("closing the database connection", quiet=True):
                store.close()
        if self._owns_publisher and self._publisher is not None:
            self._publisher.close()

    def stop(self) -> None:
        """Ask `run()` to return once the batch in progress is settled (safe from a
        signal handler or another thread, also before `run()` started: a stopped relay's
        `run()` returns at once; `run_once()` still works)."""
        self._stop.set()

    def install(self) -> None:
        """Create the outbox table and its indexes on the relay's database unless they
        exist (committed). Raises OutboxError."""
        with self._database("creating the outbox table"):
            conn = self._connect(create=True) if self.database is not None else self._connect()
            try:
                _sql.install(conn, self.table)
                conn.commit()
            finally:
                conn.close()

    def _open_database(self, create: bool = False) -> Any:
        database = self.database
        assert database is not None
        if database.dialect == SQLITE:
            # mode=rw: a mistyped path is an error, not a new empty database
            path = Path(database.target)
            if not create and not path.is_file():
                raise OutboxError(
                    f"no SQLite database file at {str(path.resolve())!r} (--db "
                    f"{database.shown}): sqlite:///relative/path.db is relative to the "
                    "current directory, sqlite:////abs/path.db absolute; --install creates it"
                )
            return sqlite3.connect(
                f"file:{quote(str(path))}?mode={'rwc' if create else 'rw'}",
                uri=True,
                timeout=SQLITE_BUSY_TIMEOUT_S,
                isolation_level=None,
                check_same_thread=False,
            )
        try:
            import psycopg
        except ImportError:
            raise ConfigError(
                "a PostgreSQL outbox needs psycopg 3: pip install 'rabbit-delay[postgres]'"
            ) from None
        return psycopg.connect(database.target, connect_timeout=10)

    def _open_store(self) -> _sql.RelayStore:
        if self._store is not None:
            return self._store
        with self._database("connecting to the database"):
            conn = self._connect()
            try:
                dialect = _sql.dialect_of(conn)
                store: _sql.RelayStore
                if dialect == POSTGRESQL:
                    store = _sql.PostgresRelayStore(conn, self.table, PG_IDLE_TIMEOUT_MS)
                else:
                    store = _sql.SQLiteRelayStore(conn, self.table, self.owner, self.lease_ms)
                store.check()
            except BaseException:
                conn.close()
                raise
        self._store = store
        return store

    def _open_publisher(self) -> Publisher:
        publisher = self._publisher
        if publisher is None:
            from rabbit_delay._sync.publisher import Publisher

            publisher = Publisher(
                self.topology, self.url, metrics=self.metrics, settings=self.settings
            )
            self._publisher = publisher
        publisher.open()
        return publisher

    @contextmanager
    def _database(self, doing: str, *, quiet: bool = False) -> Iterator[None]:
        """Database driver errors leave as OutboxError (redacted, naming the table)."""
        try:
            yield
        except RabbitDelayError:
            raise
        except Exception as exc:
            if not _is_db_error(exc):
                raise
            if quiet:
                return
            # The connection may be unusable now (PostgreSQL: an aborted transaction):
            # the next call opens a new one.
            self._drop_store()
            missing = _sql.missing_table(self.table, exc)
            if missing is not None:
                raise missing from None
            raise OutboxError(
                f"outbox database {self.shown_db}, table {self.table!r}: {type(exc).__name__} "
                f"while {doing}: {redact(str(exc).strip())}"
            ) from None

    def _drop_store(self) -> None:
        """Forget a connection that failed: the next batch opens a new one."""
        store, self._store = self._store, None
        if store is not None:
            with self._database("closing the database connection", quiet=True):
                store.close()

    # -- relaying ------------------------------------------------------------------------

    def relay_batch(self) -> BatchResult:
        """Claim, publish and settle one batch; what became of its rows.

        Raises OutboxError (database), and what the publisher raises for the batch as
        a whole (BrokerUnavailable, UnconfirmedError past the recovery deadline,
        AccessRefused, MissingObjectError for an undeclared topology) after releasing
        its rows: nothing is marked sent that was not confirmed.
        """
        store = self._open_store()
        publisher = self._open_publisher()
        now = self.clock()
        with self._database("claiming rows"):
            rows = store.claim(self.batch, now)
        if not rows:
            return BatchResult()
        mark = publisher.scheduled if self.router.topology.schedule is not None else None
        planned, outs, refused = plan_batch(self.router, rows, now, mark)
        outcome = Settlement(refused=refused)
        failure: RabbitDelayError | None = None
        if outs:
            try:
                ledger, failure = publisher.publish_tracked(outs)
            except BaseException:
                with self._database("releasing rows", quiet=True):
                    store.abandon()
                raise
            published = settle(planned, ledger, self.clock())
            outcome.sent = published.sent
            outcome.refused.extend(published.refused)
            outcome.retry = published.retry
        marked_at = self.clock()
        with self._database("marking rows sent"):
            store.finish(outcome.sent, outcome.refused, outcome.retry, marked_at)
        result = BatchResult(len(rows), len(outcome.sent), len(outcome.refused), len(outcome.retry))
        self._report(outcome, marked_at)
        self.stats.add(result)
        if failure is not None and not isinstance(failure, UnroutableError | NackError):
            raise failure  # the batch as a whole: no broker, 403, 404 ...
        return result

    def _report(self, outcome: Settlement, marked_at: int) -> None:
        metrics = self.metrics
        if metrics is not None and outcome.sent:
            by_target: dict[tuple[str, str], list[float]] = {}
            for row in outcome.sent:
                key = self._metric_target(row.queue, row.routing_key)
                by_target.setdefault((key, row.tier), []).append(
                    (marked_at - row.created_at) / 1000
                )
            for (target, tier), lags in by_target.items():
                metrics.relayed(target, tier, lags)
        for refusal in outcome.refused:
            self._refused(refusal)
        if outcome.retry:
            log.warning(
                "relay: %d row(s) not confirmed (nacked, or the publish ended early); "
                "taken again, possibly delivered twice under the same message_id",
                len(outcome.retry),
            )

    def _refused(self, refusal: Refusal) -> None:
        row = refusal.row
        text = (
            f"row {row.id} (message_id {row.message_id!r}, {row.target}) not published: "
            f"{refusal.error}; kept, tried again later"
        )
        log.error("relay: %s", text)
        errors = self.stats.errors
        errors.append(text)
        del errors[:-20]
        if self.metrics is not None:
            from rabbit_delay._observe.metrics import PublishErrorReason

            target = self._metric_target(row.queue, row.routing_key)
            self.metrics.relay_refused(target, PublishErrorReason(refusal.reason))

    def _metric_target(self, queue: str | None, routing_key: str | None) -> str:
        # The same label as published_total: the target's routing key.
        if queue is not None:
            return self.topology.names.queue_key(queue)
        return routing_key or ""

    def run_once(self) -> RelayStats:
        """Relay every row available now (batch after batch until one is not full),
        clean up old sent rows, and return what this call did. Raises what
        `relay_batch` raises."""
        stats = self.stats
        before = replace(stats, errors=[])
        errors_before = len(stats.errors)
        while True:
            result = self.relay_batch()
            if result.claimed < self.batch:
                break
        self.cleanup()
        return RelayStats(
            relayed=stats.relayed - before.relayed,
            refused=stats.refused - before.refused,
            retried=stats.retried - before.retried,
            batches=stats.batches - before.batches,
            cleaned=stats.cleaned - before.cleaned,
            errors=stats.errors[errors_before:] if errors_before < len(stats.errors) else [],
        )

    def run(self) -> RelayStats:
        """Relay until `stop()`: batch after batch while rows are there, polling when
        idle (backing off from `poll` to `max_poll`), cleaning up every
        `cleanup_interval`. A failing broker or database is logged and tried again
        with backoff (1 s to 30 s); only bad configuration raises (ConfigError)."""
        idle = self._idle_waits()
        failures: Iterator[float] | None = None
        while not self._stop.is_set():
            try:
                result = self.relay_batch()
                if time.monotonic() >= self._next_cleanup:
                    self.cleanup()
            except ConfigError:
                raise
            except RabbitDelayError as exc:
                if isinstance(exc, OutboxError):
                    self._drop_store()
                failures = failures or ERROR_BACKOFF.delays()
                wait = next(failures)
                log.error("relay: %s; trying again in %.1fs", exc, wait)
                self._stop.wait(wait)
                continue
            if failures is not None:
                log.warning("relay: working again")
                failures = None
            if result.claimed >= self.batch:
                continue  # more are waiting
            if result.claimed:
                idle = self._idle_waits()
            self._stop.wait(next(idle))
        return self.stats

    def _idle_waits(self) -> Iterator[float]:
        return ReconnectBackoff(self.poll_ms / 1000, self.max_poll_ms / 1000, jitter=0.1).delays()

    def cleanup(self, now: int | None = None) -> int:
        """Delete the rows sent `retention` ago or earlier; how many. Raises OutboxError."""
        store = self._open_store()
        before = (self.clock() if now is None else now) - self.retention_ms
        with self._database("deleting old sent rows"):
            deleted = store.cleanup(before)
        self._next_cleanup = time.monotonic() + self.cleanup_interval_ms / 1000
        self.stats.cleaned += deleted
        if deleted:
            log.info("relay: deleted %d row(s) sent before the retention", deleted)
        return deleted

    def pending(self) -> int:
        """Rows not sent yet. Raises OutboxError."""
        store = self._open_store()
        with self._database("counting pending rows"):
            return store.pending()


def _is_db_error(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        return True
    # psycopg's errors, without importing it for an SQLite relay
    return any(
        c.__module__.startswith("psycopg") and c.__name__ == "Error" for c in type(exc).__mro__
    )
