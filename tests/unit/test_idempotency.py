"""Idempotency guard and stores: the shared contract on MemoryStore and SQLiteStore
(direct and group-commit), then what is particular to each: threads, processes, the
inbox pattern, group commit, the guards, configuration."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from idempotency_contract import (
    CANCELLED,
    CLAIMED,
    DONE,
    IN_PROGRESS,
    LEASE,
    RETENTION,
    T0,
    NewStore,
    StoreContract,
    new_key,
)

from rabbit_delay import ConfigError
from rabbit_delay._idempotency.guard import DEFAULT_PREFIX, AsyncGuard, Guard, SyncStoreAsAsync
from rabbit_delay._stores.factory import as_async, async_store_from_config, store_from_config
from rabbit_delay._topology.model import IdempotencyConfig
from rabbit_delay.stores import (
    AsyncIdempotencyStore,
    AsyncPostgresStore,
    AsyncRedisStore,
    AsyncSQLiteStore,
    ClaimResult,
    IdempotencyStore,
    MemoryStore,
    PostgresStore,
    RedisStore,
    SQLiteStore,
)

REPO = Path(__file__).resolve().parents[2]


# -- the contract ------------------------------------------------------------------------


class TestMemoryStoreContract(StoreContract):
    shared_backend = False

    @pytest.fixture
    def new_store(self) -> NewStore:
        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            return SyncStoreAsAsync(MemoryStore(prefix=prefix or DEFAULT_PREFIX))

        return make


class TestSQLiteStoreContract(StoreContract):
    @pytest.fixture
    def new_store(self, tmp_path: Path) -> Iterator[NewStore]:
        made: list[SQLiteStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(SQLiteStore(tmp_path / "idem.sqlite3", prefix=prefix or DEFAULT_PREFIX))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncSQLiteStoreContract(StoreContract):
    @pytest.fixture
    def new_store(self, tmp_path: Path) -> Iterator[NewStore]:
        made: list[SQLiteStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(SQLiteStore(tmp_path / "idem.sqlite3", prefix=prefix or DEFAULT_PREFIX))
            return AsyncSQLiteStore(made[-1])

        yield make
        for store in made:
            store.close()


# -- threads and processes ---------------------------------------------------------------

StoreFactory = Callable[[], IdempotencyStore]


def race(stores: list[IdempotencyStore], keys: list[str]) -> dict[str, list[str]]:
    """Each store claims every key from its own thread, all released at once by a barrier.
    Returns, per key, the owners that got CLAIMED."""
    barrier = threading.Barrier(len(stores))
    winners: dict[str, list[str]] = {k: [] for k in keys}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(index: int, store: IdempotencyStore) -> None:
        owner = f"thread-{index}"
        try:
            barrier.wait(timeout=10)
            for key in keys:
                if store.claim(key, owner, now_ms=T0, lease_ms=LEASE) is CLAIMED:
                    with lock:
                        winners[key].append(owner)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return winners


def test_memory_store_threads_race_for_a_key_one_wins() -> None:
    store = MemoryStore()
    keys = [new_key() for _ in range(300)]
    winners = race([store] * 8, keys)
    assert all(len(w) == 1 for w in winners.values()), winners


def test_sqlite_store_shared_by_threads_one_wins(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        keys = [new_key() for _ in range(300)]
        winners = race([store] * 8, keys)
    assert all(len(w) == 1 for w in winners.values()), winners


def test_sqlite_stores_on_one_file_one_per_thread_one_wins(tmp_path: Path) -> None:
    # Eight connections to one file: what eight worker processes do.
    stores: list[IdempotencyStore] = [SQLiteStore(tmp_path / "idem.sqlite3") for _ in range(8)]
    try:
        keys = [new_key() for _ in range(300)]
        winners = race(stores, keys)
    finally:
        for s in stores:
            s.close()
    assert all(len(w) == 1 for w in winners.values()), winners


def test_two_sqlite_stores_on_one_file_never_both_claim(tmp_path: Path) -> None:
    path = tmp_path / "idem.sqlite3"
    with SQLiteStore(path) as one, SQLiteStore(path) as two:
        key = new_key()
        assert one.claim(key, "p1", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert two.claim(key, "p2", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
        one.complete(key, "p1", now_ms=T0, retention_ms=RETENTION)
        assert two.claim(key, "p2", now_ms=T0, lease_ms=LEASE) is DONE
        other = new_key()
        assert two.claim(other, "p2", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert one.claim(other, "p1", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


_CLAIMER = textwrap.dedent(
    """
    import os, sys
    from rabbit_delay.stores import ClaimResult, SQLiteStore
    path, count = sys.argv[1], int(sys.argv[2])
    store = SQLiteStore(path, busy_timeout_s=30)
    sys.stdin.readline()  # start together
    owner = str(os.getpid())
    won = [str(i) for i in range(count)
           if store.claim(f"k{i}", owner, now_ms=1, lease_ms=10**9) is ClaimResult.CLAIMED]
    store.close()
    print(" ".join(won))
    """
)


def test_sqlite_processes_claim_each_key_exactly_once(tmp_path: Path) -> None:
    path, count = tmp_path / "idem.sqlite3", 400
    SQLiteStore(path).close()  # create the schema before the race
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, str(path), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    won: list[str] = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        won.extend(out.split())
    assert sorted(won, key=int) == [str(i) for i in range(count)]


# -- SQLite particulars ------------------------------------------------------------------


def test_sqlite_uses_wal_and_synchronous_normal(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_sqlite_stores_opening_one_new_file_at_once_all_open(tmp_path: Path) -> None:
    """Workers started together on one new file: switching it to WAL takes a lock that
    SQLite's busy handler does not wait for, so one of them failed with "database is
    locked" at start (seen in CI: a worker process exited with 1)."""
    errors: list[str] = []
    for round_ in range(20):
        path = tmp_path / f"store-{round_}.sqlite3"
        barrier = threading.Barrier(6)

        def open_one(path: Path = path, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                SQLiteStore(path).close()
            except sqlite3.Error as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=open_one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    with SQLiteStore(tmp_path / "store-0.sqlite3") as store:
        (mode,) = store._conn.execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal"


def test_sqlite_rejects_a_table_name_that_is_not_an_identifier(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="table name"):
        SQLiteStore(tmp_path / "idem.sqlite3", table="x; DROP TABLE y")


def test_sqlite_custom_table_keeps_records_apart(tmp_path: Path) -> None:
    path = tmp_path / "idem.sqlite3"
    with SQLiteStore(path, table="one") as one, SQLiteStore(path, table="two") as two:
        key = new_key()
        one.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        assert two.claim(key, "b", now_ms=T0, lease_ms=LEASE) is CLAIMED


def test_sqlite_records_survive_reopening(tmp_path: Path) -> None:
    path, key = tmp_path / "idem.sqlite3", new_key()
    with SQLiteStore(path) as store:
        store.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
    with SQLiteStore(path) as store:
        assert store.claim(key, "b", now_ms=T0 + 1, lease_ms=LEASE) is DONE


def test_sqlite_purge_walks_past_one_slice(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        expired = [new_key() for _ in range(4_500)]
        kept = [new_key() for _ in range(100)]
        for key in expired:
            store.complete(key, "a", now_ms=T0, retention_ms=10)
        for key in kept:
            store.complete(key, "a", now_ms=T0, retention_ms=RETENTION)
        assert store.purge(now_ms=T0 + 10) == len(expired)
        count = store._conn.execute(f"SELECT count(*) FROM {store.table}").fetchone()[0]
        assert count == len(kept)
        assert all(store.claim(k, "b", now_ms=T0 + 11, lease_ms=LEASE) is DONE for k in kept)


# -- the inbox pattern -------------------------------------------------------------------


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[tuple[SQLiteStore, sqlite3.Connection]]:
    path = tmp_path / "app.sqlite3"
    store = SQLiteStore(path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE effects (message_id TEXT NOT NULL)")
    yield store, conn
    conn.close()
    store.close()


def test_mark_done_in_commits_with_the_handlers_change(
    inbox: tuple[SQLiteStore, sqlite3.Connection],
) -> None:
    store, conn = inbox
    key = new_key()
    assert store.claim(key, "w1", now_ms=T0, lease_ms=LEASE) is CLAIMED
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO effects VALUES (?)", (key,))
    store.mark_done_in(conn, key, now_ms=T0 + 1, retention_ms=RETENTION, owner="w1")
    conn.execute("COMMIT")
    # The worker died before complete() and ack: the redelivery is recognised.
    assert store.claim(key, "w2", now_ms=T0 + 2, lease_ms=LEASE) is DONE
    # A late complete() from the first worker changes nothing (the retention stays).
    store.complete(key, "w1", now_ms=T0 + RETENTION // 2, retention_ms=RETENTION)
    assert store.claim(key, "w2", now_ms=T0 + 1 + RETENTION, lease_ms=LEASE) is CLAIMED
    assert conn.execute("SELECT count(*) FROM effects").fetchone()[0] == 1


def test_mark_done_in_rolls_back_with_the_handlers_change(
    inbox: tuple[SQLiteStore, sqlite3.Connection],
) -> None:
    store, conn = inbox
    key = new_key()
    assert store.claim(key, "w1", now_ms=T0, lease_ms=LEASE) is CLAIMED
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO effects VALUES (?)", (key,))
    store.mark_done_in(conn, key, now_ms=T0 + 1, retention_ms=RETENTION)
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT count(*) FROM effects").fetchone()[0] == 0
    # Still our claim, not done: the worker releases it and the retry runs.
    assert store.claim(key, "w2", now_ms=T0 + 2, lease_ms=LEASE) is IN_PROGRESS
    store.release(key, "w1")
    assert store.claim(key, "w2", now_ms=T0 + 3, lease_ms=LEASE) is CLAIMED


def test_mark_done_in_works_with_pythons_implicit_transactions(tmp_path: Path) -> None:
    path, key = tmp_path / "app.sqlite3", new_key()
    with SQLiteStore(path) as store:
        conn = sqlite3.connect(path)  # default isolation: the INSERT opens a transaction
        reader = sqlite3.connect(path)
        try:
            store.mark_done_in(conn, key, now_ms=T0, retention_ms=RETENTION)
            assert conn.in_transaction
            seen = "SELECT count(*) FROM rabbit_delay_idempotency WHERE key = ?"
            assert reader.execute(seen, (DEFAULT_PREFIX + key,)).fetchone()[0] == 0
            conn.commit()
            assert reader.execute(seen, (DEFAULT_PREFIX + key,)).fetchone()[0] == 1
        finally:
            conn.close()
            reader.close()
        assert store.claim(key, "w", now_ms=T0 + 1, lease_ms=LEASE) is DONE


def test_mark_done_in_refuses_an_autocommit_connection(
    inbox: tuple[SQLiteStore, sqlite3.Connection],
) -> None:
    store, conn = inbox
    with pytest.raises(ValueError, match="autocommit"):
        store.mark_done_in(conn, new_key(), now_ms=T0, retention_ms=RETENTION)
    with pytest.raises(ValueError, match="autocommit"):
        store.cancel_in(conn, new_key(), now_ms=T0, retention_ms=RETENTION)


def test_mark_done_in_a_file_without_the_table_fails(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        other = sqlite3.connect(tmp_path / "other.sqlite3", isolation_level=None)
        other.execute("BEGIN")
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            store.mark_done_in(other, new_key(), now_ms=T0, retention_ms=RETENTION)
        other.close()


def test_cancel_in_commits_with_the_handlers_change(
    inbox: tuple[SQLiteStore, sqlite3.Connection],
) -> None:
    store, conn = inbox
    timeout_key = new_key()
    conn.execute("BEGIN IMMEDIATE")
    store.cancel_in(conn, timeout_key, now_ms=T0, retention_ms=RETENTION)
    conn.execute("COMMIT")
    assert store.claim(timeout_key, "w", now_ms=T0 + 1, lease_ms=LEASE) is CANCELLED


def test_the_inbox_example_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "inbox_sqlite.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout


# -- group commit ------------------------------------------------------------------------


class CountingStore(SQLiteStore):
    batches: list[int]

    def run_batch(self, ops: Any, *, wait: bool = True) -> list[Any]:
        self.batches.append(len(ops))
        return super().run_batch(ops, wait=wait)


@pytest.fixture
def counting(tmp_path: Path) -> Iterator[CountingStore]:
    store = CountingStore(tmp_path / "idem.sqlite3")
    store.batches = []
    yield store
    store.close()


async def test_group_commit_shares_one_transaction_per_loop_turn(counting: CountingStore) -> None:
    store = AsyncSQLiteStore(counting)
    keys = [new_key() for _ in range(50)]
    results = await asyncio.gather(*(store.claim(k, "a", now_ms=T0, lease_ms=LEASE) for k in keys))
    assert results == [CLAIMED] * 50
    assert counting.batches == [50]
    await asyncio.gather(*(store.complete(k, "a", now_ms=T0, retention_ms=RETENTION) for k in keys))
    assert counting.batches == [50, 50]
    assert all(counting.claim(k, "b", now_ms=T0, lease_ms=LEASE) is DONE for k in keys)


async def test_group_commit_skips_an_operation_cancelled_before_its_batch(
    counting: CountingStore,
) -> None:
    store = AsyncSQLiteStore(counting)
    key = new_key()
    task = asyncio.ensure_future(store.claim(key, "a", now_ms=T0, lease_ms=LEASE))
    await asyncio.sleep(0)  # the claim is queued, its batch not yet run
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert counting.claim(key, "b", now_ms=T0, lease_ms=LEASE) is CLAIMED


async def test_group_commit_one_failing_operation_fails_alone(counting: CountingStore) -> None:
    store = AsyncSQLiteStore(counting)
    good = new_key()

    def broken() -> None:
        counting._conn.execute("INSERT INTO no_such_table VALUES (1)")

    async def submit_broken() -> None:
        await store._submit(broken)

    results = await asyncio.gather(
        store.claim(good, "a", now_ms=T0, lease_ms=LEASE), submit_broken(), return_exceptions=True
    )
    assert results[0] is CLAIMED
    assert isinstance(results[1], sqlite3.OperationalError)
    assert counting.claim(good, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


async def test_group_commit_does_not_block_the_loop_on_a_busy_file(tmp_path: Path) -> None:
    path = tmp_path / "app.sqlite3"
    with SQLiteStore(path) as sync_store:
        store = AsyncSQLiteStore(sync_store)
        handler_conn = sqlite3.connect(path, isolation_level=None)
        handler_conn.execute("BEGIN IMMEDIATE")  # a handler's transaction holds the lock
        key = new_key()
        claim = asyncio.ensure_future(store.claim(key, "a", now_ms=T0, lease_ms=LEASE))
        ticks = 0
        for _ in range(20):  # the loop keeps turning while the claim waits
            await asyncio.sleep(0.005)
            ticks += 1
        assert not claim.done()
        handler_conn.execute("COMMIT")
        assert await asyncio.wait_for(claim, timeout=5) is CLAIMED
        assert ticks == 20
        handler_conn.close()


async def test_group_commit_gives_up_after_the_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "app.sqlite3"
    with SQLiteStore(path, busy_timeout_s=0.2) as sync_store:
        store = AsyncSQLiteStore(sync_store)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                await asyncio.wait_for(
                    store.claim(new_key(), "a", now_ms=T0, lease_ms=LEASE), timeout=5
                )
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        # Once free, the store works again.
        assert await store.claim(new_key(), "a", now_ms=T0, lease_ms=LEASE) is CLAIMED


async def test_async_sqlite_close_runs_what_is_pending(tmp_path: Path) -> None:
    path = tmp_path / "idem.sqlite3"
    store = AsyncSQLiteStore(SQLiteStore(path))
    key = new_key()
    await store.claim(key, "a", now_ms=T0, lease_ms=LEASE)
    await store.close()
    with SQLiteStore(path) as again:
        assert again.claim(key, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


# -- the guards --------------------------------------------------------------------------


class FakeClock:
    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_guard_runs_the_lifecycle_and_counts_outcomes() -> None:
    clock = FakeClock()
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=clock)
    key = new_key()
    assert guard.claim(key, "a") is CLAIMED
    assert guard.claim(key, "b") is IN_PROGRESS
    guard.done(key, "a")
    assert guard.claim(key, "b") is DONE
    assert guard.claim(key, "c") is DONE
    guard.cancel("timeout-1")
    assert guard.claim("timeout-1", "d") is CANCELLED
    assert guard.stats.as_dict() == {
        "claimed": 1,
        "duplicates_skipped": 2,
        "in_progress_deferred": 1,
        "cancelled_dropped": 1,
        "superseded_dropped": 0,
    }
    clock.now += RETENTION
    assert guard.purge() == 2
    assert guard.claim(key, "e") is CLAIMED


def test_guard_failed_releases_the_claim() -> None:
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=FakeClock())
    assert guard.claim("k", "a") is CLAIMED
    guard.failed("k", "a")
    assert guard.claim("k", "retry") is CLAIMED


def test_guard_uses_lease_and_retention_from_its_clock() -> None:
    clock = FakeClock()
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=clock)
    assert guard.claim("k", "a") is CLAIMED
    clock.now += LEASE
    assert guard.claim("k", "b") is CLAIMED  # the crashed owner's lease is over
    guard.done("k", "b")
    clock.now += RETENTION - 1
    assert guard.claim("k", "c") is DONE
    clock.now += 1
    assert guard.claim("k", "c") is CLAIMED


def test_guard_cancel_can_outlive_the_retention() -> None:
    clock = FakeClock()
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=clock)
    guard.cancel("far", retention_ms=10 * RETENTION)
    clock.now += 5 * RETENTION
    assert guard.claim("far", "a") is CANCELLED


def test_guard_default_clock_is_wall_time() -> None:
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION)
    assert guard.claim("k", "a") is CLAIMED
    guard.done("k", "a")
    assert guard.claim("k", "b") is DONE


@pytest.mark.parametrize(("lease", "retention"), [(0, 1), (1, 0), (-5, 1)])
def test_guard_rejects_non_positive_durations(lease: int, retention: int) -> None:
    with pytest.raises(ConfigError, match="must be positive"):
        Guard(MemoryStore(), lease_ms=lease, retention_ms=retention)


def test_guard_rejects_an_empty_key_and_a_bad_tombstone_retention() -> None:
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION)
    with pytest.raises(ValueError, match="non-empty"):
        guard.claim("", "a")
    with pytest.raises(ValueError, match="non-empty"):
        guard.cancel("")
    with pytest.raises(ValueError, match="positive"):
        guard.cancel("k", retention_ms=0)


def test_guard_counts_from_many_threads() -> None:
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=FakeClock())
    guard.claim("k", "holder")

    def hammer() -> None:
        for i in range(2_000):
            guard.claim("k", f"other-{i}")

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert guard.stats.in_progress_deferred == 16_000


