"""SQLite store, the default: embedded, durable, safe across threads and processes.

Every operation is one statement. A write statement takes SQLite's write lock before
it reads, so the conditional UPSERT of a claim is atomic across processes sharing the
file, without BEGIN IMMEDIATE's extra round trips. WAL lets readers and the writer
proceed together; `synchronous=NORMAL` skips the fsync per commit (a power cut may lose
the last commits, a process crash loses nothing).

What a commit costs is the WAL write and the file locking (about ten system calls),
not the statement, so the async store (`AsyncSQLiteStore`) commits all operations
issued in one event-loop turn together: a group commit.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from rabbit_delay._errors import ConfigError
from rabbit_delay._idempotency.guard import (
    DEFAULT_PREFIX,
    SCHEDULE_RESULT,
    ClaimItem,
    ClaimResult,
    FinishItem,
    ScheduledClaim,
    ScheduledFinish,
)
from rabbit_delay._io.sql import check_table_name, is_busy, require_sqlite_transaction
from rabbit_delay._schedule.book import SweptItem, SyncBookAsAsync
from rabbit_delay._schedule.records import (
    Entry,
    Placed,
    Query,
    ScheduleRecord,
    ScheduleState,
)
from rabbit_delay._stores.sql_schedule import SQLITE, Program, Sql, SQLSchedule, run_sync

T = TypeVar("T")

DEFAULT_IDEMPOTENCY_TABLE = "rabbit_delay_idempotency"
# UPSERT (ON CONFLICT DO UPDATE) arrived in SQLite 3.24.
_MIN_SQLITE = (3, 24, 0)
_PURGE_SLICE = 2_000
# A claim whose UPSERT changed nothing is read back; if the row changed between the two
# statements (released, purged) the claim is tried again, at most this many times.
_CLAIM_ATTEMPTS = 5
# The batch operations write up to this many rows per statement. A statement, not a
# row, is what costs the Python overhead and a release and re-acquire of the GIL (which,
# while other threads want it, may cost a whole switch interval). Two parameters a row
# stay under the 999 that an SQLite before 3.32 allows.
_BATCH_ROWS = 200

# A rowid table with the key in a unique index (not WITHOUT ROWID): keys are random
# (uuid message_ids), so every write lands on a random B-tree page; here a claim inserts
# its row at the table's end and writes one random index page, and completing it
# rewrites that recent row in place without touching the index. Measured on a 20,000-row
# table: 12-16 us per claim + complete instead of 24 us. Files made by earlier versions
# (WITHOUT ROWID) keep their table: every statement below works on both.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    key TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL CHECK (state IN ('claimed', 'done', 'cancelled')),
    owner TEXT,
    expires_at INTEGER NOT NULL
)
"""
# ?1 key, ?2 owner, ?3 lease end, ?4 now. Takes the row when it is absent, expired, or
# already ours (re-entrant: the lease is renewed). Changes nothing otherwise.
_CLAIM = """
INSERT INTO {t} (key, state, owner, expires_at) VALUES (?1, 'claimed', ?2, ?3)
ON CONFLICT (key) DO UPDATE SET state = 'claimed', owner = ?2, expires_at = ?3
WHERE expires_at <= ?4 OR (state = 'claimed' AND owner = ?2)
"""
_READ = "SELECT state, owner, expires_at FROM {t} WHERE key = ?1"
# ?1 key, ?2 owner, ?3 retention end, ?4 now. Done wins over any claim, ours or not: the
# handler did succeed. A live done-record or tombstone is left as it is, which makes the
# worker's complete() after an inbox-style mark_done_in() a no-op.
_COMPLETE = """
INSERT INTO {t} (key, state, owner, expires_at) VALUES (?1, 'done', ?2, ?3)
ON CONFLICT (key) DO UPDATE SET state = 'done', owner = ?2, expires_at = ?3
WHERE state = 'claimed' OR expires_at <= ?4
"""
_RELEASE = "DELETE FROM {t} WHERE key = ?1 AND state = 'claimed' AND owner = ?2"
# ?1 key, ?2 owner, ?3 lease end. Whatever the old lease end: a claim that ran out and
# that nobody took over is still ours. Never inserts.
_RENEW = "UPDATE {t} SET expires_at = ?3 WHERE key = ?1 AND state = 'claimed' AND owner = ?2"
# ?1 key, ?2 retention end. A second cancel never shortens a tombstone.
_CANCEL = """
INSERT INTO {t} (key, state, owner, expires_at) VALUES (?1, 'cancelled', NULL, ?2)
ON CONFLICT (key) DO UPDATE SET state = 'cancelled', owner = NULL,
    expires_at = CASE WHEN state = 'cancelled' AND expires_at > ?2 THEN expires_at ELSE ?2 END
"""
# No index on expires_at: it would add a page write to every claim and complete (about
# +50% per operation) for the sake of the rare purge. Purge walks the primary key
# instead, a slice at a time, releasing the write lock between slices.
_PURGE_SLICE_END = "SELECT max(key) FROM (SELECT key FROM {t} WHERE key > ?1 ORDER BY key LIMIT ?2)"
_PURGE = "DELETE FROM {t} WHERE key > ?1 AND key <= ?2 AND expires_at <= ?3"

