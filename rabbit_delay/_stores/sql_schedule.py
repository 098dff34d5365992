"""The schedule in SQL, written once for SQLite and PostgreSQL: the table, and every
operation as a program of statements (sans-I/O, like the worker's programs).

A program yields `Sql` statements and is sent back what each returned (rows, one row,
or a row count); `run_sync` executes it on a DB-API cursor, `run_async` on psycopg's
async cursor. The store around it opens the transaction: SQLite's BEGIN IMMEDIATE takes
the write lock first, so read-then-write is atomic there; on PostgreSQL every write is a
compare-and-set on the generation and state read before (`place`, `cancel`,
`reschedule`), tried again when another transaction changed the row in between, so
READ COMMITTED is enough. The read locks the row it finds (FOR UPDATE), so the write
that follows wins; a new key has no row to lock, and of two first publishes racing for
it, the second INSERT waits for the first to commit, changes nothing (ON CONFLICT DO
NOTHING) and reads again: generation 2. Rows are written in (scope, key) order, so two
transactions over the same keys wait for each other instead of deadlocking.

The rules themselves are in `rabbit_delay._schedule.rules`; the statements here apply
them, and the store contract tests hold them to the memory store's answers.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rabbit_delay._schedule import rules
from rabbit_delay._schedule.book import SweptItem
from rabbit_delay._schedule.records import (
    MAX_PAGE,
    Entry,
    Finished,
    Payload,
    Placed,
    Placement,
    Query,
    Ref,
    ScheduleRecord,
    ScheduleState,
    Update,
    Verdict,
)

T = TypeVar("T")
Fetch = Literal["none", "one", "all", "rowcount"]
# A compare-and-set that lost to another writer is tried again this many times.
_CAS_ATTEMPTS = 20
# Rows per statement when many keys are read at once (SQLite before 3.32: 999 parameters).
_KEYS_PER_READ = 400


@dataclass(frozen=True, slots=True)
class Sql:
    text: str
    params: Sequence[Any] | Mapping[str, Any] = ()
    fetch: Fetch = "none"
    many: bool = False  # params is a sequence of parameter rows (executemany)


Program = Generator[Sql, Any, T]


@dataclass(frozen=True, slots=True)
class Dialect:
    """What differs between the two databases: the parameter marker, the column types."""

    name: str
    marker: str  # "?" (sqlite3) or "%s" (psycopg)
    int_type: str  # 64-bit milliseconds
    blob_type: str
    # The scope and key columns: compared byte by byte on both (SQLite's BINARY, which
    # is its default; PostgreSQL's "C" whatever the database's collation), so pages come
    # in the memory store's order (Python's str order) and compare fast.
    text_key: str

    def sql(self, text: str) -> str:
        return text if self.marker == "?" else text.replace("?", self.marker)


SQLITE = Dialect("sqlite", "?", "INTEGER", "BLOB", "TEXT")
POSTGRES = Dialect("postgres", "%s", "BIGINT", "BYTEA", 'TEXT COLLATE "C"')

_COLUMNS = (
    "scope, key, generation, state, queue, due_ms, message_id, created_ms, updated_ms, "
    "attempts, last_error, expires_ms, sweep_ms, replaced, dropped, republished"
)
_PAYLOAD = "body, content_type, headers"


def schema(table: str, dialect: Dialect) -> list[str]:
    """The statements that create the table and its indexes (idempotent).

    Indexes: the primary key (scope, key) for look-ups, claims and updates; (scope,
    due_ms, key) and (scope, queue, due_ms, key) for pages in due order; partial ones
    for the sweeper (scheduled records by sweep time) and the purge (finished records by
    expiry), which also gives the lateness sample (the records finished last). No index
    of handled records by time: it cost a worker 20 us a message, measured.)

    `owner` and `lease_until`: a worker's claim held on the record itself (the record as
    the claim: `SQLSchedule.claim`), indexed only while held (a handful of rows: the
    deliveries in flight), so that a renewal or a release finds it by its owner."""
    i, b, k = dialect.int_type, dialect.blob_type, dialect.text_key
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
    scope {k} NOT NULL,
    key {k} NOT NULL,
    generation {i} NOT NULL,
    state TEXT NOT NULL,
    queue TEXT NOT NULL,
    due_ms {i} NOT NULL,
    message_id TEXT NOT NULL,
    created_ms {i} NOT NULL,
    updated_ms {i} NOT NULL,
    attempts {i} NOT NULL DEFAULT 0,
    last_error TEXT,
    expires_ms {i},
    sweep_ms {i},
    replaced {i} NOT NULL DEFAULT 0,
    dropped {i} NOT NULL DEFAULT 0,
    republished {i} NOT NULL DEFAULT 0,
    body {b},
    content_type TEXT,
    headers TEXT,
    owner TEXT,
    lease_until {i},
    PRIMARY KEY (scope, key)
)""",
        f"CREATE INDEX IF NOT EXISTS {table}_due ON {table} (scope, due_ms, key)",
        f"CREATE INDEX IF NOT EXISTS {table}_queue ON {table} (scope, queue, due_ms, key)",
        f"CREATE INDEX IF NOT EXISTS {table}_sweep ON {table} (scope, sweep_ms) "
        "WHERE sweep_ms IS NOT NULL",
        f"CREATE INDEX IF NOT EXISTS {table}_expires ON {table} (expires_ms) "
        "WHERE expires_ms IS NOT NULL",
        f"CREATE INDEX IF NOT EXISTS {table}_owner ON {table} (owner) WHERE owner IS NOT NULL",
    ]