async def test_async_guard_runs_the_lifecycle_and_counts_outcomes(tmp_path: Path) -> None:
    clock = FakeClock()
    store = as_async(SQLiteStore(tmp_path / "idem.sqlite3"))
    guard = AsyncGuard(store, lease_ms=LEASE, retention_ms=RETENTION, clock=clock)
    assert await guard.claim("k", "a") is CLAIMED
    assert await guard.claim("k", "b") is IN_PROGRESS
    await guard.failed("k", "a")
    assert await guard.claim("k", "b") is CLAIMED
    await guard.done("k", "b")
    assert await guard.claim("k", "c") is DONE
    await guard.cancel("t")
    assert await guard.claim("t", "c") is CANCELLED
    with pytest.raises(ValueError, match="non-empty"):
        await guard.claim("", "a")
    assert guard.stats.as_dict() == {
        "claimed": 2,
        "duplicates_skipped": 1,
        "in_progress_deferred": 1,
        "cancelled_dropped": 1,
        "superseded_dropped": 0,
    }
    clock.now += RETENTION
    assert await guard.purge() == 2
    await store.close()


# -- configuration -----------------------------------------------------------------------


def test_store_from_config_builds_each_kind(tmp_path: Path) -> None:
    memory = store_from_config(IdempotencyConfig(store="memory"))
    assert isinstance(memory, MemoryStore)
    sqlite = store_from_config(IdempotencyConfig(path=str(tmp_path / "x.sqlite3")))
    assert isinstance(sqlite, SQLiteStore)
    assert (tmp_path / "x.sqlite3").exists()
    sqlite.close()
    redis_store = store_from_config(IdempotencyConfig(store="redis", url="redis://127.0.0.1:1/0"))
    assert isinstance(redis_store, RedisStore)  # connects lazily, on first use
    redis_store.close()