# The batch forms: one statement for many items (up to _BATCH_ROWS), each row processed
# in order exactly as its single statement would be, so a key twice in one batch behaves
# as in two statements. ?1 now, ?2 lease or retention end, then key and owner of each row.
_CLAIM_ROWS = """
INSERT INTO {t} (key, state, owner, expires_at) VALUES {rows}
ON CONFLICT (key) DO UPDATE SET
    state = 'claimed', owner = excluded.owner, expires_at = excluded.expires_at
WHERE expires_at <= ?1 OR (state = 'claimed' AND owner = excluded.owner)
"""
_COMPLETE_ROWS = """
INSERT INTO {t} (key, state, owner, expires_at) VALUES {rows}
ON CONFLICT (key) DO UPDATE SET
    state = 'done', owner = excluded.owner, expires_at = excluded.expires_at
WHERE state = 'claimed' OR expires_at <= ?1
"""
# ?1.. key and owner of each row. The key IN (...) lets SQLite search the primary key;
# the row-value IN alone would scan the table.
_RELEASE_ROWS = """
DELETE FROM {t} WHERE key IN ({keys}) AND state = 'claimed' AND (key, owner) IN (VALUES {rows})
"""
_READ_ROWS = "SELECT key, state, owner, expires_at FROM {t} WHERE key IN ({keys})"


