"""PostgreSQL store (psycopg 3, optional extra `postgres`): one database shared by the
workers of several hosts.

Every operation is one statement, in autocommit (its own transaction, one round trip);
a batch is one statement per kind (`unnest` of the keys and owners), and several
statements of one call are pipelined (one round trip, one implicit transaction). A claim
is an `INSERT ... ON CONFLICT (key) DO UPDATE` whose SET takes the row only when it is
free (absent, expired, or ours) and otherwise writes it back unchanged: the conflicting
row is locked and read at its latest committed version, so two claimers of one key, in
any processes, are serialised by the row lock and never both see it free; RETURNING
tells each what holds the key, with no second statement and no retry.

The clock: by default the server's (`statement_timestamp()`), like the Redis stores, so
the workers of several hosts share one clock and a host whose clock runs ahead cannot
take over a live lease; `server_clock=False` follows the caller's `now_ms` (tests, the
test kit's virtual clock), like SQLite.

The tables: each is a `_Table` (its DDL and its statements, from one template with the
table's name and the clock filled in), created on first use under an advisory lock so
that processes starting together do not race on `CREATE TABLE`. The idempotency table is
the first; the schedule's (`<table>_schedule`, issue 21) goes beside it, its DDL and
its operations written once for SQLite and PostgreSQL in `sql_schedule` (programs of
statements, run here on the store's connection; always on the caller's clock).
`scheduled_batch` runs a worker's finishes and claims with their schedule updates and
checks in one transaction (`_ScheduledBatch`).

`psycopg` is imported when a store is created, so this module loads without it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rabbit_delay._errors import ConfigError
from rabbit_delay._idempotency.guard import (
    DEFAULT_PREFIX,
    VERDICT_RESULT,
    ClaimItem,
    ClaimResult,
    FinishItem,
    ScheduledClaim,
    ScheduledFinish,
)
from rabbit_delay._io.sql import check_table_name
from rabbit_delay._schedule import rules
from rabbit_delay._schedule.book import SweptItem
from rabbit_delay._schedule.records import (
    Entry,
    Finished,
    Placed,
    Query,
    Ref,
    ScheduleRecord,
    ScheduleState,
    Verdict,
)
from rabbit_delay._stores.sql_schedule import (
    POSTGRES,
    Program,
    Sql,
    SQLSchedule,
    pipelined,
    run_async,
    run_sync,
)
from rabbit_delay._stores.sql_schedule import schema as schedule_schema
from rabbit_delay._stores.sqlite import DEFAULT_IDEMPOTENCY_TABLE
from rabbit_delay._urls import redact

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")
R = TypeVar("R")

# The server's clock in epoch ms, fixed for the whole statement.
_SERVER_NOW = "floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
_CALLER_NOW = "%(now)s::bigint"
# PostgreSQL 14 brought TID range scans, which purge walks the table with.
_MIN_SERVER_VERSION = 140_000
# Purge deletes the expired rows of this many heap pages (8 KiB each) per statement.
_PURGE_PAGES = 1_000
# ...and the expired schedule records this many at a time (found by their expiry index).
_SCHEDULE_PURGE_ROWS = 5_000
# A transaction the server rolled back to break a deadlock is sent again, up to this
# many times in all (nothing of it was written).
_DEADLOCK_ATTEMPTS = 3
# The schedule's table and its indexes add up to 17 characters to the store's table
# name ("_schedule_expires"); PostgreSQL cuts identifiers at 63.
_MAX_TABLE_NAME = 63 - len("_schedule_expires")
DEFAULT_TIMEOUT_S = 10.0


# -- tables: DDL and statements -----------------------------------------------------------


@dataclass(frozen=True)
class _Table:
    """One table of the store: its DDL and statements, with `{t}` (the table's name) and
    `{now}` (the clock's expression) still to fill in."""

    ddl: tuple[str, ...]
    statements: dict[str, str]

    def compiled(self, name: str, now: str) -> dict[str, str]:
        return {k: sql.format(t=name, now=now) for k, sql in self.statements.items()}

    def create(self, name: str) -> list[str]:
        return [sql.format(t=name) for sql in self.ddl]


# The key (prefix + key) is the primary key, the only index: a claim inserts the row and
# completing it rewrites it in place (a HOT update, no index touched). No index on
# expires_at: it would be written by every claim and complete, and make every update
# a non-HOT one. Purge walks the heap in page ranges instead (measured in
# docs/idempotency.md: 0.1 s per million rows).
_IDEMPOTENCY_DDL = (
    """
CREATE TABLE IF NOT EXISTS {t} (
    key        TEXT PRIMARY KEY,
    state      TEXT NOT NULL CHECK (state IN ('claimed', 'done', 'cancelled')),
    owner      TEXT,
    expires_at BIGINT NOT NULL
)
""",
)

# A row a claim may take: expired, or a claim of the same owner (re-entrant).
_FREE = "(r.expires_at <= {now} OR (r.state = 'claimed' AND r.owner = excluded.owner))"
# The items, in key order: every batch locks its rows in the same order, so two batches
# over the same keys wait for each other instead of deadlocking.
_ITEMS = "unnest(%(keys)s::text[], %(owners)s::text[]) AS i(key, owner) ORDER BY i.key"

_IDEMPOTENCY_STATEMENTS = {
    # Each item's row, as the claim left it: taken ('claimed', our owner) or written
    # back as it was (done, cancelled, or another owner's live claim).
    "claim": f"""
INSERT INTO {{t}} AS r (key, state, owner, expires_at)
SELECT i.key, 'claimed', i.owner, {{now}} + %(lease)s FROM {_ITEMS}
ON CONFLICT (key) DO UPDATE SET
    state = CASE WHEN {_FREE} THEN 'claimed' ELSE r.state END,
    owner = CASE WHEN {_FREE} THEN excluded.owner ELSE r.owner END,
    expires_at = CASE WHEN {_FREE} THEN excluded.expires_at ELSE r.expires_at END
RETURNING r.key, r.state, r.owner
""",
    # Releases (keys and owners in rkeys / rowners) and completes (keys, owners) of keys
    # that differ. Done wins over any claim, ours or not (the handler did succeed); a
    # live done-record or tombstone stays as it is.
    "finish": f"""
WITH released AS (
    DELETE FROM {{t}} AS r USING unnest(%(rkeys)s::text[], %(rowners)s::text[]) AS i(key, owner)
    WHERE r.key = i.key AND r.state = 'claimed' AND r.owner = i.owner
)
INSERT INTO {{t}} AS r (key, state, owner, expires_at)
SELECT i.key, 'done', i.owner, {{now}} + %(retention)s FROM {_ITEMS}
ON CONFLICT (key) DO UPDATE SET
    state = 'done', owner = excluded.owner, expires_at = excluded.expires_at
WHERE r.state = 'claimed' OR r.expires_at <= {{now}}
""",
    # The same for finishes whose schedule records their owners may hold (the record as
    # the claim: then the record is updated alone, and no guard row is written).
    "finish_unheld": """
WITH released AS (
    DELETE FROM {t} AS r USING unnest(%(rkeys)s::text[], %(rowners)s::text[]) AS i(key, owner)
    WHERE r.key = i.key AND r.state = 'claimed' AND r.owner = i.owner
)
INSERT INTO {t} AS r (key, state, owner, expires_at)
SELECT i.key, 'done', i.owner, {now} + %(retention)s
FROM unnest(%(keys)s::text[], %(owners)s::text[]) AS i(key, owner)
WHERE NOT EXISTS (SELECT 1 FROM {t}_schedule AS s WHERE s.owner = i.owner)
ORDER BY i.key
ON CONFLICT (key) DO UPDATE SET
    state = 'done', owner = excluded.owner, expires_at = excluded.expires_at
WHERE r.state = 'claimed' OR r.expires_at <= {now}
""",
    # Whatever the old lease end: a claim that ran out and that nobody took over is
    # still ours. Never inserts.
    # The guard row's lease, or else the record's (the record as the claim: its
    # schedule table's row, found by its owner; the schedule goes by the caller's clock).
    "renew": """
WITH g AS (
    UPDATE {t} SET expires_at = {now} + %(lease)s
    WHERE key = %(key)s AND state = 'claimed' AND owner = %(owner)s
    RETURNING 1
), s AS (
    UPDATE {t}_schedule SET lease_until = %(now)s::bigint + %(lease)s
    WHERE owner = %(owner)s AND state = 'scheduled' AND NOT EXISTS (SELECT 1 FROM g)
    RETURNING 1
)
SELECT 1 FROM g UNION ALL SELECT 1 FROM s
""",
    # The keys of these that have a live row (a claim, done-record or tombstone).
    "live": """
SELECT key FROM {t} WHERE key = ANY(%(keys)s::text[]) AND expires_at > {now}
""",
    # A second cancel never shortens a tombstone.
    "cancel": """
INSERT INTO {t} AS r (key, state, owner, expires_at)
VALUES (%(key)s, 'cancelled', NULL, {now} + %(retention)s)
ON CONFLICT (key) DO UPDATE SET state = 'cancelled', owner = NULL,
    expires_at = CASE WHEN r.state = 'cancelled' AND r.expires_at > excluded.expires_at
                      THEN r.expires_at ELSE excluded.expires_at END
""",
    # One slice of the heap (a TID range scan): pages [low, high).
    "purge": """
DELETE FROM {t}
WHERE ctid >= format('(%%s,0)', %(low)s::bigint)::tid
  AND ctid < format('(%%s,0)', %(high)s::bigint)::tid
  AND expires_at <= {now}
""",
    "pages": """
SELECT pg_relation_size(to_regclass(%(table)s)) / current_setting('block_size')::bigint
""",
}

IDEMPOTENCY = _Table(ddl=_IDEMPOTENCY_DDL, statements=_IDEMPOTENCY_STATEMENTS)

# The schedule's table: its DDL from sql_schedule (written once for both databases; it
# has no braces but the name's), its operations there too, as programs (`SQLSchedule`).
SCHEDULE = _Table(ddl=tuple(schedule_schema("{t}", POSTGRES)), statements={})


_EXISTS = "SELECT to_regclass(%(table)s) IS NOT NULL"
# Processes starting together would race on CREATE TABLE IF NOT EXISTS (a unique
# violation in the catalog): the first creates, under this lock, the others wait.
_CREATE_LOCK = "SELECT pg_advisory_xact_lock(hashtext('rabbit-delay:create:' || %(table)s))"


# -- requests: statements for one round trip and how to read their rows -----------------

Rows = list[tuple[Any, ...]]
_Statement = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class _Request(Generic[T]):
    """The statements one call sends (pipelined when several) and what it makes of
    their rows: each statement's rows, in order ([] for one that returns none)."""

    statements: list[_Statement]
    read: Callable[[list[Rows]], T]


def _outcome(row: tuple[Any, ...], owner: str) -> ClaimResult:
    """A claim's outcome from the row it left: (state, owner)."""
    state, holder = row
    if state == "claimed":
        return ClaimResult.CLAIMED if holder == owner else ClaimResult.IN_PROGRESS
    return ClaimResult.DONE if state == "done" else ClaimResult.CANCELLED


def _waves(keys: Sequence[str]) -> list[list[int]]:
    """The items' indexes in waves of distinct keys: an item goes to the wave after the
    one of the previous item with its key. One statement cannot touch a row twice, so
    a key twice in one batch takes two statements, in item order (as two calls would)."""
    seen: dict[str, int] = {}
    waves: list[list[int]] = []
    for i, key in enumerate(keys):
        wave = seen.get(key, 0)
        seen[key] = wave + 1
        if wave == len(waves):
            waves.append([])
        waves[wave].append(i)
    return waves


def _checked(items: Sequence[tuple[Any, ...]]) -> tuple[list[int], list[Exception | None]]:
    """The indexes of the items whose key and owner are strings; a TypeError in the slot
    of each other one (a batch never raises)."""
    valid: list[int] = []
    slots: list[Exception | None] = []
    for i, item in enumerate(items):
        if isinstance(item[0], str) and isinstance(item[1], str):
            valid.append(i)
            slots.append(None)
        else:
            slots.append(TypeError(f"key and owner must be str, got {item[0]!r}, {item[1]!r}"))
    return valid, slots


class _Statements:
    """A store's requests on its idempotency table: pure, shared by the sync and async
    stores."""

    def __init__(self, table: str, prefix: str, server_clock: bool) -> None:
        self.table = table
        self.prefix = prefix
        self.sql = IDEMPOTENCY.compiled(table, _SERVER_NOW if server_clock else _CALLER_NOW)

    def claims(
        self, items: Sequence[ClaimItem], now_ms: int, lease_ms: int
    ) -> _Request[list[ClaimResult]]:
        keys = [self.prefix + key for key, _ in items]
        waves = _waves(keys)
        statements = [
            (
                self.sql["claim"],
                {
                    "keys": [keys[i] for i in wave],
                    "owners": [items[i][1] for i in wave],
                    "now": now_ms,
                    "lease": lease_ms,
                },
            )
            for wave in waves
        ]

        def read(results: list[Rows]) -> list[ClaimResult]:
            outcomes: list[ClaimResult] = [ClaimResult.IN_PROGRESS] * len(items)
            for wave, rows in zip(waves, results, strict=True):
                found = {key: (state, owner) for key, state, owner in rows}
                for i in wave:
                    outcomes[i] = _outcome(found[keys[i]], items[i][1])
            return outcomes

        return _Request(statements, read)

    def finishes(
        self, items: Sequence[FinishItem], now_ms: int, retention_ms: int, *, unheld: bool = False
    ) -> _Request[list[None]]:
        """The finishes of `items`; with `unheld`, none for an owner who holds a schedule
        record's claim (its record's update is its finish)."""
        keys = [self.prefix + key for key, _, _ in items]
        statements: list[_Statement] = []
        for wave in _waves(keys):
            done = [i for i in wave if items[i][2]]
            failed = [i for i in wave if not items[i][2]]
            params = {
                "keys": [keys[i] for i in done],
                "owners": [items[i][1] for i in done],
                "rkeys": [keys[i] for i in failed],
                "rowners": [items[i][1] for i in failed],
                "now": now_ms,
                "retention": retention_ms,
            }
            statements.append((self.sql["finish_unheld" if unheld else "finish"], params))
        return _Request(statements, lambda _: [None] * len(items))

    def renew(self, key: str, owner: str, now_ms: int, lease_ms: int) -> _Request[bool]:
        params = {"key": self.prefix + key, "owner": owner, "now": now_ms, "lease": lease_ms}
        return _Request([(self.sql["renew"], params)], lambda results: bool(results[0]))

    def cancel(self, key: str, now_ms: int, retention_ms: int) -> _Request[None]:
        params = {"key": self.prefix + key, "now": now_ms, "retention": retention_ms}
        return _Request([(self.sql["cancel"], params)], lambda _: None)

    def pages(self) -> _Request[int]:
        return _Request(
            [(self.sql["pages"], {"table": self.table})], lambda results: int(results[0][0][0] or 0)
        )

    def purge_slice(self, low: int, now_ms: int) -> _Statement:
        return (self.sql["purge"], {"low": low, "high": low + _PURGE_PAGES, "now": now_ms})


def _single_claim(
    sql: _Statements, item: ClaimItem, *, now_ms: int, lease_ms: int
) -> _Request[ClaimResult]:
    """One item's claim, for a batch that failed: its outcome alone."""
    request = sql.claims([item], now_ms, lease_ms)
    return _Request(request.statements, lambda results: request.read(results)[0])


def _single_finish(
    sql: _Statements, item: FinishItem, *, now_ms: int, retention_ms: int
) -> _Request[None]:
    """One item's finish, for a batch that failed."""
    return _Request(sql.finishes([item], now_ms, retention_ms).statements, lambda _: None)


class _ScheduledBatch:
    """A worker's batch with its schedule (`scheduled_batch`), as statements: pure,
    shared by the sync and async stores. Sent in one pipeline, its implicit transaction
    committed by the pipeline's Sync: one transaction in two round trips.

    The record is the claim (docs/schedule.md): a claim whose ref names its record's
    generation, still scheduled, is held on the record, and its finish updates the
    record alone; no guard row is written for either. First the reads (`reads`): the
    records of the finishes' refs (who holds them), of the claims' refs (the schedule's
    word, `SQLSchedule.claim`'s rules) and the claims' live guard rows, which still
    decide. Their rows end the first round trip. Then every write (`writes`): the guard
    finishes of the finishes the records do not hold, the schedule's updates, the claims
    given back, the dropped copies counted, the record claims (a compare-and-set: one
    that another transaction changed in between is IN_PROGRESS, and runs later) and the
    guard claims, and the Sync: the second."""

    def __init__(
        self,
        sql: _Statements,
        schedule: SQLSchedule,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> None:
        self._sql = sql
        self._schedule = schedule
        self._finishes = finishes
        self._claims = claims
        self._now_ms = now_ms
        self._lease_ms = lease_ms
        self._retention_ms = retention_ms
        self._with_update = [(i, f[1], f[3]) for i, f in enumerate(finishes) if f[3] is not None]
        self._refs = [(i, c[2]) for i, c in enumerate(claims) if c[2] is not None]
        self.finished: list[Exception | None] = [None] * len(finishes)
        self._check_reads: list[tuple[str, Sql]] = []
        updates = [u for _, _, u in self._with_update]
        # Sent twice, it is the same as once unless it counts something: a retried or
        # parked record's failure, a dropped copy (see `_Attempt`).
        self.replayable = all(update.finished is Finished.HANDLED for update in updates)

    def reads(self) -> list[Sql]:
        """The first round trip, sent at once: who holds the finishes' records, the
        records of the claims' refs, and which claims' guard keys have a live row."""
        refs = [ref for _, ref in self._refs]
        self._check_reads = self._schedule.read_rows(refs, "check")
        statements = [s for _, s in self._check_reads]
        if refs:
            keys = [self._sql.prefix + self._claims[i][0] for i, _ in self._refs]
            statements.append(Sql(self._sql.sql["live"], {"keys": keys, "now": self._now_ms}))
        return statements

    def seen(self, results: list[Rows]) -> tuple[list[Any], set[str]]:
        """What `reads` found: each claim ref's record or None, and the claims' guard
        keys with a live row."""
        n_check = len(self._check_reads)
        check = self._schedule.found(self._check_reads, results[:n_check])
        records = [check.get((r.scope, r.key)) for _, r in self._refs]
        live: set[str] = set()
        if self._refs:
            n = len(self._sql.prefix)
            live = {key[n:] for (key,) in results[n_check]}
        return records, live

    def writes(
        self, seen: tuple[list[Any], set[str]]
    ) -> tuple[Program[None], _Request[list[ClaimResult]]]:
        """The second round trip (or the only one, with no claim to read for), given the
        reads: the schedule's writes (a program), and the statements whose rows make the
        claims' outcomes."""
        rows, live = seen
        # the finishes of records their owners hold write no guard row (`finish_unheld`)
        with_update = [f[:3] for f in self._finishes if f[3] is not None]
        plain = [f[:3] for f in self._finishes if f[3] is None]
        releases = [f[1] for f in self._finishes if f[3] is None]
        updates = [u for _, _, u in self._with_update]
        outcomes: dict[int, ClaimResult] = {}
        on_claim: list[tuple[int, str, str, Ref]] = []  # (slot, guard key, owner, ref)
        drops: list[Ref] = []
        taken: set[tuple[str, str]] = set()
        for (i, ref), row in zip(self._refs, rows, strict=True):
            if row is None:
                continue
            key, owner = self._claims[i][0], self._claims[i][1]
            generation, state = int(row[0]), ScheduleState(row[1])
            verdict = rules.check_state(generation, state, ref.generation)
            if verdict is not None:
                outcomes[i] = VERDICT_RESULT[verdict]
                if verdict is not Verdict.HANDLED:
                    drops.append(ref)
                    self.replayable = False  # a dropped copy is counted
                continue
            if key in live:
                continue
            answer = rules.claim_on_record(
                generation,
                state,
                row[2],
                row[3],
                row[4],
                ref=ref,
                owner=owner,
                now_ms=self._now_ms,
            )
            if answer is None:
                continue
            at = (ref.scope, ref.key)
            if answer == rules.RECORD_BUSY or at in taken:
                outcomes[i] = ClaimResult.IN_PROGRESS
            else:
                taken.add(at)
                on_claim.append((i, key, owner, ref))
        rest = [i for i in range(len(self._claims)) if i not in outcomes]
        rest = [i for i in rest if i not in {c[0] for c in on_claim}]
        now_ms, schedule = self._now_ms, self._schedule

        def program() -> Program[None]:
            retention_ms = self._retention_ms
            if with_update:
                request = self._sql.finishes(with_update, now_ms, retention_ms, unheld=True)
                for sql, params in request.statements:
                    yield Sql(sql, params)
            if plain:
                for sql, params in self._sql.finishes(plain, now_ms, retention_ms).statements:
                    yield Sql(sql, params)
                yield from schedule.release_owners(releases)
            if updates:
                yield from schedule.finish(updates, now_ms)
            yield from schedule.dropped(drops, now_ms)

        held = schedule.claim_records(
            [(owner, ref) for _, _, owner, ref in on_claim], now_ms, self._lease_ms
        )
        guard = self._sql.claims(
            [(self._claims[i][0], self._claims[i][1]) for i in rest], now_ms, self._lease_ms
        )

        def read(results: list[Rows]) -> list[ClaimResult]:
            got = {(r[0], r[1]) for r in results[0]} if held is not None else set()
            for slot, _, _, ref in on_claim:
                claimed = (ref.scope, ref.key) in got
                outcomes[slot] = ClaimResult.CLAIMED if claimed else ClaimResult.IN_PROGRESS
            guard_rows = results[1:] if held is not None else results
            outcomes.update(zip(rest, guard.read(guard_rows), strict=True))
            return [outcomes[i] for i in range(len(self._claims))]

        statements = ([held] if held is not None else []) + guard.statements
        return pipelined(program()), _Request(statements, read)


_ScheduledResult = tuple[list[Exception | None], list[ClaimResult | Exception]]


class _Failed(Exception):
    """A scheduled batch's failure thrown into `_scheduled_plan`: the driver's error,
    and whether the connection was lost with it."""

    def __init__(self, error: Exception, lost: bool) -> None:
        super().__init__(error)
        self.error = error
        self.lost = lost


def _scheduled_plan(
    sql: _Statements,
    schedule: SQLSchedule,
    finishes: Sequence[ScheduledFinish],
    claims: Sequence[ScheduledClaim],
    now_ms: int,
    lease_ms: int,
    retention_ms: int,
) -> Generator[Callable[[], _ScheduledBatch], Any, _ScheduledResult]:
    """`scheduled_batch` for both stores, as the batches to send (sans-I/O): the whole
    batch in one transaction; when it fails (the driver throws the error in, with
    whether the connection was lost), every item with a lost connection, else each item
    alone, its error in its slot."""
    valid_f, slots_f = _checked(finishes)
    valid_c, slots_c = _checked(claims)
    chosen_f = [finishes[i] for i in valid_f]
    chosen_c = [claims[i] for i in valid_c]
    if not chosen_f and not chosen_c:  # nothing valid: TypeErrors only
        return slots_f, _fill(slots_c, [], [])
    plan = partial(
        _ScheduledBatch,
        sql,
        schedule,
        now_ms=now_ms,
        lease_ms=lease_ms,
        retention_ms=retention_ms,
    )
    finished: list[Exception | None] = []
    claimed: list[ClaimResult | Exception] = []
    try:
        done, answered = yield partial(plan, chosen_f, chosen_c)
        finished, claimed = list(done), list(answered)
    except _Failed as failed:
        if failed.lost:  # the connection is lost: every item with it
            return [failed.error] * len(finishes), [failed.error] * len(claims)
        for f in chosen_f:
            try:
                finished.append((yield partial(plan, [f], []))[0][0])
            except _Failed as one:
                finished.append(one.error)
        for c in chosen_c:
            try:
                claimed.append((yield partial(plan, [], [c]))[1][0])
            except _Failed as one:
                claimed.append(one.error)
    return _fill(slots_f, valid_f, finished), _fill(slots_c, valid_c, claimed)


@dataclass
class _Attempt:
    """One sending of a transaction. Once its COMMIT (or the pipeline's Sync) may have
    reached the server (`committing`), a connection that breaks leaves it unknown
    whether it was written: it is sent again on a new connection only when sending it
    twice is the same as once (`replayable`); before that, nothing was written."""

    replayable: bool
    committing: bool = False


def _then(first: _Request[T], second: _Request[R]) -> _Request[tuple[T, R]]:
    """Both requests in one round trip, `first`'s statements first."""
    n = len(first.statements)
    return _Request(
        first.statements + second.statements,
        lambda results: (first.read(results[:n]), second.read(results[n:])),
    )


# -- connections ---------------------------------------------------------------------------


def _import_psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError(
            "the postgres idempotency store needs psycopg 3: pip install 'rabbit-delay[postgres]'"
        ) from None
    return psycopg


def _conninfo(lib: Any, url: str, timeout_s: float) -> str:
    """The conninfo the store connects with; ConfigError for a URL libpq cannot parse
    (the password never shown)."""
    if timeout_s <= 0:
        raise ConfigError(f"the PostgreSQL store's timeout must be positive, got {timeout_s}")
    try:
        lib.conninfo.conninfo_to_dict(url)
    except lib.ProgrammingError as exc:
        raise ConfigError(
            f"invalid PostgreSQL URL {redact(url)!r}: {redact(str(exc))}; write "
            "postgresql://user:password@host:5432/dbname"
        ) from None
    return str(
        lib.conninfo.make_conninfo(
            url,
            connect_timeout=max(1, round(timeout_s)),
            fallback_application_name="rabbit-delay",
        )
    )


def _session_setup(timeout_s: float) -> str:
    # A statement waiting on a row another session holds locked (a handler's own open
    # transaction) fails after the timeout, as SQLite's busy timeout does.
    return f"SET statement_timeout = {int(timeout_s * 1000)}"


def _server_version_ok(version: int) -> None:
    if version < _MIN_SERVER_VERSION:
        raise ConfigError(
            f"the PostgreSQL idempotency store needs PostgreSQL 14 or newer (TID range "
            f"scans for purge); the server is {version // 10_000}"
        )


def _is_broken(conn: Any) -> bool:
    return bool(conn.closed or conn.broken)


class _Base:
    needs_purge = True  # expired rows stay until purge()

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        table: str,
        server_clock: bool,
        timeout_s: float,
    ) -> None:
        check_table_name(table, "PostgreSQL")
        if len(table) > _MAX_TABLE_NAME:
            raise ConfigError(
                f"the PostgreSQL table name {table!r} is too long: at most {_MAX_TABLE_NAME} "
                "characters (the schedule's table and indexes are named after it, and "
                "PostgreSQL cuts names at 63)"
            )
        self._lib = _import_psycopg()
        self.url = url
        self.prefix = prefix
        self.table = table
        self.server_clock = server_clock
        self.timeout_s = timeout_s
        self._conninfo = _conninfo(self._lib, url, timeout_s)
        self._error: type[Exception] = self._lib.Error
        self._sql = _Statements(table, prefix, server_clock)
        self.schedule_table = f"{table}_schedule"
        self._schedule_sql = SQLSchedule(self.schedule_table, POSTGRES)
        # Every table the store creates on first use, with its name.
        self._tables: tuple[tuple[_Table, str], ...] = (
            (IDEMPOTENCY, table),
            (SCHEDULE, self.schedule_table),
        )
        self._deadlock: type[Exception] = self._lib.errors.DeadlockDetected
        self._closed = False

    def __repr__(self) -> str:  # never show the password
        return f"{type(self).__name__}({redact(self.url)!r}, table={self.table!r})"

    def _closed_error(self) -> Exception:
        error: Exception = self._lib.OperationalError(f"the {type(self).__name__} is closed")
        return error


def _fill(slots: list[Any], valid: list[int], outcomes: Sequence[Any]) -> list[Any]:
    for i, outcome in zip(valid, outcomes, strict=True):
        slots[i] = outcome
    return slots


class PostgresStore(_Base):
    """A synchronous PostgreSQL store: one connection per store (autocommit), serialised
    by a lock, so threads may share a store; other processes and hosts open their own.

    `url` is a libpq URL or conninfo (`postgresql://user:password@host:5432/dbname`; a
    password may also come from $PGPASSWORD or ~/.pgpass, session settings from
    `?options=-c...`). The connection is opened, and the table created if it is missing,
    on first use; a connection found broken is opened again, and an operation it broke
    is sent once more on the new one (every operation is idempotent). `timeout_s` bounds
    the connect and each statement (`statement_timeout`). Expiry follows the server's
    clock unless `server_clock=False`.

    Raises ConfigError for an invalid table name or URL, or when psycopg is not
    installed (the `postgres` extra); operations raise `psycopg.Error` (OperationalError
    for a lost or refused connection, ConfigError for a server older than PostgreSQL
    14); the batch operations return them in their slots instead.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        table: str = DEFAULT_IDEMPOTENCY_TABLE,
        server_clock: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(
            url, prefix=prefix, table=table, server_clock=server_clock, timeout_s=timeout_s
        )
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self.schedule = PostgresSchedule(self)

    # -- IdempotencyStore --------------------------------------------------------------

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim`. Raises `psycopg.Error`."""
        results: list[ClaimResult] = self._call(self._sql.claims([(key, owner)], now_ms, lease_ms))
        return results[0]

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete`. Raises `psycopg.Error`."""
        self._call(self._sql.finishes([(key, owner, True)], now_ms, retention_ms))

    def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `psycopg.Error`."""
        self._call(self._sql.finishes([(key, owner, False)], 0, 0))

    def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """See `IdempotencyStore.renew`. Raises `psycopg.Error`."""
        return bool(self._call(self._sql.renew(key, owner, now_ms, lease_ms)))

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `psycopg.Error`."""
        self._call(self._sql.cancel(key, now_ms, retention_ms))

    def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """See `IdempotencyStore.claim_many`: one statement (one more per key repeated
        in the batch, pipelined), one round trip. When it fails, nothing was written and
        each item runs alone, so a bad item fails alone; a lost connection fails all."""
        valid, slots = _checked(items)
        chosen = [items[i] for i in valid]
        whole = self._sql.claims(chosen, now_ms, lease_ms)
        single = partial(_single_claim, self._sql, now_ms=now_ms, lease_ms=lease_ms)
        outcomes = self._batch(whole, chosen, single)
        return _fill(slots, valid, outcomes)

    def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `IdempotencyStore.finish_many`: completes and releases in one statement,
        one round trip; errors into their slots like `claim_many`."""
        valid, slots = _checked(items)
        chosen = [items[i] for i in valid]
        whole = self._sql.finishes(chosen, now_ms, retention_ms)
        single = partial(_single_finish, self._sql, now_ms=now_ms, retention_ms=retention_ms)
        outcomes = self._batch(whole, chosen, single)
        return _fill(slots, valid, outcomes)

    def finish_and_claim_many(
        self,
        finishes: Sequence[FinishItem],
        claims: Sequence[ClaimItem],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """`finish_many` then `claim_many` in one round trip and one transaction (a
        pipeline): the sync worker's whole batch costs one commit. When a statement
        fails, nothing was written and each kind runs on its own."""
        valid_f, slots_f = _checked(finishes)
        valid_c, slots_c = _checked(claims)
        if valid_f and valid_c and not self._closed:
            chosen_f = [finishes[i] for i in valid_f]
            chosen_c = [claims[i] for i in valid_c]
            both = _then(
                self._sql.finishes(chosen_f, now_ms, retention_ms),
                self._sql.claims(chosen_c, now_ms, lease_ms),
            )
            with self._lock:
                try:
                    _, claimed = self._run(both)
                except self._error as exc:
                    if self._conn is None:  # the connection is lost: every item with it
                        return [exc] * len(finishes), [exc] * len(claims)
                else:
                    return (
                        _fill(slots_f, valid_f, [None] * len(valid_f)),
                        _fill(slots_c, valid_c, claimed),
                    )
        return (
            self.finish_many(finishes, now_ms=now_ms, retention_ms=retention_ms),
            self.claim_many(claims, now_ms=now_ms, lease_ms=lease_ms),
        )

    def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `SchedulingStore.scheduled_batch`: one transaction, in one round trip, or
        two when a claim carries a Ref (the schedule's answer decides what is claimed:
        `_ScheduledBatch`). When a statement fails nothing was written, and each item
        runs alone, its error in its slot; a lost connection fails every item."""
        plan = _scheduled_plan(
            self._sql, self._schedule_sql, finishes, claims, now_ms, lease_ms, retention_ms
        )
        with self._lock:
            try:
                request = next(plan)
                while True:
                    try:
                        reply: Any = self._scheduled(request)
                    except self._error as exc:
                        request = plan.throw(_Failed(exc, self._conn is None))
                    else:
                        request = plan.send(reply)
            except StopIteration as stop:
                result: _ScheduledResult = stop.value
                return result

    def run_schedule(self, make: Callable[[], Program[T]], *, write: bool) -> T:
        """Run the schedule program `make()` (`SQLSchedule`): with `write`, in a
        transaction of its own, else in autocommit (a read, or a statement that may be
        sent twice). Raises `psycopg.Error`."""
        with self._lock:
            return self._transact(partial(self._send_program, make, write), not write)

    def purge(self, *, now_ms: int) -> int:
        """See `IdempotencyStore.purge`: every expired row of the table, whatever its
        prefix, a slice of pages per statement (the lock is released between slices, so
        other threads' operations interleave), then every expired schedule record (by
        the caller's clock, `now_ms`), a slice of rows per statement. Raises
        `psycopg.Error`."""
        pages = self._call(self._sql.pages())
        total = 0
        for low in range(0, pages, _PURGE_PAGES):
            sql, params = self._sql.purge_slice(low, now_ms)
            total += self._call(_Request([(sql, params)], lambda _: 0), rowcount=True)
        return total + self.schedule.purge(now_ms=now_ms)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- execution -------------------------------------------------------------------------

    def _call(self, request: _Request[T], *, rowcount: bool = False) -> Any:
        with self._lock:
            return self._run(request, rowcount=rowcount)

    def _batch(
        self, whole: _Request[list[R]], items: Sequence[T], single: Callable[[T], _Request[R]]
    ) -> list[R | Exception]:
        """`whole` (the batch of `items`) in one round trip; when a statement fails
        (nothing was written), each item alone (`single(item)`), its error in its slot.
        A lost connection fails every item."""
        if not items:
            return []
        with self._lock:
            try:
                return list(self._run(whole))
            except self._error as exc:
                if self._conn is None:
                    return [exc] * len(items)
            outcomes: list[R | Exception] = []
            for item in items:
                try:
                    outcomes.append(self._run(single(item)))
                except self._error as exc:
                    outcomes.append(exc)
            return outcomes

    def _run(self, request: _Request[T], *, rowcount: bool = False) -> Any:
        """Send `request` (the caller holds the lock); once more on a new connection
        when the one it was sent on turns out broken. Its result, or with `rowcount` the
        rows its single statement changed."""
        if self._closed:
            raise self._closed_error()
        conn = self._conn
        if conn is not None:
            try:
                return self._send(conn, request, rowcount)
            except self._error:
                if not _is_broken(conn):
                    raise
                self._drop()
        conn = self._connect()
        try:
            return self._send(conn, request, rowcount)
        except self._error:
            if _is_broken(conn):
                self._drop()
            raise

    @staticmethod
    def _send(conn: psycopg.Connection[Any], request: _Request[T], rowcount: bool) -> Any:
        statements = request.statements
        if len(statements) == 1:
            sql, params = statements[0]
            cur = conn.execute(sql, params)
            if rowcount:
                return cur.rowcount
            return request.read([cur.fetchall() if cur.description else []])
        with conn.pipeline():
            cursors = [conn.execute(sql, params) for sql, params in statements]
        return request.read([c.fetchall() if c.description else [] for c in cursors])

    def _scheduled(
        self, plan: Callable[[], _ScheduledBatch]
    ) -> tuple[list[Exception | None], list[ClaimResult]]:
        """A scheduled batch `plan()` (the caller holds the lock)."""
        return self._transact(partial(self._send_scheduled, plan), True)

    def _transact(
        self, send: Callable[[psycopg.Connection[Any], _Attempt], T], replayable: bool
    ) -> T:
        """`send(conn, attempt)`, a transaction (the caller holds the lock). Once more
        on a new connection when the one it was sent on turns out broken, unless it may
        have committed there and is not `replayable` (`_Attempt`); again when the server
        rolled it back to break a deadlock."""
        for tries in range(1, _DEADLOCK_ATTEMPTS + 1):
            try:
                return self._transact_once(send, replayable)
            except self._deadlock:
                if tries == _DEADLOCK_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _transact_once(
        self, send: Callable[[psycopg.Connection[Any], _Attempt], T], replayable: bool
    ) -> T:
        if self._closed:
            raise self._closed_error()
        conn = self._conn
        if conn is not None:
            attempt = _Attempt(replayable)
            try:
                return send(conn, attempt)
            except self._error:
                if not _is_broken(conn):
                    raise
                self._drop()
                if attempt.committing and not attempt.replayable:
                    raise
        conn = self._connect()
        try:
            return send(conn, _Attempt(replayable))
        except self._error:
            if _is_broken(conn):
                self._drop()
            raise

    @staticmethod
    def _send_program(
        make: Callable[[], Program[T]],
        write: bool,
        conn: psycopg.Connection[Any],
        attempt: _Attempt,
    ) -> T:
        cursor = conn.cursor()
        if not write:
            return run_sync(cursor, make())
        with conn.transaction():
            result = run_sync(cursor, make())
            attempt.committing = True
        return result

    @staticmethod
    def _send_scheduled(
        plan: Callable[[], _ScheduledBatch], conn: psycopg.Connection[Any], attempt: _Attempt
    ) -> tuple[list[Exception | None], list[ClaimResult]]:
        batch = plan()
        with conn.pipeline():
            reads = [conn.execute(r.text, r.params) for r in batch.reads()]
            seen = batch.seen([c.fetchall() for c in reads])  # ends a round trip, if any
            program, claims = batch.writes(seen)
            run_sync(conn.cursor(), program)
            cursors = [conn.execute(sql, params) for sql, params in claims.statements]
            attempt.replayable = batch.replayable
            attempt.committing = True  # the Sync, as the pipeline ends
        claimed = claims.read([c.fetchall() if c.description else [] for c in cursors])
        return batch.finished, claimed

    def _connect(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] = self._lib.connect(self._conninfo, autocommit=True)
        try:
            _server_version_ok(conn.info.server_version)
            conn.execute(_session_setup(self.timeout_s))
            for table, name in self._tables:
                if conn.execute(_EXISTS, {"table": name}).fetchone() != (True,):
                    with conn.transaction():
                        conn.execute(_CREATE_LOCK, {"table": name})
                        for ddl in table.create(name):
                            conn.execute(ddl)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class AsyncPostgresStore(_Base):
    """`PostgresStore` over psycopg's `AsyncConnection`; the same table and records, so
    both can share a database. One connection, its operations one at a time (the async
    worker sends its claims and finishes in batches, one round trip each).

    Raises like `PostgresStore`: ConfigError when created, `psycopg.Error` from the
    operations, except the batch operations, which return them in their slots.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        table: str = DEFAULT_IDEMPOTENCY_TABLE,
        server_clock: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(
            url, prefix=prefix, table=table, server_clock=server_clock, timeout_s=timeout_s
        )
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock: asyncio.Lock | None = None  # made on the loop that first uses it
        self.schedule = AsyncPostgresSchedule(self)

    @classmethod
    def twin_of(cls, store: PostgresStore) -> AsyncPostgresStore:
        """An async store on the same database, table, prefix and clock as `store`
        (a connection of its own)."""
        return cls(
            store.url,
            prefix=store.prefix,
            table=store.table,
            server_clock=store.server_clock,
            timeout_s=store.timeout_s,
        )

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim`. Raises `psycopg.Error`."""
        results: list[ClaimResult] = await self._call(
            self._sql.claims([(key, owner)], now_ms, lease_ms)
        )
        return results[0]

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete`. Raises `psycopg.Error`."""
        await self._call(self._sql.finishes([(key, owner, True)], now_ms, retention_ms))

    async def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `psycopg.Error`."""
        await self._call(self._sql.finishes([(key, owner, False)], 0, 0))

    async def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """See `IdempotencyStore.renew`. Raises `psycopg.Error`."""
        return bool(await self._call(self._sql.renew(key, owner, now_ms, lease_ms)))

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `psycopg.Error`."""
        await self._call(self._sql.cancel(key, now_ms, retention_ms))

    async def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """See `PostgresStore.claim_many`."""
        valid, slots = _checked(items)
        chosen = [items[i] for i in valid]
        whole = self._sql.claims(chosen, now_ms, lease_ms)
        single = partial(_single_claim, self._sql, now_ms=now_ms, lease_ms=lease_ms)
        return _fill(slots, valid, await self._batch(whole, chosen, single))

    async def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `PostgresStore.finish_many`."""
        valid, slots = _checked(items)
        chosen = [items[i] for i in valid]
        whole = self._sql.finishes(chosen, now_ms, retention_ms)
        single = partial(_single_finish, self._sql, now_ms=now_ms, retention_ms=retention_ms)
        return _fill(slots, valid, await self._batch(whole, chosen, single))

    async def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `PostgresStore.scheduled_batch`."""
        plan = _scheduled_plan(
            self._sql, self._schedule_sql, finishes, claims, now_ms, lease_ms, retention_ms
        )
        async with self._locked():
            try:
                request = next(plan)
                while True:
                    try:
                        reply: Any = await self._scheduled(request)
                    except self._error as exc:
                        request = plan.throw(_Failed(exc, self._conn is None))
                    else:
                        request = plan.send(reply)
            except StopIteration as stop:
                result: _ScheduledResult = stop.value
                return result

    async def run_schedule(self, make: Callable[[], Program[T]], *, write: bool) -> T:
        """See `PostgresStore.run_schedule`."""
        async with self._locked():
            return await self._transact(partial(self._send_program, make, write), not write)

    async def purge(self, *, now_ms: int) -> int:
        """See `PostgresStore.purge`. Raises `psycopg.Error`."""
        pages = int(await self._call(self._sql.pages()))
        total = 0
        for low in range(0, pages, _PURGE_PAGES):
            sql, params = self._sql.purge_slice(low, now_ms)
            total += int(await self._call(_Request([(sql, params)], lambda _: 0), rowcount=True))
        return total + await self.schedule.purge(now_ms=now_ms)

    async def close(self) -> None:
        self._closed = True
        async with self._locked():
            if self._conn is not None:
                await self._conn.close()
                self._conn = None

    async def __aenter__(self) -> AsyncPostgresStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- execution -------------------------------------------------------------------------

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _call(self, request: _Request[T], *, rowcount: bool = False) -> Any:
        async with self._locked():
            return await self._run(request, rowcount=rowcount)

    async def _batch(
        self, whole: _Request[list[R]], items: Sequence[T], single: Callable[[T], _Request[R]]
    ) -> list[R | Exception]:
        """See `PostgresStore._batch`."""
        if not items:
            return []
        async with self._locked():
            try:
                return list(await self._run(whole))
            except self._error as exc:
                if self._conn is None:
                    return [exc] * len(items)
            outcomes: list[R | Exception] = []
            for item in items:
                try:
                    outcomes.append(await self._run(single(item)))
                except self._error as exc:
                    outcomes.append(exc)
            return outcomes

    async def _run(self, request: _Request[T], *, rowcount: bool = False) -> Any:
        """See `PostgresStore._run`."""
        if self._closed:
            raise self._closed_error()
        conn = self._conn
        if conn is not None:
            try:
                return await self._send(conn, request, rowcount)
            except self._error:
                if not _is_broken(conn):
                    raise
                await self._drop()
        conn = await self._connect()
        try:
            return await self._send(conn, request, rowcount)
        except self._error:
            if _is_broken(conn):
                await self._drop()
            raise

    @staticmethod
    async def _send(
        conn: psycopg.AsyncConnection[Any], request: _Request[T], rowcount: bool
    ) -> Any:
        statements = request.statements
        if len(statements) == 1:
            sql, params = statements[0]
            cur = await conn.execute(sql, params)
            if rowcount:
                return cur.rowcount
            return request.read([await cur.fetchall() if cur.description else []])
        async with conn.pipeline():
            cursors = [await conn.execute(sql, params) for sql, params in statements]
        return request.read([await c.fetchall() if c.description else [] for c in cursors])

    async def _scheduled(
        self, plan: Callable[[], _ScheduledBatch]
    ) -> tuple[list[Exception | None], list[ClaimResult]]:
        """See `PostgresStore._scheduled`."""
        return await self._transact(partial(self._send_scheduled, plan), True)

    async def _transact(
        self,
        send: Callable[[psycopg.AsyncConnection[Any], _Attempt], Awaitable[T]],
        replayable: bool,
    ) -> T:
        """See `PostgresStore._transact`."""
        for tries in range(1, _DEADLOCK_ATTEMPTS + 1):
            try:
                return await self._transact_once(send, replayable)
            except self._deadlock:
                if tries == _DEADLOCK_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    async def _transact_once(
        self,
        send: Callable[[psycopg.AsyncConnection[Any], _Attempt], Awaitable[T]],
        replayable: bool,
    ) -> T:
        if self._closed:
            raise self._closed_error()
        conn = self._conn
        if conn is not None:
            attempt = _Attempt(replayable)
            try:
                return await send(conn, attempt)
            except self._error:
                if not _is_broken(conn):
                    raise
                await self._drop()
                if attempt.committing and not attempt.replayable:
                    raise
        conn = await self._connect()
        try:
            return await send(conn, _Attempt(replayable))
        except self._error:
            if _is_broken(conn):
                await self._drop()
            raise

    @staticmethod
    async def _send_program(
        make: Callable[[], Program[T]],
        write: bool,
        conn: psycopg.AsyncConnection[Any],
        attempt: _Attempt,
    ) -> T:
        cursor = conn.cursor()
        if not write:
            return await run_async(cursor, make())
        async with conn.transaction():
            result = await run_async(cursor, make())
            attempt.committing = True
        return result

    @staticmethod
    async def _send_scheduled(
        plan: Callable[[], _ScheduledBatch],
        conn: psycopg.AsyncConnection[Any],
        attempt: _Attempt,
    ) -> tuple[list[Exception | None], list[ClaimResult]]:
        batch = plan()
        async with conn.pipeline():
            reads = [await conn.execute(r.text, r.params) for r in batch.reads()]
            seen = batch.seen([await c.fetchall() for c in reads])  # ends a round trip, if any
            program, claims = batch.writes(seen)
            await run_async(conn.cursor(), program)
            cursors = [await conn.execute(sql, params) for sql, params in claims.statements]
            attempt.replayable = batch.replayable
            attempt.committing = True
        rows = [await c.fetchall() if c.description else [] for c in cursors]
        return batch.finished, claims.read(rows)

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        conn: psycopg.AsyncConnection[Any] = await self._lib.AsyncConnection.connect(
            self._conninfo, autocommit=True
        )
        try:
            _server_version_ok(conn.info.server_version)
            await conn.execute(_session_setup(self.timeout_s))
            for table, name in self._tables:
                cur = await conn.execute(_EXISTS, {"table": name})
                if await cur.fetchone() != (True,):
                    async with conn.transaction():
                        await conn.execute(_CREATE_LOCK, {"table": name})
                        for ddl in table.create(name):
                            await conn.execute(ddl)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        return conn

    async def _drop(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


# -- the schedule ------------------------------------------------------------------------


class PostgresSchedule:
    """`PostgresStore`'s schedule (`ScheduleBook`): table `<table>_schedule` beside the
    idempotency table, created with it on first use. Each operation is a program of
    `SQLSchedule` on the store's connection, under its lock: one that writes in a
    transaction of its own, a read in autocommit. Always the caller's clock (`now_ms`),
    whatever the store's `server_clock`. Raises `psycopg.Error`."""

    def __init__(self, store: PostgresStore) -> None:
        self._run = store.run_schedule
        self._sql = store._schedule_sql

    def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        return self._run(partial(self._sql.place_many, list(entries), now_ms), write=True)

    def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        return self._run(partial(self._sql.lookup, scope, key), write=False)

    def select(self, query: Query) -> list[ScheduleRecord]:
        return self._run(partial(self._sql.select, query), write=False)

    def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return self._run(partial(self._sql.cancel, scope, key, now_ms, hold_ms), write=True)

    def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        program = partial(self._sql.reschedule, scope, key, due_ms, message_id, now_ms, sweep_ms)
        return self._run(program, write=True)

    def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        return self._run(partial(self._sql.overdue, scope, now_ms, limit), write=False)

    def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        self._run(partial(self._sql.swept, scope, list(items), now_ms), write=True)

    def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        return self._run(partial(self._sql.lateness, scope, since_ms, sample), write=False)

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        return self._run(partial(self._sql.count_due, scope, queue, list(edges)), write=False)

    def purge(self, *, now_ms: int) -> int:
        """Expired records, `_SCHEDULE_PURGE_ROWS` per statement (the lock is released
        between them)."""
        total = 0
        while True:
            program = partial(self._sql.purge, now_ms, _SCHEDULE_PURGE_ROWS)
            deleted = self._run(program, write=False)
            total += deleted
            if deleted < _SCHEDULE_PURGE_ROWS:
                return total


class AsyncPostgresSchedule:
    """`AsyncPostgresStore`'s schedule (`AsyncScheduleBook`): `PostgresSchedule` on
    the async store's connection."""

    def __init__(self, store: AsyncPostgresStore) -> None:
        self._run = store.run_schedule
        self._sql = store._schedule_sql

    async def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        return await self._run(partial(self._sql.place_many, list(entries), now_ms), write=True)

    async def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        return await self._run(partial(self._sql.lookup, scope, key), write=False)

    async def select(self, query: Query) -> list[ScheduleRecord]:
        return await self._run(partial(self._sql.select, query), write=False)

    async def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return await self._run(partial(self._sql.cancel, scope, key, now_ms, hold_ms), write=True)

    async def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        program = partial(self._sql.reschedule, scope, key, due_ms, message_id, now_ms, sweep_ms)
        return await self._run(program, write=True)

    async def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        return await self._run(partial(self._sql.overdue, scope, now_ms, limit), write=False)

    async def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        await self._run(partial(self._sql.swept, scope, list(items), now_ms), write=True)

    async def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        return await self._run(partial(self._sql.lateness, scope, since_ms, sample), write=False)

    async def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        program = partial(self._sql.count_due, scope, queue, list(edges))
        return await self._run(program, write=False)

    async def purge(self, *, now_ms: int) -> int:
        """See `PostgresSchedule.purge`."""
        total = 0
        while True:
            program = partial(self._sql.purge, now_ms, _SCHEDULE_PURGE_ROWS)
            deleted = await self._run(program, write=False)
            total += deleted
            if deleted < _SCHEDULE_PURGE_ROWS:
                return total