async def test_async_store_from_config_builds_each_kind(tmp_path: Path) -> None:
    sqlite = async_store_from_config(IdempotencyConfig(path=str(tmp_path / "x.sqlite3")))
    assert isinstance(sqlite, AsyncSQLiteStore)
    await sqlite.close()
    memory = async_store_from_config(IdempotencyConfig(store="memory"))
    assert isinstance(memory, SyncStoreAsAsync)
    assert isinstance(memory.store, MemoryStore)
    redis_store = async_store_from_config(IdempotencyConfig(store="redis", url="redis://x:1/0"))
    assert isinstance(redis_store, AsyncRedisStore)
    await redis_store.close()


PG_URL = "postgresql://u:hunter2@127.0.0.1:1/db"


async def test_postgres_stores_from_config_connect_on_first_use() -> None:
    cfg = IdempotencyConfig(store="postgres", url=PG_URL)
    store = store_from_config(cfg, prefix="p:")
    assert isinstance(store, PostgresStore)
    assert (store.prefix, store.table, store.server_clock) == (
        "p:",
        "rabbit_delay_idempotency",
        True,
    )
    assert store.needs_purge
    assert "hunter2" not in repr(store)
    twin = as_async(store)
    assert isinstance(twin, AsyncPostgresStore)
    assert (twin.url, twin.prefix, twin.table) == (PG_URL, "p:", store.table)
    store.close()
    await twin.close()
    async_store = async_store_from_config(cfg)
    assert isinstance(async_store, AsyncPostgresStore)
    await async_store.close()