def _record(row: Sequence[Any], with_payload: bool) -> ScheduleRecord:
    payload = None
    if with_payload and len(row) > 16 and row[16] is not None:
        headers = json.loads(row[18]) if row[18] else {}
        payload = Payload(bytes(row[16]), row[17] or "application/octet-stream", headers)
    return ScheduleRecord(
        scope=row[0],
        key=row[1],
        generation=int(row[2]),
        state=ScheduleState(row[3]),
        queue=row[4],
        due_ms=int(row[5]),
        message_id=row[6],
        created_ms=int(row[7]),
        updated_ms=int(row[8]),
        attempts=int(row[9]),
        last_error=row[10],
        expires_ms=None if row[11] is None else int(row[11]),
        sweep_ms=None if row[12] is None else int(row[12]),
        replaced=int(row[13]),
        dropped=int(row[14]),
        republished=int(row[15]),
        payload=payload,
    )


def _at(entry: Entry) -> tuple[str, str]:
    return entry.scope, entry.key


def new_row(entry: Entry, now_ms: int) -> tuple[Any, ...]:
    """`_row(rules.place(None, entry, now_ms)[1])` without the record in between (a new
    key is most publishes; tests/unit/test_schedule.py holds the two equal)."""
    payload = entry.payload
    return (
        entry.scope,
        entry.key,
        1,
        "scheduled",
        entry.queue,
        entry.due_ms,
        entry.message_id,
        now_ms,
        now_ms,
        0,
        None,
        None,
        entry.sweep_ms,
        0,
        0,
        0,
        payload.body,
        payload.content_type,
        _headers_json(payload.headers),
    )


# One encoder for every record (json.dumps with arguments builds one per call: a third of
# recording a message's cost, measured).
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def _headers_json(headers: Any) -> str:
    return _COMPACT.encode(dict(headers)) if headers else "{}"


def _row(record: ScheduleRecord) -> tuple[Any, ...]:
    payload = record.payload
    return (
        record.scope,
        record.key,
        record.generation,
        record.state.value,
        record.queue,
        record.due_ms,
        record.message_id,
        record.created_ms,
        record.updated_ms,
        record.attempts,
        record.last_error,
        record.expires_ms,
        record.sweep_ms,
        record.replaced,
        record.dropped,
        record.republished,
        None if payload is None else payload.body,
        None if payload is None else payload.content_type,
        None if payload is None else _headers_json(payload.headers),
    )


