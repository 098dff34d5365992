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
import re
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from rabbit_delay.errors import ConfigError
from rabbit_delay.idempotency._core import DEFAULT_PREFIX, ClaimItem, ClaimResult, FinishItem

T = TypeVar("T")

DEFAULT_TABLE = "rabbit_delay_idempotency"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# UPSERT (ON CONFLICT DO UPDATE) arrived in SQLite 3.24.
_MIN_SQLITE = (3, 24, 0)
_PURGE_SLICE = 2_000
# A claim whose UPSERT changed nothing is read back; if the row changed between the two
# statements (released, purged) the claim is tried again, at most this many times.
_CLAIM_ATTEMPTS = 5

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    key TEXT PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('claimed', 'done', 'cancelled')),
    owner TEXT,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID
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
        table: str = DEFAULT_TABLE,
        busy_timeout_s: float = 5.0,
    ) -> None:
        if not _IDENTIFIER.match(table):
            raise ConfigError(f"invalid SQLite table name {table!r}: letters, digits and _ only")
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
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(_SCHEMA.format(t=table))
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
        """See `IdempotencyStore.claim_many`: one transaction (`run_batch`)."""
        return self._run_items(
            [partial(self._claim, key, owner, now_ms, lease_ms) for key, owner in items]
        )

    def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `IdempotencyStore.finish_many`: one transaction (`run_batch`)."""
        return self._run_items(
            [
                partial(self._complete, key, owner, now_ms, retention_ms)
                if succeeded
                else partial(self._release, key, owner)
                for key, owner, succeeded in items
            ]
        )

    def _run_items(self, ops: Sequence[Callable[[], Any]]) -> list[Any]:
        try:
            return self.run_batch(ops, wait=True)
        except sqlite3.Error as exc:  # the write lock stayed busy past the timeout
            return [exc] * len(ops)

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `sqlite3.Error`."""
        with self._lock:
            self._set_wait(True)
            self._cancel(key, now_ms, retention_ms)

    def purge(self, *, now_ms: int) -> int:
        """See `IdempotencyStore.purge`: every expired row of the table, whatever its
        prefix. Raises `sqlite3.Error`."""
        total = 0
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
        _require_transaction(conn)
        conn.execute(self._complete_sql, (self.prefix + key, owner, now_ms + retention_ms, now_ms))

    def cancel_in(
        self, conn: sqlite3.Connection, key: str, *, now_ms: int, retention_ms: int
    ) -> None:
        """Write a tombstone for `key` through `conn`, inside the caller's transaction.

        For a handler whose change makes a scheduled message moot (the order is paid:
        cancel its timeout) in the same commit. Raises like `mark_done_in`.
        """
        _require_transaction(conn)
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
            try:
                results = [op() for op in ops]
                self._conn.execute("COMMIT")
                return results
            except sqlite3.Error:
                pass
            finally:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
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

    def _complete(self, key: str, owner: str, now_ms: int, retention_ms: int) -> None:
        args = (self.prefix + key, owner, now_ms + retention_ms, now_ms)
        self._conn.execute(self._complete_sql, args)

    def _release(self, key: str, owner: str) -> None:
        self._conn.execute(self._release_sql, (self.prefix + key, owner))

    def _renew(self, key: str, owner: str, now_ms: int, lease_ms: int) -> bool:
        args = (self.prefix + key, owner, now_ms + lease_ms)
        return bool(self._conn.execute(self._renew_sql, args).rowcount == 1)

    def _cancel(self, key: str, now_ms: int, retention_ms: int) -> None:
        self._conn.execute(self._cancel_sql, (self.prefix + key, now_ms + retention_ms))


def _require_transaction(conn: sqlite3.Connection) -> None:
    # With isolation_level=None (or 3.12's autocommit=True) and no BEGIN, the write
    # would commit by itself, apart from the handler's change: the point is lost.
    if conn.in_transaction:
        return
    if conn.isolation_level is None or getattr(conn, "autocommit", None) is True:
        raise ValueError(
            "the connection is in autocommit mode with no open transaction: "
            "run BEGIN (BEGIN IMMEDIATE) first, then the handler's writes and this call"
        )


_Batch = list[tuple[Callable[[], Any], asyncio.Future[Any]]]


def is_busy(exc: sqlite3.Error) -> bool:
    """True for SQLITE_BUSY (and its extended codes): another connection holds the lock."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_BUSY


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
        """See `IdempotencyStore.claim_many`: every item joins one group commit."""
        claim = self.store._claim
        return await self._submit_many(
            [partial(claim, key, owner, now_ms, lease_ms) for key, owner in items]
        )

    async def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `IdempotencyStore.finish_many`: every item joins one group commit."""
        complete, release = self.store._complete, self.store._release
        return await self._submit_many(
            [
                partial(complete, key, owner, now_ms, retention_ms)
                if succeeded
                else partial(release, key, owner)
                for key, owner, succeeded in items
            ]
        )

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `sqlite3.Error`."""
        await self._submit(partial(self.store._cancel, key, now_ms, retention_ms))

    async def purge(self, *, now_ms: int) -> int:
        """See `SQLiteStore.purge` (sliced; it waits for the lock). Raises `sqlite3.Error`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(self.store.purge, now_ms=now_ms))

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

    async def _submit_many(self, ops: Sequence[Callable[[], Any]]) -> list[Any]:
        """Queue `ops` together (so they share a batch); each outcome or exception."""
        if not ops:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in ops]
        self._pending.extend(zip(ops, futures, strict=True))
        self._schedule(loop)
        return list(await asyncio.gather(*futures, return_exceptions=True))

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