def test_postgres_store_refuses_a_bad_url_or_table_at_once() -> None:
    with pytest.raises(ConfigError, match="invalid PostgreSQL URL") as info:
        PostgresStore("postgresql://u:hunter2@db/x?no_such_parameter=1")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="invalid PostgreSQL table name"):
        AsyncPostgresStore(PG_URL, table="1table")


def test_postgres_store_without_psycopg_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # makes `import psycopg` fail
    with pytest.raises(ConfigError, match="rabbit-delay\\[postgres\\]"):
        PostgresStore(PG_URL)
    with pytest.raises(ConfigError, match="rabbit-delay\\[postgres\\]"):
        AsyncPostgresStore(PG_URL)


def test_postgres_batch_splits_a_repeated_key_into_waves() -> None:
    from rabbit_delay._stores.postgres import _waves

    assert _waves(["a", "b", "a", "c", "a", "b"]) == [[0, 1, 3], [2, 5], [4]]
    assert _waves([]) == []


def test_postgres_store_needs_postgresql_14() -> None:
    from rabbit_delay._stores.postgres import _server_version_ok

    _server_version_ok(140_000)
    with pytest.raises(ConfigError, match=r"PostgreSQL 14 or newer.*the server is 13"):
        _server_version_ok(130_012)


def test_as_async_gives_sqlite_group_commit(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        assert isinstance(as_async(store), AsyncSQLiteStore)
    assert isinstance(as_async(MemoryStore()), SyncStoreAsAsync)


def test_needs_purge_says_who_expires_records(tmp_path: Path) -> None:
    assert MemoryStore().needs_purge
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        assert store.needs_purge
        assert as_async(store).needs_purge
    assert not RedisStore("redis://127.0.0.1:1/0").needs_purge


def test_redis_store_without_redis_py_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # makes `import redis` fail
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(ConfigError, match="rabbit-delay\\[redis\\]"):
        RedisStore()
    with pytest.raises(ConfigError, match="rabbit-delay\\[redis\\]"):
        AsyncRedisStore()


def test_importing_the_module_does_not_import_redis_or_psycopg() -> None:
    code = (
        "import sys, rabbit_delay.stores, rabbit_delay._stores.factory; "
        "print('redis' in sys.modules, 'psycopg' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False False"


def test_claim_result_values_are_stable() -> None:
    assert [r.value for r in ClaimResult] == [
        "claimed",
        "done",
        "in_progress",
        "cancelled",
        "superseded",
    ]


async def test_guards_from_config(tmp_path: Path) -> None:
    cfg = IdempotencyConfig(path=str(tmp_path / "x.sqlite3"), lease="30s", retention="1d")
    guard = Guard(
        store_from_config(cfg), lease_ms=cfg.lease, retention_ms=cfg.retention, clock=FakeClock()
    )
    assert (guard.lease_ms, guard.retention_ms) == (30_000, 86_400_000)
    assert isinstance(guard.store, SQLiteStore)
    assert guard.claim("k", "a") is CLAIMED
    guard.store.close()
    async_guard = AsyncGuard(
        async_store_from_config(cfg),
        lease_ms=cfg.lease,
        retention_ms=cfg.retention,
        clock=FakeClock(),
    )
    assert isinstance(async_guard.store, AsyncSQLiteStore)
    assert await async_guard.claim("k", "b") is IN_PROGRESS  # same file, a's claim
    await async_guard.store.close()


# -- renew and batches: what the worker relies on -----------------------------------------


def test_guard_renew_uses_its_clock_and_lease() -> None:
    clock = FakeClock()
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=clock)
    assert guard.claim("k", "a") is CLAIMED
    clock.now += LEASE - 1
    assert guard.renew("k", "a") is True
    clock.now += LEASE - 1  # past the first lease, inside the renewed one
    assert guard.claim("k", "b") is IN_PROGRESS
    assert guard.renew("k", "b") is False
    assert guard.renew("absent", "a") is False
    assert guard.claim("absent", "b") is CLAIMED  # renew created nothing
    assert guard.stats.claimed == 2  # renewals are not claims
    with pytest.raises(ValueError, match="non-empty"):
        guard.renew("", "a")


def test_guard_claim_many_counts_and_answers_an_empty_key_in_its_slot() -> None:
    guard = Guard(MemoryStore(), lease_ms=LEASE, retention_ms=RETENTION, clock=FakeClock())
    guard.done("done", "x")
    guard.cancel("tomb")
    results = guard.claim_many(
        [("a", "o1"), ("", "o2"), ("done", "o3"), ("tomb", "o4"), ("a", "o5")]
    )
    assert results[0] is CLAIMED
    assert isinstance(results[1], ValueError)
    assert results[2:] == [DONE, CANCELLED, IN_PROGRESS]
    assert guard.stats.as_dict() == {
        "claimed": 1,
        "duplicates_skipped": 1,
        "in_progress_deferred": 1,
        "cancelled_dropped": 1,
        "superseded_dropped": 0,
    }
    finished = guard.finish_many([("a", "o1", True), ("", "o2", True)])
    assert finished[0] is None
    assert isinstance(finished[1], ValueError)
    assert guard.claim("a", "o6") is DONE
    assert guard.claim_many([]) == []
    assert guard.finish_many([]) == []


class PlainStore:
    """A user's store written before renew and the batch operations: the five basic
    methods only (over a MemoryStore), failing for the key "poison"."""

    needs_purge = True

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.calls: list[str] = []

    def _check(self, key: str) -> None:
        if key == "poison":
            raise RuntimeError("the store failed for this key")

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        self.calls.append("claim")
        self._check(key)
        return self.inner.claim(key, owner, now_ms=now_ms, lease_ms=lease_ms)

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        self.calls.append("complete")
        self._check(key)
        self.inner.complete(key, owner, now_ms=now_ms, retention_ms=retention_ms)

    def release(self, key: str, owner: str) -> None:
        self.calls.append("release")
        self._check(key)
        self.inner.release(key, owner)

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        self.inner.cancel(key, now_ms=now_ms, retention_ms=retention_ms)

    def purge(self, *, now_ms: int) -> int:
        return self.inner.purge(now_ms=now_ms)

    def close(self) -> None:
        self.inner.close()


class PlainAsyncStore:
    """PlainStore's coroutine twin: no renew, no batch operations."""

    needs_purge = True

    def __init__(self) -> None:
        self.sync = PlainStore()

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        return self.sync.claim(key, owner, now_ms=now_ms, lease_ms=lease_ms)

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        self.sync.complete(key, owner, now_ms=now_ms, retention_ms=retention_ms)

    async def release(self, key: str, owner: str) -> None:
        self.sync.release(key, owner)

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        self.sync.cancel(key, now_ms=now_ms, retention_ms=retention_ms)

    async def purge(self, *, now_ms: int) -> int:
        return self.sync.purge(now_ms=now_ms)

    async def close(self) -> None:
        self.sync.close()


def test_guard_falls_back_for_a_store_without_renew_or_batches() -> None:
    store = PlainStore()
    guard = Guard(store, lease_ms=LEASE, retention_ms=RETENTION, clock=FakeClock())  # type: ignore[arg-type]
    results = guard.claim_many([("k1", "a"), ("poison", "a"), ("k2", "a")])
    assert results[0] is CLAIMED
    assert isinstance(results[1], RuntimeError)
    assert results[2] is CLAIMED
    assert guard.renew("k1", "a") is True  # a re-entrant claim stands in for renew
    assert guard.renew("k1", "b") is False
    finished = guard.finish_many([("k1", "a", True), ("poison", "a", False), ("k2", "a", False)])
    assert finished[0] is None
    assert isinstance(finished[1], RuntimeError)
    assert finished[2] is None
    assert store.calls.count("complete") == 1
    assert store.calls.count("release") == 2
    assert guard.claim_many([("k1", "b"), ("k2", "b")]) == [DONE, CLAIMED]
    assert guard.stats.claimed == 3


async def test_sync_store_as_async_falls_back_too() -> None:
    store = SyncStoreAsAsync(PlainStore())  # type: ignore[arg-type]
    results = await store.claim_many([("k", "a"), ("poison", "a")], now_ms=T0, lease_ms=LEASE)
    assert results[0] is CLAIMED
    assert isinstance(results[1], RuntimeError)
    assert await store.renew("k", "a", now_ms=T0, lease_ms=LEASE) is True
    assert await store.finish_many([("k", "a", True)], now_ms=T0, retention_ms=RETENTION) == [None]
    assert await store.claim("k", "b", now_ms=T0, lease_ms=LEASE) is DONE


async def test_async_guard_renew_and_batches(tmp_path: Path) -> None:
    clock = FakeClock()
    store = as_async(SQLiteStore(tmp_path / "idem.sqlite3"))
    guard = AsyncGuard(store, lease_ms=LEASE, retention_ms=RETENTION, clock=clock)
    results = await guard.claim_many([("k1", "a"), ("", "a"), ("k1", "b")])
    assert results[0] is CLAIMED
    assert isinstance(results[1], ValueError)
    assert results[2] is IN_PROGRESS
    clock.now += LEASE - 1
    assert await guard.renew("k1", "a") is True
    clock.now += LEASE - 1
    assert await guard.claim("k1", "b") is IN_PROGRESS
    assert await guard.renew("k1", "b") is False
    finished = await guard.finish_many([("k1", "a", True), ("", "a", False)])
    assert finished[0] is None
    assert isinstance(finished[1], ValueError)
    assert await guard.claim("k1", "c") is DONE
    assert guard.stats.as_dict() == {
        "claimed": 1,
        "duplicates_skipped": 1,
        "in_progress_deferred": 2,
        "cancelled_dropped": 0,
        "superseded_dropped": 0,
    }
    with pytest.raises(ValueError, match="non-empty"):
        await guard.renew("", "a")
    await store.close()


async def test_async_guard_falls_back_for_a_store_without_renew_or_batches() -> None:
    store = PlainAsyncStore()
    guard = AsyncGuard(store, lease_ms=LEASE, retention_ms=RETENTION, clock=FakeClock())  # type: ignore[arg-type]
    results = await guard.claim_many([("k1", "a"), ("poison", "a")])
    assert results[0] is CLAIMED
    assert isinstance(results[1], RuntimeError)
    assert await guard.renew("k1", "a") is True
    finished = await guard.finish_many([("k1", "a", True), ("poison", "a", True)])
    assert finished[0] is None
    assert isinstance(finished[1], RuntimeError)
    assert await guard.claim("k1", "b") is DONE


class BrokenBatchStore(MemoryStore):
    def claim_many(self, items: Any, *, now_ms: int, lease_ms: int) -> Any:
        raise RuntimeError("the whole batch failed")


def test_guard_a_batch_that_raises_fills_every_slot() -> None:
    guard = Guard(BrokenBatchStore(), lease_ms=LEASE, retention_ms=RETENTION)
    results = guard.claim_many([("k1", "a"), ("", "a"), ("k2", "a")])
    assert [type(r) for r in results] == [RuntimeError, ValueError, RuntimeError]
    assert guard.stats.claimed == 0


def traced(store: SQLiteStore) -> list[str]:
    """The first word of each statement `store` runs from now on."""
    seen: list[str] = []
    store._conn.set_trace_callback(lambda sql: seen.append(sql.split()[0].upper()))
    return seen


def test_sqlite_batches_write_in_one_statement_per_kind(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        keys = [new_key() for _ in range(20)]
        seen = traced(store)
        claims = [(k, "a") for k in keys]
        assert store.claim_many(claims, now_ms=T0, lease_ms=LEASE) == [CLAIMED] * 20
        assert seen == ["INSERT"]  # one statement: its own transaction
        seen.clear()
        items = [(k, "a", i % 2 == 0) for i, k in enumerate(keys)]
        assert store.finish_many(items, now_ms=T0, retention_ms=RETENTION) == [None] * 20
        assert seen == ["BEGIN", "DELETE", "INSERT", "COMMIT"]
        seen.clear()
        # Held rows: the claim reads them back, once.
        results = store.claim_many(claims, now_ms=T0 + 1, lease_ms=LEASE)
        assert results == [DONE if i % 2 == 0 else CLAIMED for i in range(20)]
        assert seen == ["INSERT", "SELECT"]


def test_sqlite_batch_larger_than_a_statement_is_one_transaction(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        keys = [new_key() for _ in range(450)]
        seen = traced(store)
        claims = [(k, "a") for k in keys] + [(keys[0], "b"), (keys[449], "a")]
        assert store.claim_many(claims, now_ms=T0, lease_ms=LEASE) == (
            [CLAIMED] * 450 + [IN_PROGRESS, CLAIMED]
        )
        # Three UPSERTs (200 + 200 + 52 rows), then the read of the 450 keys, in one go.
        assert seen == ["BEGIN"] + ["INSERT"] * 3 + ["SELECT"] * 3 + ["COMMIT"]
        seen.clear()
        items = [(k, "a", True) for k in keys]
        assert store.finish_many(items, now_ms=T0, retention_ms=RETENTION) == [None] * 450
        assert seen == ["BEGIN", "INSERT", "INSERT", "INSERT", "COMMIT"]
        assert store.claim(keys[300], "b", now_ms=T0, lease_ms=LEASE) is DONE


def sequential_and_batched(
    tmp_path: Path, setup: Callable[[SQLiteStore], None]
) -> tuple[SQLiteStore, SQLiteStore]:
    """Two stores in two files, both prepared by `setup`."""
    one, two = SQLiteStore(tmp_path / "one.sqlite3"), SQLiteStore(tmp_path / "two.sqlite3")
    setup(one)
    setup(two)
    return one, two


def table_of(store: SQLiteStore) -> list[tuple[Any, ...]]:
    return store._conn.execute(f"SELECT * FROM {store.table} ORDER BY key").fetchall()


@pytest.mark.parametrize("seed", range(12))
def test_sqlite_batches_match_the_single_operations(tmp_path: Path, seed: int) -> None:
    """Random batches over a few keys in every state, with repeats: the same results and
    rows as the single operations one after the other."""
    import random

    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(8)]
    owners = ["a", "b", "c"]

    def setup(store: SQLiteStore) -> None:
        for i, key in enumerate(keys):
            kind = i % 5
            if kind == 0:
                store.claim(key, "a", now_ms=T0, lease_ms=LEASE)  # held by a
            elif kind == 1:
                store.claim(key, "x", now_ms=T0 - 2 * LEASE, lease_ms=LEASE)  # lapsed
            elif kind == 2:
                store.complete(key, "x", now_ms=T0, retention_ms=RETENTION)
            elif kind == 3:
                store.cancel(key, now_ms=T0, retention_ms=RETENTION)
            # kind 4: absent

    one, two = sequential_and_batched(tmp_path, setup)
    try:
        now = T0 + 1
        for _ in range(6):
            size = rng.randint(2, 12)
            claims = [(rng.choice(keys), rng.choice(owners)) for _ in range(size)]
            expected = [one.claim(k, o, now_ms=now, lease_ms=LEASE) for k, o in claims]
            assert two.claim_many(claims, now_ms=now, lease_ms=LEASE) == expected, claims
            assert table_of(two) == table_of(one)
            finishes = [(k, o, rng.random() < 0.5) for k, o in claims if rng.random() < 0.7]
            for k, o, succeeded in finishes:
                if succeeded:
                    one.complete(k, o, now_ms=now, retention_ms=RETENTION)
                else:
                    one.release(k, o)
            results = two.finish_many(finishes, now_ms=now, retention_ms=RETENTION)
            assert results == [None] * len(finishes)
            assert table_of(two) == table_of(one), finishes
            now += rng.choice([1, LEASE // 2, LEASE])
    finally:
        one.close()
        two.close()


def test_sqlite_claim_many_mixed_states_and_repeats(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        store.complete("done", "x", now_ms=T0, retention_ms=RETENTION)
        store.cancel("tomb", now_ms=T0, retention_ms=RETENTION)
        store.claim("held", "x", now_ms=T0, lease_ms=LEASE)
        store.claim("lapsed", "x", now_ms=T0 - LEASE, lease_ms=LEASE)
        store.claim("mine", "a", now_ms=T0, lease_ms=LEASE)
        items = [
            ("free", "a"),
            ("done", "a"),
            ("held", "a"),
            ("tomb", "a"),
            ("lapsed", "b"),
            ("mine", "a"),
            ("free", "b"),  # taken by the first item
            ("lapsed", "a"),  # taken by b just before
            ("held", "x"),  # the holder renews
            ("free", "a"),  # re-entrant
        ]
        results = store.claim_many(items, now_ms=T0 + 1, lease_ms=LEASE)
        assert results == [
            CLAIMED,
            DONE,
            IN_PROGRESS,
            CANCELLED,
            CLAIMED,
            CLAIMED,
            IN_PROGRESS,
            IN_PROGRESS,
            CLAIMED,
            CLAIMED,
        ]
        assert store.renew("lapsed", "b", now_ms=T0 + 2, lease_ms=LEASE) is True
        assert store.claim("held", "c", now_ms=T0 + LEASE, lease_ms=LEASE) is IN_PROGRESS


def test_sqlite_claim_many_with_no_lease_claims_item_by_item(tmp_path: Path) -> None:
    # A lease of 0 ends at once: each item, duplicate or not, finds the key free.
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        results = store.claim_many([("k", "a"), ("k", "b"), ("k", "a")], now_ms=T0, lease_ms=0)
        assert results == [CLAIMED, CLAIMED, CLAIMED]


def test_sqlite_claim_many_retries_a_row_released_before_the_read(tmp_path: Path) -> None:
    """Between the UPSERT and the read another process may release the holder's claim:
    the item is claimed again, as `claim` does."""
    path = tmp_path / "idem.sqlite3"
    with SQLiteStore(path) as store, SQLiteStore(path) as other:
        assert other.claim("held", "x", now_ms=T0, lease_ms=LEASE) is CLAIMED
        conn = store._conn
        real = store._rows_statement

        def release_first(template: str, n: int) -> str:
            sql = real(template, n)
            if sql.lstrip().startswith("SELECT"):
                other.release("held", "x")
            return sql

        store._rows_statement = release_first  # type: ignore[method-assign]
        results = store.claim_many([("free", "a"), ("held", "a")], now_ms=T0, lease_ms=LEASE)
        assert results == [CLAIMED, CLAIMED]
        assert conn.in_transaction is False
        assert other.claim("held", "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


def test_sqlite_finish_many_a_failing_item_fails_alone_among_releases(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        claims = [("k1", "a"), ("k2", "a"), ("k3", "a")]
        assert store.claim_many(claims, now_ms=T0, lease_ms=LEASE) == [CLAIMED] * 3
        poison_trigger(store, "bad")
        items = [("k1", "a", False), ("bad", "a", True), ("k2", "a", True), ("k3", "a", False)]
        finished = store.finish_many(items, now_ms=T0, retention_ms=RETENTION)
        assert [finished[0], finished[2], finished[3]] == [None, None, None]
        assert isinstance(finished[1], sqlite3.IntegrityError)
        assert store.claim("k1", "b", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert store.claim("k2", "b", now_ms=T0, lease_ms=LEASE) is DONE
        assert store.claim("k3", "b", now_ms=T0, lease_ms=LEASE) is CLAIMED


def test_sqlite_finish_many_on_a_locked_file_fails_every_item(tmp_path: Path) -> None:
    path = tmp_path / "idem.sqlite3"
    with SQLiteStore(path, busy_timeout_s=0.1) as store:
        assert store.claim_many([("k1", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE) == [
            CLAIMED,
            CLAIMED,
        ]
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            for succeeded in (True, False):
                items = [("k1", "a", succeeded), ("k2", "a", succeeded)]
                results = store.finish_many(items, now_ms=T0, retention_ms=RETENTION)
                assert all(isinstance(r, sqlite3.OperationalError) for r in results), results
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert store.claim("k1", "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


def poison_trigger(store: SQLiteStore, key: str) -> None:
    """Make every write of `key` fail, inside whatever transaction it runs in."""
    store._conn.execute(
        f"CREATE TRIGGER poison BEFORE INSERT ON {store.table} "
        f"WHEN NEW.key = '{store.prefix}{key}' BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
    )


def test_sqlite_batch_a_failing_item_fails_alone(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "idem.sqlite3") as store:
        poison_trigger(store, "bad")
        results = store.claim_many(
            [("k1", "a"), ("bad", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE
        )
        assert results[0] is CLAIMED
        assert isinstance(results[1], sqlite3.IntegrityError)
        assert results[2] is CLAIMED
        finished = store.finish_many(
            [("k1", "a", True), ("bad", "a", True)], now_ms=T0, retention_ms=RETENTION
        )
        assert finished[0] is None
        assert isinstance(finished[1], sqlite3.IntegrityError)
        assert store.claim("k1", "b", now_ms=T0, lease_ms=LEASE) is DONE
        assert store.claim("k2", "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


def test_sqlite_batch_on_a_locked_file_fails_every_item(tmp_path: Path) -> None:
    path = tmp_path / "idem.sqlite3"
    with SQLiteStore(path, busy_timeout_s=0.1) as store:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            results = store.claim_many([("k1", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert all(isinstance(r, sqlite3.OperationalError) for r in results), results
        assert store.claim_many([("k1", "a")], now_ms=T0, lease_ms=LEASE) == [CLAIMED]


async def test_async_sqlite_batch_runs_as_the_sync_stores_batch(counting: CountingStore) -> None:
    # The whole batch is one call of SQLiteStore.claim_many / finish_many (multi-row
    # statements) on the store's thread; a lone claim beside it joins a group commit.
    store = AsyncSQLiteStore(counting)
    keys = [new_key() for _ in range(30)]
    single = new_key()
    batch, alone = await asyncio.gather(
        store.claim_many([(k, "a") for k in keys], now_ms=T0, lease_ms=LEASE),
        store.claim(single, "a", now_ms=T0, lease_ms=LEASE),
    )
    assert batch == [CLAIMED] * 30
    assert alone is CLAIMED
    assert counting.batches == [1]  # the lone claim's group commit; the batch is its own
    items = [(k, "a", True) for k in keys]
    assert await store.finish_many(items, now_ms=T0, retention_ms=RETENTION) == [None] * 30
    assert await store.claim(keys[0], "b", now_ms=T0, lease_ms=LEASE) is ClaimResult.DONE
    await store.close()


async def test_async_sqlite_batch_a_failing_item_fails_alone(tmp_path: Path) -> None:
    sync_store = SQLiteStore(tmp_path / "idem.sqlite3")
    poison_trigger(sync_store, "bad")
    store = AsyncSQLiteStore(sync_store)
    results = await store.claim_many([("k1", "a"), ("bad", "a")], now_ms=T0, lease_ms=LEASE)
    assert results[0] is CLAIMED
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert await store.renew("k1", "a", now_ms=T0 + 1, lease_ms=LEASE) is True
    await store.close()


def test_a_file_made_with_the_earlier_without_rowid_table_keeps_working(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE rabbit_delay_idempotency (key TEXT PRIMARY KEY, state TEXT NOT NULL "
        "CHECK (state IN ('claimed', 'done', 'cancelled')), owner TEXT, "
        "expires_at INTEGER NOT NULL) WITHOUT ROWID"
    )
    old.execute(
        "INSERT INTO rabbit_delay_idempotency VALUES ('rabbit-delay:old', 'done', 'o', ?)",
        (T0 + RETENTION,),
    )
    old.commit()
    old.close()
    store = SQLiteStore(path)
    assert store.claim("old", "a", now_ms=T0, lease_ms=LEASE) is ClaimResult.DONE
    assert store.claim_many([("k1", "a"), ("k1", "b")], now_ms=T0, lease_ms=LEASE) == [
        ClaimResult.CLAIMED,
        ClaimResult.IN_PROGRESS,
    ]
    assert store.renew("k1", "a", now_ms=T0 + 1, lease_ms=LEASE) is True
    assert store.finish_many([("k1", "a", True)], now_ms=T0, retention_ms=RETENTION) == [None]
    assert store.claim("k1", "c", now_ms=T0 + 2, lease_ms=LEASE) is ClaimResult.DONE
    assert store.purge(now_ms=T0 + RETENTION + 10) == 2
    (sql,) = store._conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'rabbit_delay_idempotency'"
    ).fetchone()
    assert "WITHOUT ROWID" in sql  # left as it was
    store.close()


def test_a_new_file_gets_the_rowid_table(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "new.sqlite3")
    (sql,) = store._conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'rabbit_delay_idempotency'"
    ).fetchone()
    assert "WITHOUT ROWID" not in sql
    assert "UNIQUE" in sql
    store.close()


def test_sqlite_finish_and_claim_many_is_one_commit_with_the_same_results(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "idem.sqlite3")
    guard = Guard(store, lease_ms=LEASE, retention_ms=RETENTION, clock=lambda: T0)
    assert guard.claim_many([("a", "o1"), ("b", "o2")]) == [CLAIMED, CLAIMED]
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    finished, claimed = guard.finish_and_claim_many(
        [("a", "o1", True), ("b", "o2", False)], [("a", "o3"), ("b", "o4"), ("c", "o5"), ("", "o6")]
    )
    store._conn.set_trace_callback(None)
    assert finished == [None, None]
    assert claimed[:3] == [DONE, CLAIMED, CLAIMED]  # b was released, c is new
    assert isinstance(claimed[3], ValueError)  # an empty key fails in its slot only
    assert sum(s.strip().upper().startswith("COMMIT") for s in statements) == 1
    assert guard.stats.claimed == 4
    assert guard.stats.duplicates_skipped == 1
    store.close()


def test_sqlite_finish_and_claim_many_falls_back_item_by_item(tmp_path: Path) -> None:
    sync_store = SQLiteStore(tmp_path / "idem.sqlite3")
    poison_trigger(sync_store, "bad")
    guard = Guard(sync_store, lease_ms=LEASE, retention_ms=RETENTION, clock=lambda: T0)
    assert guard.claim_many([("k1", "a")]) == [CLAIMED]
    finished, claimed = guard.finish_and_claim_many(
        [("k1", "a", True)], [("k2", "b"), ("bad", "c")]
    )
    assert finished == [None]
    assert claimed[0] is CLAIMED
    assert isinstance(claimed[1], sqlite3.IntegrityError)
    assert guard.claim_many([("k1", "z")]) == [DONE]
    sync_store.close()