class SQLSchedule:
    """The statements of one schedule table, as programs (see the module docstring)."""

    def __init__(self, table: str, dialect: Dialect) -> None:
        self.table = table
        self.dialect = dialect
        t, q = table, dialect.sql
        self._get = q(f"SELECT {_COLUMNS}, {_PAYLOAD} FROM {t} WHERE scope = ? AND key = ?")
        self._lock_suffix = " FOR UPDATE" if dialect.name == "postgres" else ""
        self._get_for_update = self._get + self._lock_suffix
        self._get_many = f"SELECT {_COLUMNS}, {_PAYLOAD} FROM {t} WHERE scope = ? AND key IN"
        marks = ", ".join(["?"] * 19)
        self._insert = q(
            f"INSERT INTO {t} ({_COLUMNS}, {_PAYLOAD}) VALUES ({marks}) "
            "ON CONFLICT (scope, key) DO NOTHING"
        )
        # PostgreSQL: a batch of new rows in one statement, a column per array (an
        # executemany sends and runs one INSERT per row)
        types = ["text", "text", "bigint", "text", "text", "bigint", "text", "bigint", "bigint"]
        types += ["bigint", "text", "bigint", "bigint", "bigint", "bigint", "bigint", "bytea"]
        types += ["text", "text"]
        arrays = ", ".join(f"%s::{kind}[]" for kind in types)
        self._pg_insert_rows = (
            f"INSERT INTO {t} ({_COLUMNS}, {_PAYLOAD}) SELECT * FROM unnest({arrays}) "
            "ON CONFLICT (scope, key) DO NOTHING"
        )
        sets = ", ".join(f"{c.strip()} = ?" for c in (_COLUMNS + ", " + _PAYLOAD).split(",")[2:])
        # compare-and-set: the row is still the generation and state read before
        self._cas = q(
            f"UPDATE {t} SET {sets}, owner = NULL, lease_until = NULL "
            "WHERE scope = ? AND key = ? AND generation = ? AND state = ?"
        )
        self._check = (
            f"SELECT key, generation, state, message_id, owner, lease_until FROM {t} "
            "WHERE scope = ? AND key IN "
        )
        self._owners = f"SELECT key, generation, owner FROM {t} WHERE scope = ? AND key IN "
        # the record as the claim: taken, renewed and given back by its owner
        self._claim = q(
            f"UPDATE {t} SET owner = ?, lease_until = ? WHERE scope = ? AND key = ? "
            "AND generation = ?"
        )
        self._renew_owner = q(
            f"UPDATE {t} SET lease_until = ? WHERE owner = ? AND state = 'scheduled'"
        )
        self._release_owner = q(f"UPDATE {t} SET owner = NULL, lease_until = NULL WHERE owner = ?")
        self._dropped = q(
            f"UPDATE {t} SET dropped = dropped + 1, updated_ms = ? WHERE scope = ? AND key = ?"
        )
        live = "WHERE scope = ? AND key = ? AND generation = ? AND state IN ('scheduled', 'parked')"
        self._handled = q(
            f"UPDATE {t} SET state = 'handled', updated_ms = ?, expires_ms = ?, sweep_ms = NULL, "
            "owner = NULL, lease_until = NULL " + live
        )
        # PostgreSQL: many keys read through a join on an array, so that the plan walks
        # the primary key per key (an IN list let it scan the whole scope: 133 us a key)
        self._pg_keys: str | None = None
        self._pg_check = self._pg_owners = self._pg_claim = ""
        if dialect.name == "postgres":
            columns = ", ".join(f"r.{c.strip()}" for c in (_COLUMNS + ", " + _PAYLOAD).split(","))
            self._pg_keys = (
                f'FROM {t} AS r JOIN unnest(%s::text[]) AS u(k) ON r.key = u.k COLLATE "C" '
                "WHERE r.scope = %s"
            )
            self._pg_check = (
                "SELECT r.key, r.generation, r.state, r.message_id, r.owner, r.lease_until "
                f"{self._pg_keys}"
            )
            self._pg_owners = f"SELECT r.key, r.generation, r.owner {self._pg_keys}"
            self._pg_claim = (
                f"UPDATE {t} AS r SET owner = u.owner, lease_until = %s "
                "FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::text[], %s::text[]) "
                "AS u(scope, key, generation, message_id, owner) "
                'WHERE r.scope = u.scope COLLATE "C" AND r.key = u.key COLLATE "C" '
                "AND r.generation = u.generation AND r.state = 'scheduled' "
                "AND r.message_id = u.message_id "
                "AND (r.owner IS NULL OR r.owner = u.owner OR r.lease_until <= %s) "
                "RETURNING r.scope, r.key"
            )
            self._pg_get_many = f"SELECT {columns} {self._pg_keys} FOR UPDATE OF r"
        # PostgreSQL: every handled row of a batch in one statement, from arrays
        self._handled_rows = (
            f"UPDATE {t} AS r SET state = 'handled', updated_ms = u.now, expires_ms = u.exp, "
            "sweep_ms = NULL, owner = NULL, lease_until = NULL "
            "FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[], "
            "%s::bigint[]) AS u(now, exp, scope, key, generation) "
            'WHERE r.scope = u.scope COLLATE "C" AND r.key = u.key COLLATE "C" '
            "AND r.generation = u.generation AND r.state IN ('scheduled', 'parked')"
        )
        self._parked = q(
            f"UPDATE {t} SET state = 'parked', attempts = attempts + 1, last_error = ?, "
            "updated_ms = ?, expires_ms = ?, sweep_ms = NULL, owner = NULL, lease_until = NULL "
            + live
        )
        self._retry = q(
            f"UPDATE {t} SET state = 'scheduled', attempts = attempts + 1, last_error = ?, "
            "due_ms = ?, updated_ms = ?, expires_ms = NULL, sweep_ms = ?, owner = NULL, "
            "lease_until = NULL " + live
        )
        self._swept = q(
            f"UPDATE {t} SET republished = republished + 1, sweep_ms = ?, updated_ms = ? "
            "WHERE scope = ? AND key = ? AND generation = ? AND state = 'scheduled'"
        )
        self._overdue = q(
            f"SELECT {_COLUMNS}, {_PAYLOAD} FROM {t} WHERE scope = ? AND sweep_ms IS NOT NULL "
            "AND sweep_ms <= ? ORDER BY sweep_ms, key LIMIT ?"
        )
        # The `sample` records finished last (by expiry: a handled record's is its finish +
        # the retention), of which the handled ones of `scope` since `since_ms` count: a
        # read of `sample` index entries, whatever the table holds.
        self._lateness = q(
            f"SELECT max(updated_ms - due_ms) FROM (SELECT scope, state, updated_ms, due_ms "
            f"FROM {t} WHERE expires_ms IS NOT NULL ORDER BY expires_ms DESC LIMIT ?) recent "
            "WHERE scope = ? AND state = 'handled' AND updated_ms >= ?"
        )
        self._count = q(
            f"SELECT count(*) FROM {t} WHERE scope = ? AND due_ms >= ? AND due_ms < ? "
            "AND state = 'scheduled'"
        )
        self._count_queue = q(
            f"SELECT count(*) FROM {t} WHERE scope = ? AND queue = ? AND due_ms >= ? "
            "AND due_ms < ? AND state = 'scheduled'"
        )
        # A slice of expired records, found by the expiry index; (scope, key), the
        # primary key, names each (a key alone may be another scope's live record).
        self._purge = q(
            f"DELETE FROM {t} WHERE expires_ms IS NOT NULL AND expires_ms <= ? AND (scope, key) "
            f"IN (SELECT scope, key FROM {t} WHERE expires_ms IS NOT NULL AND expires_ms <= ? "
            "LIMIT ?)"
        )

    def schema(self) -> list[str]:
        return schema(self.table, self.dialect)

    # -- the worker's side: inside the store's own transaction ---------------------------

    def read_rows(self, refs: Sequence[Ref], kind: str) -> list[tuple[str, Sql]]:
        """The reads of `refs`' records (one per `_KEYS_PER_READ` keys of a scope), each
        with its scope: kind "check" (generation, state, message_id, owner, lease_until)
        or "owners" (generation, owner), after the key."""
        select, pg_select = (
            (self._check, self._pg_check) if kind == "check" else (self._owners, self._pg_owners)
        )
        reads: list[tuple[str, Sql]] = []
        by_scope: dict[str, list[str]] = {}
        for ref in refs:
            by_scope.setdefault(ref.scope, []).append(ref.key)
        for scope, keys in by_scope.items():
            distinct = list(dict.fromkeys(keys))
            for start in range(0, len(distinct), _KEYS_PER_READ):
                chunk = distinct[start : start + _KEYS_PER_READ]
                if self._pg_keys is not None:
                    reads.append((scope, Sql(pg_select, (list(chunk), scope), "all")))
                else:
                    marks = ", ".join(["?"] * len(chunk))
                    reads.append((scope, Sql(f"{select}({marks})", (scope, *chunk), "all")))
        return reads

    @staticmethod
    def found(
        reads: Sequence[tuple[str, Sql]], results: Sequence[Sequence[Any]]
    ) -> dict[tuple[str, str], tuple[Any, ...]]:
        """The rows of `read_rows`' reads by (scope, key)."""
        found: dict[tuple[str, str], tuple[Any, ...]] = {}
        for (scope, _), rows in zip(reads, results, strict=True):
            for row in rows:
                found[(scope, row[0])] = tuple(row[1:])
        return found

    def _rows_of(
        self, refs: Sequence[Ref], kind: str
    ) -> Program[dict[tuple[str, str], tuple[Any, ...]]]:
        reads = self.read_rows(refs, kind)
        results = []
        for _, statement in reads:
            results.append((yield statement))
        return self.found(reads, results)

    @staticmethod
    def held_by(
        finishes: Sequence[tuple[str, Update]], found: dict[tuple[str, str], tuple[Any, ...]]
    ) -> list[bool]:
        """For each (owner, update): whether `owner` holds the claim on the update's
        record (its generation), from the "owners" rows: then the record is the claim,
        and no guard row is written for the finish."""
        result = []
        for owner, update in finishes:
            row = found.get((update.ref.scope, update.ref.key))
            result.append(
                row is not None and int(row[0]) == update.ref.generation and row[1] == owner
            )
        return result

    def dropped(self, refs: Sequence[Ref], now_ms: int) -> Program[None]:
        """Count a dropped copy (superseded or cancelled) on each ref's record."""
        if refs:
            rows = sorted((now_ms, r.scope, r.key) for r in refs)
            yield Sql(self._dropped, sorted(rows, key=_row_key), many=True)

    def claim_records(
        self, claims: Sequence[tuple[str, Ref]], now_ms: int, lease_ms: int
    ) -> tuple[str, Any] | None:
        """PostgreSQL: one statement that holds each (owner, ref)'s claim on its record,
        a compare-and-set on what `rules.claim_on_record` read (another transaction may
        have changed the row since); it returns (scope, key) of the claims it made."""
        if not claims:
            return None
        ordered = sorted(claims, key=lambda c: (c[1].scope, c[1].key))
        return (
            self._pg_claim,
            (
                now_ms + lease_ms,
                [r.scope for _, r in ordered],
                [r.key for _, r in ordered],
                [r.generation for _, r in ordered],
                [r.message_id for _, r in ordered],
                [o for o, _ in ordered],
                now_ms,
            ),
        )

    def claim(
        self,
        claims: Sequence[tuple[str, str, Ref]],
        now_ms: int,
        lease_ms: int,
        guarded: Callable[[Sequence[str]], Sql] | None = None,
    ) -> Program[list[Verdict | str | None]]:
        """The schedule's word on each (guard key, owner, ref) before its claim, and the
        claim itself where the record can hold it (`rules.claim_on_record`): a Verdict
        (drop or skip it; the dropped copies counted), RECORD_CLAIMED (its owner and
        lease written on the record, no guard row), RECORD_BUSY (another owner's live
        lease), or None: claim it on a guard row as usual.

        `guarded(keys)` reads which of these guard keys have a live guard row (a claim,
        a done-record or a tombstone written without the schedule): those are left to
        the guard, whose row decides."""
        found = yield from self._rows_of([c[2] for c in claims], "check")
        answers: list[Verdict | str | None] = []
        drops: list[tuple[Any, ...]] = []
        candidates: list[int] = []
        for i, (_, owner, ref) in enumerate(claims):
            row = found.get((ref.scope, ref.key))
            if row is None:
                answers.append(None)
                continue
            generation, state = int(row[0]), ScheduleState(row[1])
            verdict = rules.check_state(generation, state, ref.generation)
            if verdict is not None:
                if verdict is not Verdict.HANDLED:
                    drops.append((now_ms, ref.scope, ref.key))
                answers.append(verdict)
                continue
            answers.append(None)
            if rules.claim_on_record(
                generation,
                state,
                row[2],
                None,
                None,
                ref=ref,
                owner=owner,
                now_ms=now_ms,
            ):
                candidates.append(i)
        if candidates and guarded is not None:
            rows = yield guarded([claims[i][0] for i in candidates])
            held = {r[0] for r in rows}
            candidates = [i for i in candidates if claims[i][0] not in held]
        writes: list[tuple[Any, ...]] = []
        for i in candidates:
            _, owner, ref = claims[i]
            at = (ref.scope, ref.key)
            row = found[at]
            answer = rules.claim_on_record(
                int(row[0]),
                ScheduleState(row[1]),
                row[2],
                row[3],
                row[4],
                ref=ref,
                owner=owner,
                now_ms=now_ms,
            )
            answers[i] = answer
            if answer == rules.RECORD_CLAIMED:
                lease_until = now_ms + lease_ms
                # a second copy of the key later in this batch finds it held
                found[at] = (*row[:3], owner, lease_until)
                writes.append((owner, lease_until, ref.scope, ref.key, ref.generation))
        if drops:
            yield Sql(self._dropped, sorted(drops, key=_row_key), many=True)
        if writes:
            yield Sql(self._claim, sorted(writes, key=lambda w: (w[2], w[3])), many=True)
        return answers

    def owned(self, finishes: Sequence[tuple[str, Update]]) -> Program[list[bool]]:
        """`held_by`, read: whether each (owner, update)'s owner holds its record."""
        found = yield from self._rows_of([u.ref for _, u in finishes], "owners")
        return self.held_by(finishes, found)

    def release_owners(self, owners: Sequence[str]) -> Program[None]:
        """Give back the record claims these owners hold (a finish without an update:
        the handler did not run, or its result writes nothing to the record)."""
        if owners:
            yield Sql(self._release_owner, [(o,) for o in sorted(owners)], many=True)

    def renew_owner(self, owner: str, now_ms: int, lease_ms: int) -> Program[bool]:
        """Extend `owner`'s claim on a record; False when it holds none."""
        changed = yield Sql(self._renew_owner, (now_ms + lease_ms, owner), "rowcount")
        return bool(changed == 1)

    def finish(self, updates: Sequence[Update], now_ms: int) -> Program[None]:
        """`rules.finish` for each update: one statement per kind, its rows in (scope,
        key) order (see `place_many`)."""
        handled: list[tuple[Any, ...]] = []
        parked: list[tuple[Any, ...]] = []
        retried: list[tuple[Any, ...]] = []
        for u in sorted(updates, key=lambda u: (u.ref.scope, u.ref.key)):
            where = (u.ref.scope, u.ref.key, u.ref.generation)
            if u.finished is Finished.HANDLED:
                handled.append((now_ms, now_ms + u.retention_ms, *where))
            elif u.finished is Finished.PARKED:
                parked.append((u.error, now_ms, now_ms + u.retention_ms, *where))
            else:
                retried.append((u.error, u.due_ms, now_ms, u.sweep_ms, *where))
        if self.dialect.name == "postgres" and len(handled) > 1:
            # one statement for them all (executemany runs one per row on the server)
            columns = [list(column) for column in zip(*handled, strict=True)]
            yield Sql(self._handled_rows, columns)
            handled = []
        for sql, rows in ((self._handled, handled), (self._parked, parked), (self._retry, retried)):
            if rows:
                yield Sql(sql, rows, many=True)

    # -- ScheduleBook operations, each in its own transaction ----------------------------

    def _read(self, scope: str, key: str, *, lock: bool) -> Program[ScheduleRecord | None]:
        row = yield Sql(self._get_for_update if lock else self._get, (scope, key), "one")
        return None if row is None else _record(row, with_payload=True)

    def _write(self, old: ScheduleRecord | None, new: ScheduleRecord) -> Program[bool]:
        """Write `new` over `old` (None: insert); False when another writer got there
        first (the caller reads again)."""
        row = _row(new)
        if old is None:
            changed = yield Sql(self._insert, row, "rowcount")
        else:
            args = (*row[2:], new.scope, new.key, old.generation, old.state.value)
            changed = yield Sql(self._cas, args, "rowcount")
        return bool(changed == 1)

    def place_many(self, entries: Sequence[Entry], now_ms: int) -> Program[list[Placed]]:
        """`rules.place` for each entry, in order: the existing records read at once
        (one statement per `_KEYS_PER_READ` keys), the new ones inserted and the others
        compare-and-set in one executemany each. When another writer changed a row in
        between (PostgreSQL), the batch is placed again entry by entry."""
        at_keys = {(e.scope, e.key) for e in entries}
        if len(at_keys) == len(entries):
            # Usually every key is new (a message_id): insert them all, and only when some
            # row existed read and place them one by one below.
            yield Sql("SAVEPOINT rd_new")
            rows = [new_row(e, now_ms) for e in sorted(entries, key=_at)]
            if self._pg_keys is not None and len(rows) > 1:
                columns = [list(column) for column in zip(*rows, strict=True)]
                inserted = yield Sql(self._pg_insert_rows, columns, "rowcount")
            else:
                inserted = yield Sql(self._insert, rows, "rowcount", many=True)
            if inserted == len(rows):
                yield Sql("RELEASE SAVEPOINT rd_new")
                return [Placed(Placement.CREATED, 1, e.message_id, e.due_ms) for e in entries]
            yield Sql("ROLLBACK TO SAVEPOINT rd_new")
        found: dict[tuple[str, str], ScheduleRecord] = {}
        by_scope: dict[str, list[str]] = {}
        for entry in entries:
            by_scope.setdefault(entry.scope, []).append(entry.key)
        for scope, keys in by_scope.items():
            distinct = list(dict.fromkeys(keys))
            for start in range(0, len(distinct), _KEYS_PER_READ):
                chunk = distinct[start : start + _KEYS_PER_READ]
                if self._pg_keys is not None:
                    statement = Sql(self._pg_get_many, (list(chunk), scope), "all")
                else:
                    marks = ", ".join(["?"] * len(chunk))
                    sql = self.dialect.sql(f"{self._get_many} ({marks}){self._lock_suffix}")
                    statement = Sql(sql, (scope, *chunk), "all")
                for row in (yield statement):
                    found[(row[0], row[1])] = _record(row, with_payload=True)
        original = dict(found)
        latest: dict[tuple[str, str], ScheduleRecord] = {}
        placed: list[Placed] = []
        for entry in entries:
            at = (entry.scope, entry.key)
            answer, new = rules.place(found.get(at), entry, now_ms)
            if new is not None:
                found[at] = latest[at] = new
            placed.append(answer)
        # Rows are written in (scope, key) order: on PostgreSQL two transactions placing
        # some of the same keys take their row locks in one order, and one waits for the
        # other instead of both deadlocking.
        ordered = sorted(latest.items())
        inserts = [_row(r) for at, r in ordered if at not in original]
        updates = [
            (*_row(r)[2:], r.scope, r.key, original[at].generation, original[at].state.value)
            for at, r in ordered
            if at in original
        ]
        yield Sql("SAVEPOINT rd_place")
        changed = 0
        if inserts:
            changed += (yield Sql(self._insert, inserts, "rowcount", many=True)) or 0
        if updates:
            changed += (yield Sql(self._cas, updates, "rowcount", many=True)) or 0
        if changed != len(inserts) + len(updates):  # another writer got there first
            yield Sql("ROLLBACK TO SAVEPOINT rd_place")
            return (yield from self._place_each(entries, now_ms))
        yield Sql("RELEASE SAVEPOINT rd_place")
        return placed

    def _place_each(self, entries: Sequence[Entry], now_ms: int) -> Program[list[Placed]]:
        """Entry by entry, in (scope, key) order (see `place_many`); the answers in the
        entries' order (a key twice keeps its order: the sort is stable)."""
        placed: dict[int, Placed] = {}
        for i in sorted(range(len(entries)), key=lambda i: (entries[i].scope, entries[i].key)):
            entry = entries[i]
            for _ in range(_CAS_ATTEMPTS):
                old = yield from self._read(entry.scope, entry.key, lock=True)
                answer, new = rules.place(old, entry, now_ms)
                if new is None or (yield from self._write(old, new)):
                    placed[i] = answer
                    break
            else:
                raise RuntimeError(f"schedule key {entry.key!r} kept changing while being placed")
        return [placed[i] for i in range(len(entries))]

    def lookup(self, scope: str, key: str) -> Program[ScheduleRecord | None]:
        return (yield from self._read(scope, key, lock=False))

    def select(self, query: Query) -> Program[list[ScheduleRecord]]:
        where = ["scope = ?"]
        args: list[Any] = [query.scope]
        if query.queue is not None:
            where.append("queue = ?")
            args.append(query.queue)
        if query.state is not None:
            where.append("state = ?")
            args.append(query.state.value)
        if query.due_before_ms is not None:
            where.append("due_ms < ?")
            args.append(query.due_before_ms)
        if query.due_after_ms is not None:
            where.append("due_ms >= ?")
            args.append(query.due_after_ms)
        if query.after is not None:
            # a row value: both databases seek the (due_ms, key) index to the cursor
            # (an OR of the two columns would scan the scope from its start)
            where.append("(due_ms, key) > (?, ?)")
            args.extend(query.after)
        limit = min(max(query.limit, 1), MAX_PAGE)
        sql = self.dialect.sql(
            f"SELECT {_COLUMNS} FROM {self.table} WHERE {' AND '.join(where)} "
            "ORDER BY due_ms, key LIMIT ?"
        )
        rows = yield Sql(sql, (*args, limit), "all")
        return [_record(row, with_payload=False) for row in rows]

    def cancel(
        self, scope: str, key: str, now_ms: int, hold_ms: int
    ) -> Program[tuple[ScheduleState | None, ScheduleRecord | None]]:
        for _ in range(_CAS_ATTEMPTS):
            old = yield from self._read(scope, key, lock=True)
            found, new = rules.cancel(old, now_ms, hold_ms)
            if new is None:
                return found, old
            if (yield from self._write(old, new)):
                return found, new
        raise RuntimeError(f"schedule key {key!r} kept changing while being cancelled")

    def reschedule(
        self, scope: str, key: str, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> Program[tuple[ScheduleState | None, ScheduleRecord | None]]:
        for _ in range(_CAS_ATTEMPTS):
            old = yield from self._read(scope, key, lock=True)
            found, new = rules.reschedule(old, due_ms, message_id, now_ms, sweep_ms)
            if new is None:
                return found, old
            if (yield from self._write(old, new)):
                return found, new
        raise RuntimeError(f"schedule key {key!r} kept changing while being rescheduled")

    def overdue(self, scope: str, now_ms: int, limit: int) -> Program[list[ScheduleRecord]]:
        rows = yield Sql(self._overdue, (scope, now_ms, limit), "all")
        return [_record(row, with_payload=True) for row in rows]

    def swept(self, scope: str, items: Sequence[SweptItem], now_ms: int) -> Program[None]:
        if items:
            rows = [(next_ms, now_ms, scope, key, gen) for key, gen, next_ms in items]
            yield Sql(self._swept, rows, many=True)

    def lateness(self, scope: str, since_ms: int, sample: int) -> Program[int | None]:
        row = yield Sql(self._lateness, (sample, scope, since_ms), "one")
        return None if row is None or row[0] is None else int(row[0])

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> Program[list[int]]:
        counts: list[int] = []
        for low, high in itertools.pairwise(edges):
            if queue is None:
                row = yield Sql(self._count, (scope, low, high), "one")
            else:
                row = yield Sql(self._count_queue, (scope, queue, low, high), "one")
            counts.append(int(row[0]))
        return counts

    def purge(self, now_ms: int, slice_rows: int) -> Program[int]:
        """One slice of expired records (at most `slice_rows`); the store loops."""
        return int((yield Sql(self._purge, (now_ms, now_ms, slice_rows), "rowcount")))


def _row_key(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """(scope, key) of a `_dropped` row: (now, scope, key)."""
    return row[1:]


def pipelined(program: Program[T]) -> Program[T]:
    """`program`, to be run in a psycopg pipeline: there a statement whose rows are read
    waits for the server (the round trip ends there) and the others are only queued, so
    their row counts are not known yet; a statement asking for one is refused
    (`finish` and `check` ask for none)."""
    try:
        statement = next(program)
        while True:
            if statement.fetch == "rowcount":
                raise ValueError(f"a row count is not known in a pipeline: {statement.text}")
            statement = program.send((yield statement))
    except StopIteration as stop:
        result: T = stop.value
        return result


def run_sync(cursor: Any, program: Program[T]) -> T:
    """Run `program` on a DB-API cursor (sqlite3, psycopg)."""
    try:
        statement = next(program)
        while True:
            statement = program.send(_execute(cursor, statement))
    except StopIteration as stop:
        result: T = stop.value
        return result


def _execute(cursor: Any, statement: Sql) -> Any:
    if statement.many:
        cursor.executemany(statement.text, statement.params)
        return cursor.rowcount
    cursor.execute(statement.text, statement.params)
    if statement.fetch == "all":
        return cursor.fetchall()
    if statement.fetch == "one":
        return cursor.fetchone()
    if statement.fetch == "rowcount":
        return cursor.rowcount
    return None


async def run_async(cursor: Any, program: Program[T]) -> T:
    """Run `program` on psycopg's AsyncCursor."""
    try:
        statement = next(program)
        while True:
            if statement.many:
                await cursor.executemany(statement.text, statement.params)
                reply: Any = cursor.rowcount
            else:
                await cursor.execute(statement.text, statement.params)
                if statement.fetch == "all":
                    reply = await cursor.fetchall()
                elif statement.fetch == "one":
                    reply = await cursor.fetchone()
                elif statement.fetch == "rowcount":
                    reply = cursor.rowcount
                else:
                    reply = None
            statement = program.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result


__all__ = [
    "POSTGRES",
    "SQLITE",
    "Dialect",
    "Placement",
    "SQLSchedule",
    "Sql",
    "pipelined",
    "run_async",
    "run_sync",
]