def _use_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> None:
    """Switch the file to WAL (it stays so). Changing the journal mode takes a lock that
    SQLite's busy handler does not wait for: when several stores open one new file at
    once, the others get "database is locked" at once. So: nothing to do when it is WAL
    already, else try again, for up to the busy timeout."""
    deadline = time.monotonic() + max(busy_timeout_s, 0.1)
    while True:
        try:
            (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
            if str(mode).lower() == "wal":
                return
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class SQLiteStore:
    """Claims, done-records and tombstones in one SQLite table (WAL, `synchronous=NORMAL`).

    One connection per store, serialised by a lock, so a store may be shared by
    threads; other processes open their own store on the same file. `busy_timeout_s`
    bounds how long an operation waits for another process's write lock before
    `sqlite3.OperationalError("database is locked")`.

    Raises ConfigError for an invalid table name or an SQLite older than 3.24, and
    `sqlite3.Error` when the file cannot be opened or initialised.
    """

    needs_purge = True

    def __init__(
        self,
        path: str | Path,
        *,
        prefix: str = DEFAULT_PREFIX,
        table: str = DEFAULT_IDEMPOTENCY_TABLE,
        busy_timeout_s: float = 5.0,
    ) -> None:
        check_table_name(table)
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise ConfigError(
                f"the SQLite idempotency store needs SQLite >= 3.24 (UPSERT); "
                f"this Python has {sqlite3.sqlite_version}"
            )
        self.path = str(path)
        self.prefix = prefix
        self.busy_timeout_s = busy_timeout_s
        self._busy_timeout_ms = int(busy_timeout_s * 1000)
        self._waiting = True
        self.table = table
        self._lock = threading.Lock()
        # isolation_level=None: autocommit, each statement its own transaction.
        self._conn = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            _use_wal(self._conn, busy_timeout_s)
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(_SCHEMA.format(t=table))
            self._sql_schedule = SQLSchedule(check_table_name(f"{table}_schedule"), SQLITE)
            for statement in self._sql_schedule.schema():
                self._conn.execute(statement)
        except BaseException:
            self._conn.close()
            raise
        self._claim_sql = _CLAIM.format(t=table)
        self._read_sql = _READ.format(t=table)
        self._complete_sql = _COMPLETE.format(t=table)
        self._release_sql = _RELEASE.format(t=table)
        self._renew_sql = _RENEW.format(t=table)
        self._cancel_sql = _CANCEL.format(t=table)
        self._purge_slice_sql = _PURGE_SLICE_END.format(t=table)
        self._purge_sql = _PURGE.format(t=table)
        self._rows_sql: dict[tuple[str, int], str] = {}
        self.schedule = SQLiteSchedule(self)

    # -- IdempotencyStore --------------------------------------------------------------

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim`. Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            return self._claim(key, owner, now_ms, lease_ms)

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete`. Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            self._complete(key, owner, now_ms, retention_ms)

    def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            self._release(key, owner)

    def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """See `IdempotencyStore.renew`. Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            return self._renew(key, owner, now_ms, lease_ms)

    def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """See `IdempotencyStore.claim_many`: one multi-row UPSERT per `_BATCH_ROWS`
        items (one transaction for all of them), plus one read when some are held."""

        def each() -> list[Callable[[], Any]]:
            return [partial(self._claim, key, owner, now_ms, lease_ms) for key, owner in items]

        # The multi-row claim needs a positive lease: then an item's outcome depends on
        # its (key, owner) alone (see _claim_rows).
        if len(items) < 2 or lease_ms <= 0:
            return self._run_items(each())
        whole = partial(self._claim_rows, items, now_ms, lease_ms)
        # One chunk is one UPSERT, a transaction by itself (the read that may follow is
        # one too, like _claim's).
        return self._run_whole(whole, each, len(items), begin=len(items) > _BATCH_ROWS)

    def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `IdempotencyStore.finish_many`: one transaction, one statement per
        `_BATCH_ROWS` completes and one per `_BATCH_ROWS` releases (a lone statement
        is its own transaction)."""

        def each() -> list[Callable[[], Any]]:
            return [
                partial(self._complete, key, owner, now_ms, retention_ms)
                if succeeded
                else partial(self._release, key, owner)
                for key, owner, succeeded in items
            ]

        if len(items) < 2:
            return self._run_items(each())
        whole = partial(self._finish_rows, items, now_ms, retention_ms)
        completes = sum(1 for _, _, succeeded in items if succeeded)
        one_statement = completes in (0, len(items)) and len(items) <= _BATCH_ROWS
        return self._run_whole(whole, each, len(items), begin=not one_statement)

    def finish_and_claim_many(
        self,
        finishes: Sequence[FinishItem],
        claims: Sequence[ClaimItem],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """`finish_many` then `claim_many` in one transaction: a worker's batch costs one
        commit (the WAL write and the locking), which is most of what a batch costs.

        When a statement fails, the transaction is rolled back and each kind runs on its
        own (with their per-item fallbacks), so one bad item still fails alone.
        """
        if not finishes or not claims or lease_ms <= 0:
            return (
                self.finish_many(finishes, now_ms=now_ms, retention_ms=retention_ms),
                self.claim_many(claims, now_ms=now_ms, lease_ms=lease_ms),
            )

        def both() -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
            finished = list(self._finish_rows(finishes, now_ms, retention_ms))
            claimed: list[ClaimResult | Exception] = list(
                self._claim_rows(claims, now_ms, lease_ms)
            )
            return finished, claimed

        with self._lock:
            self._set_wait(True)
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                done = self._commit(both)
            except sqlite3.Error:  # the write lock stayed busy, or the rollback failed
                done = None
            if done is not None:
                return done
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
        """See `SchedulingStore.scheduled_batch`: one transaction.

        The record is the claim (docs/schedule.md): a claim whose ref names its record's
        generation, still scheduled, is held on the record (`SQLSchedule.claim`), and its
        finish updates the record alone; no guard row is written for it. The other
        claims and finishes go to the guard's rows as by `finish_and_claim_many`, with
        the schedule's updates and verdicts in the same transaction."""
        schedule = self._sql_schedule
        prefix = self.prefix

        def guarded(keys: Sequence[str]) -> Sql:  # the keys with a live guard row
            marks = ",".join(["?"] * len(keys))
            return Sql(
                f"SELECT substr(key, {len(prefix) + 1}) FROM {self.table} "
                f"WHERE key IN ({marks}) AND expires_at > ?",
                (*(prefix + k for k in keys), now_ms),
                "all",
            )

        def both() -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
            cursor = self._conn.cursor()
            finished: list[Exception | None] = [None] * len(finishes)
            if finishes:
                with_update = [(i, f[1], f[3]) for i, f in enumerate(finishes) if f[3] is not None]
                owned = run_sync(cursor, schedule.owned([(o, u) for _, o, u in with_update]))
                on_record = {w[0] for w, mine in zip(with_update, owned, strict=True) if mine}
                rows = [f[:3] for i, f in enumerate(finishes) if i not in on_record]
                if rows:
                    self._finish_rows(rows, now_ms, retention_ms)
                    # a finish without an update may give back a record's claim
                    releases = [f[1] for f in finishes if f[3] is None]
                    if releases:
                        run_sync(cursor, schedule.release_owners(releases))
                updates = [u for _, _, u in with_update]
                if updates:
                    run_sync(cursor, schedule.finish(updates, now_ms))
            claimed: list[ClaimResult | Exception] = [ClaimResult.CLAIMED] * len(claims)
            refs = [(i, (c[0], c[1], c[2])) for i, c in enumerate(claims) if c[2] is not None]
            answers = run_sync(
                cursor,
                schedule.claim([r for _, r in refs], now_ms, lease_ms, guarded),
            )
            answered = set()
            for (i, _), answer in zip(refs, answers, strict=True):
                if answer is not None:
                    claimed[i] = SCHEDULE_RESULT[answer]
                    answered.add(i)
            rest = [i for i in range(len(claims)) if i not in answered]
            if rest:
                if lease_ms > 0:
                    results = self._claim_rows([claims[i][:2] for i in rest], now_ms, lease_ms)
                else:
                    results = [self._claim(*claims[i][:2], now_ms, lease_ms) for i in rest]
                for i, result in zip(rest, results, strict=True):
                    claimed[i] = result
            return finished, claimed

        with self._lock:
            self._set_wait(True)
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                return [exc] * len(finishes), [exc] * len(claims)
            try:
                done = both()
                self._conn.execute("COMMIT")
                return done
            except sqlite3.Error as exc:
                return [exc] * len(finishes), [exc] * len(claims)
            finally:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")

    def run_schedule(self, program: Program[T], *, write: bool) -> T:
        """Run a schedule program (`SQLSchedule`) in a transaction of its own (BEGIN
        IMMEDIATE when it writes). Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            cursor = self._conn.cursor()
            if not write:
                return run_sync(cursor, program)
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = run_sync(cursor, program)
                self._conn.execute("COMMIT")
                return result
            finally:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")

    def _run_items(self, ops: Sequence[Callable[[], Any]]) -> list[Any]:
        try:
            return self.run_batch(ops, wait=True)
        except sqlite3.Error as exc:  # the write lock stayed busy past the timeout
            return [exc] * len(ops)

    def _run_whole(
        self,
        whole: Callable[[], list[Any]],
        each: Callable[[], Sequence[Callable[[], Any]]],
        n: int,
        *,
        begin: bool,
    ) -> list[Any]:
        """Run `whole` (a batch of `n` items in a few statements) like `run_batch`: in
        one transaction, or with `begin=False` in autocommit (a `whole` that writes in
        one statement: BEGIN and COMMIT would cost two more waits for the GIL). When a
        statement fails, it is rolled back and each op of `each()` runs in its own
        transaction, so one bad item fails alone. A write lock still busy after the
        timeout fails every item."""
        with self._lock:
            self._set_wait(True)
            if not begin:
                try:
                    return whole()
                except sqlite3.Error as exc:
                    if is_busy(exc):
                        return [exc] * n
                return self._run_each(each())
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                return [exc] * n
            results = self._commit(whole)
            return results if results is not None else self._run_each(each())

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            self._cancel(key, now_ms, retention_ms)

    def purge(self, *, now_ms: int) -> int:
        """See `IdempotencyStore.purge`: every expired row of the table, whatever its
        prefix, and every expired schedule record. Raises `sqlite3.Error`."""
        total = self.schedule.purge(now_ms=now_ms)
        low = ""  # every key sorts after the empty string
        while True:
            # The lock is taken per slice so claims from other threads interleave.
            with self._lock:
                self._set_wait(True)
                (high,) = self._conn.execute(self._purge_slice_sql, (low, _PURGE_SLICE)).fetchone()
                if high is None:
                    return total
                total += self._conn.execute(self._purge_sql, (low, high, now_ms)).rowcount
            low = high

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the inbox pattern: writes inside the caller's transaction ----------------------

    def mark_done_in(
        self,
        conn: sqlite3.Connection,
        key: str,
        *,
        now_ms: int,
        retention_ms: int,
        owner: str | None = None,
    ) -> None:
        """Record `key` done through `conn`, inside the caller's open transaction.

        `conn` is the handler's own connection to this store's database file. Nothing
        is committed here: the done-record commits or rolls back with the handler's
        own change, and the worker's later `complete()` finds it and does nothing.

        Raises ValueError when `conn` would commit the write on its own (autocommit
        with no transaction open), and `sqlite3.Error` (such as "no such table" for a
        connection to another file).
        """
        require_sqlite_transaction(conn)
        conn.execute(self._complete_sql, (self.prefix + key, owner, now_ms + retention_ms, now_ms))

    def cancel_in(
        self, conn: sqlite3.Connection, key: str, *, now_ms: int, retention_ms: int
    ) -> None:
        """Write a tombstone for `key` through `conn`, inside the caller's transaction.

        For a handler whose change makes a scheduled message moot (the order is paid:
        cancel its timeout) in the same commit. Raises like `mark_done_in`.
        """
        require_sqlite_transaction(conn)
        conn.execute(self._cancel_sql, (self.prefix + key, now_ms + retention_ms))

    # -- group commit --------------------------------------------------------------------

    def run_batch(self, ops: Sequence[Callable[[], Any]], *, wait: bool = True) -> list[Any]:
        """Run operations (closures over the `_`-methods) in one transaction.

        Returns one entry per op: its result, or the `sqlite3.Error` it raised. When a
        statement fails inside the transaction, it is rolled back and each op runs again
        in its own transaction, so one bad op fails alone.

        Raises `sqlite3.OperationalError` (SQLITE_BUSY) when the write lock is held by
        another connection: at once with `wait=False` (nothing was written), else after
        the busy timeout.
        """
        if not ops:
            return []
        with self._lock:
            self._set_wait(wait)
            if len(ops) == 1:
                # A lone op is one statement: autocommit is its transaction, and
                # BEGIN/COMMIT would only double the cost.
                try:
                    return [ops[0]()]
                except sqlite3.Error as exc:
                    if not wait and is_busy(exc):
                        raise
                    return [exc]
            self._conn.execute("BEGIN IMMEDIATE")
            results = self._commit(lambda: [op() for op in ops])
            return results if results is not None else self._run_each(ops)

    def _commit(self, work: Callable[[], T]) -> T | None:
        """`work()` in the transaction just begun, then COMMIT: its result; None when a
        statement failed, once rolled back (nothing written). The caller holds
        self._lock."""
        try:
            done = work()
            self._conn.execute("COMMIT")
            return done
        except sqlite3.Error:
            return None
        finally:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")

    def _run_each(self, ops: Sequence[Callable[[], Any]]) -> list[Any]:
        # Each op in its own (autocommit) transaction; the caller holds self._lock.
        outcomes: list[Any] = []
        for op in ops:
            try:
                outcomes.append(op())
            except sqlite3.Error as exc:
                outcomes.append(exc)
        return outcomes

    def _set_wait(self, wait: bool) -> None:
        # The group-commit path must not wait for the lock on the event loop; everything
        # else waits up to the busy timeout. Switched only when the mode changes.
        if wait != self._waiting:
            timeout = self._busy_timeout_ms if wait else 0
            self._conn.execute(f"PRAGMA busy_timeout = {timeout}")
            self._waiting = wait

    # -- statements (the caller holds self._lock) ----------------------------------------

    def _claim(self, key: str, owner: str, now_ms: int, lease_ms: int) -> ClaimResult:
        k = self.prefix + key
        claim_args = (k, owner, now_ms + lease_ms, now_ms)
        for _ in range(_CLAIM_ATTEMPTS):
            if self._conn.execute(self._claim_sql, claim_args).rowcount == 1:
                return ClaimResult.CLAIMED
            # Held by someone: one read to say by what. Rare (duplicates only).
            row = self._conn.execute(self._read_sql, (k,)).fetchone()
            if row is None or row[2] <= now_ms or (row[0] == "claimed" and row[1] == owner):
                continue  # released or purged since the UPSERT: try again
            if row[0] == "done":
                return ClaimResult.DONE
            if row[0] == "cancelled":
                return ClaimResult.CANCELLED
            return ClaimResult.IN_PROGRESS
        # The row keeps changing under us: another owner is busy with it.
        return ClaimResult.IN_PROGRESS

    def _claim_rows(
        self, items: Sequence[ClaimItem], now_ms: int, lease_ms: int
    ) -> list[ClaimResult]:
        # The UPSERT takes rows in item order, as separate claims would. With a positive
        # lease, the items of one (key, owner) all win or all lose: after a win the row
        # is that owner's live claim, which no other owner can take; after a loss the
        # row stays live and not theirs (only its holder renews it). So when the UPSERT
        # changed fewer rows than there are items, the row as it is now tells each
        # item's outcome: ours and live, claimed; else what holds it, as in _claim.
        prefix = self.prefix
        keys = [prefix + key for key, _ in items]
        changed = 0
        for start in range(0, len(items), _BATCH_ROWS):
            end = min(start + _BATCH_ROWS, len(items))
            params: list[Any] = [now_ms, now_ms + lease_ms]
            for i in range(start, end):
                params.append(keys[i])
                params.append(items[i][1])
            sql = self._rows_statement(_CLAIM_ROWS, end - start)
            changed += self._conn.execute(sql, params).rowcount
        if changed == len(items):  # every item changed a row: each claimed (the rule)
            return [ClaimResult.CLAIMED] * len(items)
        # Some are held (a duplicate, a redelivery): one read to say by what. Outside a
        # transaction a row may change between the two statements; _claim's own read
        # has the same gap and the same answer: what the row now is, else a retry.
        distinct = list(dict.fromkeys(keys))
        rows: dict[str, tuple[str, str | None, int]] = {}
        for start in range(0, len(distinct), _BATCH_ROWS):
            chunk = distinct[start : start + _BATCH_ROWS]
            sql = self._rows_statement(_READ_ROWS, len(chunk))
            for key, state, owner, expires_at in self._conn.execute(sql, chunk):
                rows[key] = (state, owner, expires_at)
        results: list[ClaimResult] = []
        for k, (key, owner) in zip(keys, items, strict=True):
            row = rows.get(k)
            if row is None or row[2] <= now_ms:
                # Released or purged since the UPSERT: the single claim decides.
                results.append(self._claim(key, owner, now_ms, lease_ms))
            elif row[0] == "done":
                results.append(ClaimResult.DONE)
            elif row[0] == "cancelled":
                results.append(ClaimResult.CANCELLED)
            elif row[1] == owner:
                results.append(ClaimResult.CLAIMED)
            else:
                results.append(ClaimResult.IN_PROGRESS)
        return results

    def _finish_rows(
        self, items: Sequence[FinishItem], now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        # Releases first, then completes. The order between the two kinds does not
        # matter: after a complete the row is done or cancelled, which a release never
        # touches, and a complete overwrites a claim as surely as it fills the gap a
        # release left. Within each kind the items keep their order.
        prefix = self.prefix
        released: list[Any] = []
        completed: list[Any] = []
        for key, owner, succeeded in items:
            if succeeded:
                completed.append(prefix + key)
                completed.append(owner)
            else:
                released.append(prefix + key)
                released.append(owner)
        step = 2 * _BATCH_ROWS
        for start in range(0, len(released), step):
            chunk = released[start : start + step]
            self._conn.execute(self._rows_statement(_RELEASE_ROWS, len(chunk) // 2), chunk)
        for start in range(0, len(completed), step):
            chunk = completed[start : start + step]
            params = [now_ms, now_ms + retention_ms, *chunk]
            self._conn.execute(self._rows_statement(_COMPLETE_ROWS, len(chunk) // 2), params)
        return [None] * len(items)

    def _rows_statement(self, template: str, n: int) -> str:
        """`template` for `n` rows (n keys for _READ_ROWS), built once per size."""
        sql = self._rows_sql.get((template, n))
        if sql is None:
            if template is _READ_ROWS:
                sql = template.format(t=self.table, keys=",".join(["?"] * n))
            elif template is _RELEASE_ROWS:
                keys = ",".join(f"?{2 * i + 1}" for i in range(n))
                rows = ",".join(f"(?{2 * i + 1},?{2 * i + 2})" for i in range(n))
                sql = template.format(t=self.table, keys=keys, rows=rows)
            else:
                state = "claimed" if template is _CLAIM_ROWS else "done"
                rows = ",".join(f"(?{2 * i + 3},'{state}',?{2 * i + 4},?2)" for i in range(n))
                sql = template.format(t=self.table, rows=rows)
            self._rows_sql[(template, n)] = sql
        return sql

    def _complete(self, key: str, owner: str, now_ms: int, retention_ms: int) -> None:
        args = (self.prefix + key, owner, now_ms + retention_ms, now_ms)
        self._conn.execute(self._complete_sql, args)
        run_sync(self._conn.cursor(), self._sql_schedule.release_owners([owner]))

    def _release(self, key: str, owner: str) -> None:
        self._conn.execute(self._release_sql, (self.prefix + key, owner))
        run_sync(self._conn.cursor(), self._sql_schedule.release_owners([owner]))

    def _renew(self, key: str, owner: str, now_ms: int, lease_ms: int) -> bool:
        """The guard row's lease, or else the record's (the record as the claim)."""
        args = (self.prefix + key, owner, now_ms + lease_ms)
        if self._conn.execute(self._renew_sql, args).rowcount == 1:
            return True
        program = self._sql_schedule.renew_owner(owner, now_ms, lease_ms)
        return run_sync(self._conn.cursor(), program)

    def _cancel(self, key: str, now_ms: int, retention_ms: int) -> None:
        self._conn.execute(self._cancel_sql, (self.prefix + key, now_ms + retention_ms))


class SQLiteSchedule:
    """The SQLite store's schedule (`ScheduleBook`): table `<table>_schedule` in the
    same file, each operation a transaction of its own."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._sql = store._sql_schedule

    def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        return self._store.run_schedule(self._sql.place_many(entries, now_ms), write=True)

    def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        return self._store.run_schedule(self._sql.lookup(scope, key), write=False)

    def select(self, query: Query) -> list[ScheduleRecord]:
        return self._store.run_schedule(self._sql.select(query), write=False)

    def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return self._store.run_schedule(self._sql.cancel(scope, key, now_ms, hold_ms), write=True)

    def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        program = self._sql.reschedule(scope, key, due_ms, message_id, now_ms, sweep_ms)
        return self._store.run_schedule(program, write=True)

    def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        return self._store.run_schedule(self._sql.overdue(scope, now_ms, limit), write=False)

    def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        self._store.run_schedule(self._sql.swept(scope, items, now_ms), write=True)

    def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        return self._store.run_schedule(self._sql.lateness(scope, since_ms, sample), write=False)

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        return self._store.run_schedule(self._sql.count_due(scope, queue, edges), write=False)

    def purge(self, *, now_ms: int) -> int:
        total = 0
        while True:
            n = self._store.run_schedule(self._sql.purge(now_ms, _PURGE_SLICE), write=True)
            total += n
            if n < _PURGE_SLICE:
                return total


_Batch = list[tuple[Callable[[], Any], asyncio.Future[Any]]]


class AsyncSQLiteStore:
    """`SQLiteStore` for the async worker, with group commit on a thread of its own.

    Operations issued while the previous batch is committing (the claims and completes
    of the deliveries in flight) are queued and run together in one transaction: each is
    still one atomic statement, but they share the commit, which is most of the cost.
    The batch runs on one dedicated thread, because sqlite3 releases the GIL while it
    writes: the event loop keeps consuming meanwhile, and the busier the worker, the
    larger the next batch. Nothing returns before its transaction has committed.

    Waiting for SQLite's write lock (another process, or a handler's own transaction on
    the same file) blocks that thread, never the loop; after the store's busy timeout the
    waiting operations fail with `sqlite3.OperationalError` ("database is locked").

    An operation whose caller is cancelled before its batch runs is not executed.
    """

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self._pending: _Batch = []
        self._scheduled = False  # a batch is queued to start or running
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rabbit-delay-sqlite")

    @property
    def needs_purge(self) -> bool:
        return True

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim`. Raises `sqlite3.Error`."""
        return await self._submit(partial(self.store._claim, key, owner, now_ms, lease_ms))

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete`. Raises `sqlite3.Error`."""
        await self._submit(partial(self.store._complete, key, owner, now_ms, retention_ms))

    async def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `sqlite3.Error`."""
        await self._submit(partial(self.store._release, key, owner))

    async def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """See `IdempotencyStore.renew`. Raises `sqlite3.Error`."""
        return await self._submit(partial(self.store._renew, key, owner, now_ms, lease_ms))

    async def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """See `IdempotencyStore.claim_many`: the batch as `SQLiteStore.claim_many`
        (multi-row statements) on this store's thread, in turn with the group commits."""
        loop = asyncio.get_running_loop()
        run = partial(self.store.claim_many, items, now_ms=now_ms, lease_ms=lease_ms)
        return await loop.run_in_executor(self._executor, run)

    async def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `IdempotencyStore.finish_many`: as `SQLiteStore.finish_many`, on this
        store's thread."""
        loop = asyncio.get_running_loop()
        run = partial(self.store.finish_many, items, now_ms=now_ms, retention_ms=retention_ms)
        return await loop.run_in_executor(self._executor, run)

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `sqlite3.Error`."""
        await self._submit(partial(self.store._cancel, key, now_ms, retention_ms))

    async def purge(self, *, now_ms: int) -> int:
        """See `SQLiteStore.purge` (sliced; it waits for the lock). Raises `sqlite3.Error`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(self.store.purge, now_ms=now_ms))

    @property
    def schedule(self) -> SyncBookAsAsync:
        """The store's schedule, each operation on this store's thread."""
        return SyncBookAsAsync(self.store.schedule, self._executor)

    async def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `SQLiteStore.scheduled_batch`, on this store's thread."""
        loop = asyncio.get_running_loop()
        run = partial(
            self.store.scheduled_batch,
            finishes,
            claims,
            now_ms=now_ms,
            lease_ms=lease_ms,
            retention_ms=retention_ms,
        )
        return await loop.run_in_executor(self._executor, run)

    async def close(self) -> None:
        """Run what is pending, then close the file."""
        loop = asyncio.get_running_loop()
        while self._scheduled or self._pending:
            if not self._scheduled:
                self._start(loop)
            await asyncio.sleep(0.001)
        await loop.run_in_executor(self._executor, self.store.close)
        self._executor.shutdown(wait=True)

    async def _submit(self, op: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._pending.append((op, future))
        self._schedule(loop)
        return await future

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._scheduled:
            # At the end of this turn: every op issued before then joins the batch.
            self._scheduled = True
            loop.call_soon(self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = True
        batch, self._pending = self._pending, []
        live = [(op, fut) for op, fut in batch if not fut.done()]
        if not live:
            self._finish(loop, [], None)
            return
        ops = [op for op, _ in live]
        done = loop.run_in_executor(self._executor, self._run, ops)
        done.add_done_callback(lambda f: self._finish(loop, live, f))

    def _run(self, ops: Sequence[Callable[[], Any]]) -> list[Any]:
        try:
            return self.store.run_batch(ops, wait=True)
        except Exception as exc:  # busy past the timeout, or the store is closed
            return [exc] * len(ops)

    def _finish(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: _Batch,
        outcome: asyncio.Future[list[Any]] | None,
    ) -> None:
        if outcome is not None:
            self._resolve(batch, outcome.result())
        if self._pending:
            self._start(loop)  # what arrived while that batch committed
        else:
            self._scheduled = False

    @staticmethod
    def _resolve(batch: _Batch, outcomes: Sequence[Any]) -> None:
        for (_, fut), outcome in zip(batch, outcomes, strict=True):
            if fut.done():
                continue
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)
