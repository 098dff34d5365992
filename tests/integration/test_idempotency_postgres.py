"""The idempotency contract against a real PostgreSQL, through PostgresStore and
AsyncPostgresStore, on the caller's clock and on the server's; processes racing for
keys; and both workers guarded by PostgreSQL on a real broker.

PostgreSQL: $RABBIT_DELAY_TEST_POSTGRES_URL, else postgresql://postgres@127.0.0.1:5432/test;
unreachable, these tests skip locally and FAIL under CI=1. Each test has a table (or a
schema) of its own, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest
from conftest import wait_for
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

from rabbit_delay import App, ConfigError, HandlerContext, Topology
from rabbit_delay._idempotency.guard import AsyncGuard, Guard, SyncStoreAsAsync
from rabbit_delay._stores import postgres as pg
from rabbit_delay._stores.factory import as_async
from rabbit_delay.stores import AsyncIdempotencyStore, AsyncPostgresStore, PostgresStore

from .workers.harness import KINDS, RunningWorker

pytestmark = [pytest.mark.integration]

PG_URL_ENV = "RABBIT_DELAY_TEST_POSTGRES_URL"
PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = os.environ.get(PG_URL_ENV, PG_DEFAULT_URL)
    try:
        psycopg.connect(url, connect_timeout=3).close()
    except Exception as exc:
        reason = f"no PostgreSQL at {url} ({type(exc).__name__}: {exc}); set {PG_URL_ENV}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return url


def sql(url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """One statement on a connection of its own (autocommit); its rows."""
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


@pytest.fixture
def table(pg_url: str) -> Iterator[str]:
    """A table name of this test alone, dropped afterwards with the schedule's table
    the store makes beside it."""
    name = "rd_test_" + uuid.uuid4().hex[:12]
    yield name
    sql(pg_url, f"DROP TABLE IF EXISTS {name}_schedule, {name}")


# -- the contract: sync and async, caller's clock and server's -----------------------------


class TestPostgresStoreContract(StoreContract):
    @pytest.fixture
    def new_store(self, pg_url: str, table: str) -> Iterator[NewStore]:
        made: list[PostgresStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(
                PostgresStore(pg_url, table=table, prefix=prefix or "t:", server_clock=False)
            )
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncPostgresStoreContract(StoreContract):
    @pytest.fixture
    async def new_store(self, pg_url: str, table: str) -> AsyncIterator[NewStore]:
        made: list[AsyncPostgresStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(
                AsyncPostgresStore(pg_url, table=table, prefix=prefix or "t:", server_clock=False)
            )
            return made[-1]

        yield make
        for store in made:
            await store.close()


class TestPostgresStoreServerClockContract(StoreContract):
    caller_clock = False

    @pytest.fixture
    def new_store(self, pg_url: str, table: str) -> Iterator[NewStore]:
        made: list[PostgresStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(PostgresStore(pg_url, table=table, prefix=prefix or "t:"))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncPostgresStoreServerClockContract(StoreContract):
    caller_clock = False

    @pytest.fixture
    async def new_store(self, pg_url: str, table: str) -> AsyncIterator[NewStore]:
        made: list[AsyncPostgresStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(AsyncPostgresStore(pg_url, table=table, prefix=prefix or "t:"))
            return made[-1]

        yield make
        for store in made:
            await store.close()


@pytest.fixture
def store(pg_url: str, table: str) -> Iterator[PostgresStore]:
    """A store on the caller's clock."""
    made = PostgresStore(pg_url, table=table, server_clock=False)
    yield made
    made.close()


def rows(url: str, table: str) -> list[tuple[Any, ...]]:
    return sql(url, f"SELECT key, state, owner, expires_at FROM {table} ORDER BY key")


# -- processes and threads ------------------------------------------------------------------

_CLAIMER = textwrap.dedent(
    """
    import random, sys
    from rabbit_delay.stores import PostgresStore

    url, table, count, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    keys = [f"key-{i}" for i in range(count)]
    rng.shuffle(keys)  # each process in its own order: batches lock rows in key order
    owner = f"process-{seed}"
    store = PostgresStore(url, table=table)
    sys.stdin.readline()  # every process connects and creates the table at once, then claims
    won = []
    i = 0
    while i < len(keys):
        if rng.random() < 0.3:
            if store.claim(keys[i], owner, now_ms=0, lease_ms=600_000).value == "claimed":
                won.append(keys[i])
            i += 1
            continue
        batch = keys[i : i + rng.randint(2, 40)]
        results = store.claim_many([(k, owner) for k in batch], now_ms=0, lease_ms=600_000)
        for key, result in zip(batch, results):
            if isinstance(result, Exception):
                raise result
            if result.value == "claimed":
                won.append(key)
        i += len(batch)
    store.close()
    print(" ".join(won))
    """
)


def test_processes_claim_each_key_exactly_once(pg_url: str, table: str) -> None:
    """Four processes, each its own connection, create the table at once and race for
    the same 600 keys in their own orders, by single claims and batches: every key is
    claimed by exactly one of them, and no batch deadlocks or fails."""
    count = 600
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, pg_url, table, str(count), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(4)
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
    assert sorted(won) == sorted(f"key-{i}" for i in range(count))
    # What the table says agrees: one claim per key, by the process that won it.
    assert len(rows(pg_url, table)) == count


def test_threads_sharing_one_store_one_wins_each(store: PostgresStore) -> None:
    keys = [new_key() for _ in range(100)]
    winners: dict[str, list[int]] = {k: [] for k in keys}
    lock = threading.Lock()
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=10)
            for key in keys:
                if store.claim(key, f"t{index}", now_ms=T0, lease_ms=LEASE) is CLAIMED:
                    with lock:
                        winners[key].append(index)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(len(w) == 1 for w in winners.values()), winners


async def test_sync_and_async_stores_share_records(pg_url: str, table: str) -> None:
    sync_store = PostgresStore(pg_url, table=table)
    async_store = as_async(sync_store)
    assert isinstance(async_store, AsyncPostgresStore)
    try:
        key = new_key()
        assert sync_store.claim(key, "sync", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await async_store.claim(key, "async", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
        sync_store.complete(key, "sync", now_ms=T0, retention_ms=RETENTION)
        assert await async_store.claim(key, "async", now_ms=T0, lease_ms=LEASE) is DONE
    finally:
        sync_store.close()
        await async_store.close()


# -- the schema ------------------------------------------------------------------------------


def test_the_table_is_created_on_first_use(pg_url: str, table: str) -> None:
    store = PostgresStore(pg_url, table=table)
    try:
        assert sql(pg_url, "SELECT to_regclass(%s)", (table,)) == [(None,)]  # lazy
        store.claim("k", "a", now_ms=T0, lease_ms=LEASE)
        columns = sql(
            pg_url,
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = %s ORDER BY ordinal_position",
            (table,),
        )
        assert columns == [
            ("key", "text"),
            ("state", "text"),
            ("owner", "text"),
            ("expires_at", "bigint"),
        ]
        indexes = sql(pg_url, "SELECT indexname FROM pg_indexes WHERE tablename = %s", (table,))
        assert indexes == [(f"{table}_pkey",)]  # the key alone: purge needs no index
        assert store.needs_purge
    finally:
        store.close()


def test_an_invalid_table_name_or_url_is_a_config_error(pg_url: str) -> None:
    with pytest.raises(ConfigError, match="invalid PostgreSQL table name"):
        PostgresStore(pg_url, table="x; DROP TABLE y")
    with pytest.raises(ConfigError, match="invalid PostgreSQL URL") as info:
        PostgresStore("postgresql://u:hunter2@db/x?nosuchoption=1")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="timeout"):
        AsyncPostgresStore(pg_url, timeout_s=0)


def test_a_schema_of_its_own_through_the_url(pg_url: str) -> None:
    """search_path in the URL's options puts the table in another schema."""
    schema = "rd_test_" + uuid.uuid4().hex[:12]
    sql(pg_url, f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in pg_url else "?"
    try:
        store = PostgresStore(f"{pg_url}{sep}options=-csearch_path%3D{schema}")
        assert store.claim("k", "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        store.close()
        tables = sql(pg_url, "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))
        # with the schedule's, created beside it (issue 21)
        assert sorted(tables) == [
            ("rabbit_delay_idempotency",),
            ("rabbit_delay_idempotency_schedule",),
        ]
    finally:
        sql(pg_url, f"DROP SCHEMA {schema} CASCADE")


# -- batches -----------------------------------------------------------------------------------


class Counting:
    """Counts the round trips of a store: statements sent alone and pipelines."""

    def __init__(self, store: PostgresStore) -> None:
        self.single = 0
        self.pipelines = 0
        original = store._send

        def send(conn: Any, request: Any, rowcount: bool) -> Any:
            if len(request.statements) == 1:
                self.single += 1
            else:
                self.pipelines += 1
            return original(conn, request, rowcount)

        store._send = send  # type: ignore[method-assign]


def test_a_batch_is_one_statement(store: PostgresStore) -> None:
    store.claim("warm", "a", now_ms=T0, lease_ms=LEASE)
    counter = Counting(store)
    keys = [new_key() for _ in range(50)]
    assert store.claim_many([(k, "a") for k in keys], now_ms=T0, lease_ms=LEASE) == [CLAIMED] * 50
    items = [(k, "a", i % 3 != 0) for i, k in enumerate(keys)]
    assert store.finish_many(items, now_ms=T0, retention_ms=RETENTION) == [None] * 50
    assert (counter.single, counter.pipelines) == (2, 0)
    # A key twice in a batch: a statement per repeat, pipelined (one round trip).
    again = store.claim_many(
        [(keys[1], "b"), (keys[0], "b"), (keys[0], "c")], now_ms=T0, lease_ms=LEASE
    )
    assert again == [DONE, CLAIMED, IN_PROGRESS]
    assert (counter.single, counter.pipelines) == (2, 1)


def test_finish_and_claim_many_is_one_round_trip(store: PostgresStore, pg_url: str) -> None:
    done, failed = new_key(), new_key()
    store.claim_many([(done, "a"), (failed, "a")], now_ms=T0, lease_ms=LEASE)
    counter = Counting(store)
    fresh = new_key()
    finished, claimed = store.finish_and_claim_many(
        [(done, "a", True), (failed, "a", False)],
        [(fresh, "b"), (done, "b"), (failed, "b")],
        now_ms=T0,
        lease_ms=LEASE,
        retention_ms=RETENTION,
    )
    assert finished == [None, None]
    assert claimed == [CLAIMED, DONE, CLAIMED]
    assert (counter.single, counter.pipelines) == (0, 1)


@pytest.mark.parametrize("seed", range(6))
def test_batches_match_the_single_operations(pg_url: str, seed: int) -> None:
    """Random batches over a few keys in every state, with repeats: the same results and
    rows as the single operations one after the other (two tables)."""
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(8)]
    owners = ["a", "b", "c"]
    one_table, two_table = (f"rd_test_{uuid.uuid4().hex[:12]}" for _ in range(2))
    one = PostgresStore(pg_url, table=one_table, server_clock=False)
    two = PostgresStore(pg_url, table=two_table, server_clock=False)
    try:
        for store in (one, two):
            for i, key in enumerate(keys):
                kind = i % 5
                if kind == 0:
                    store.claim(key, "a", now_ms=T0, lease_ms=LEASE)
                elif kind == 1:
                    store.claim(key, "x", now_ms=T0 - 2 * LEASE, lease_ms=LEASE)
                elif kind == 2:
                    store.complete(key, "x", now_ms=T0, retention_ms=RETENTION)
                elif kind == 3:
                    store.cancel(key, now_ms=T0, retention_ms=RETENTION)
        now = T0 + 1
        for _ in range(6):
            claims = [(rng.choice(keys), rng.choice(owners)) for _ in range(rng.randint(2, 12))]
            expected = [one.claim(k, o, now_ms=now, lease_ms=LEASE) for k, o in claims]
            assert two.claim_many(claims, now_ms=now, lease_ms=LEASE) == expected, claims
            assert rows(pg_url, two_table) == rows(pg_url, one_table)
            finishes = [(k, o, rng.random() < 0.5) for k, o in claims if rng.random() < 0.7]
            for k, o, succeeded in finishes:
                if succeeded:
                    one.complete(k, o, now_ms=now, retention_ms=RETENTION)
                else:
                    one.release(k, o)
            results = two.finish_many(finishes, now_ms=now, retention_ms=RETENTION)
            assert results == [None] * len(finishes)
            assert rows(pg_url, two_table) == rows(pg_url, one_table), finishes
            now += rng.choice([1, LEASE // 2, LEASE])
    finally:
        one.close()
        two.close()
        tables = (one_table, two_table)
        sql(pg_url, "DROP TABLE IF EXISTS " + ", ".join(f"{t}_schedule, {t}" for t in tables))


def test_a_failing_item_fails_alone(store: PostgresStore) -> None:
    good, other = new_key(), new_key()
    too_long = os.urandom(6_000).hex()  # past the key index's row size limit
    results = store.claim_many(
        [(good, "a"), ("nul\x00key", "a"), (too_long, "a"), (7, "a"), (other, "a")],  # type: ignore[list-item]
        now_ms=T0,
        lease_ms=LEASE,
    )
    assert results[0] is CLAIMED
    assert isinstance(results[1], psycopg.DataError)
    assert isinstance(results[2], psycopg.errors.ProgramLimitExceeded)
    assert isinstance(results[3], TypeError)
    assert results[4] is CLAIMED
    finished = store.finish_many(
        [(good, "a", True), (too_long, "a", True), (other, "a", False)],
        now_ms=T0,
        retention_ms=RETENTION,
    )
    assert finished[0] is None
    assert isinstance(finished[1], psycopg.Error)
    assert finished[2] is None
    assert store.claim(good, "b", now_ms=T0, lease_ms=LEASE) is DONE
    assert store.claim(other, "b", now_ms=T0, lease_ms=LEASE) is CLAIMED
    # ...and in the combined batch, each kind then runs on its own.
    finished, claimed = store.finish_and_claim_many(
        [(other, "b", True)],
        [(too_long, "b"), (new_key(), "b")],
        now_ms=T0,
        lease_ms=LEASE,
        retention_ms=RETENTION,
    )
    assert finished == [None]
    assert isinstance(claimed[0], psycopg.Error)
    assert claimed[1] is CLAIMED


def test_an_unreachable_server_fails_every_item_and_each_call() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/test", timeout_s=2)
    try:
        results = store.claim_many([("k1", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE)
        assert all(isinstance(r, psycopg.OperationalError) for r in results), results
        finished = store.finish_many([("k1", "a", True)], now_ms=T0, retention_ms=RETENTION)
        assert isinstance(finished[0], psycopg.OperationalError)
        both = store.finish_and_claim_many(
            [("k1", "a", True)], [("k2", "a")], now_ms=T0, lease_ms=LEASE, retention_ms=RETENTION
        )
        assert isinstance(both[0][0], psycopg.OperationalError)
        assert isinstance(both[1][0], psycopg.OperationalError)
        with pytest.raises(psycopg.OperationalError):
            store.claim("k1", "a", now_ms=T0, lease_ms=LEASE)
    finally:
        store.close()


async def test_async_unreachable_server_fails_every_item() -> None:
    store = AsyncPostgresStore("postgresql://postgres@127.0.0.1:1/test", timeout_s=2)
    try:
        results = await store.claim_many([("k1", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE)
        assert all(isinstance(r, psycopg.OperationalError) for r in results), results
        with pytest.raises(psycopg.OperationalError):
            await store.renew("k1", "a", now_ms=T0, lease_ms=LEASE)
    finally:
        await store.close()


# -- connections -------------------------------------------------------------------------------


def terminate(url: str, pid: int) -> None:
    sql(url, "SELECT pg_terminate_backend(%s)", (pid,))


def test_a_connection_the_server_dropped_is_opened_again(store: PostgresStore, pg_url: str) -> None:
    key = new_key()
    assert store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
    assert store._conn is not None
    terminate(pg_url, store._conn.info.backend_pid)
    # The claim that finds the connection broken is sent again on a new one.
    assert store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
    assert store._conn is not None
    terminate(pg_url, store._conn.info.backend_pid)
    assert store.claim_many([(key, "b"), (new_key(), "b")], now_ms=T0, lease_ms=LEASE) == [
        IN_PROGRESS,
        CLAIMED,
    ]


async def test_async_connection_the_server_dropped_is_opened_again(pg_url: str, table: str) -> None:
    store = AsyncPostgresStore(pg_url, table=table)
    try:
        key = new_key()
        assert await store.claim(key, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert store._conn is not None
        terminate(pg_url, store._conn.info.backend_pid)
        assert await store.renew(key, "a", now_ms=T0, lease_ms=LEASE) is True
    finally:
        await store.close()


def test_a_closed_store_refuses_operations(store: PostgresStore) -> None:
    store.claim("k", "a", now_ms=T0, lease_ms=LEASE)
    store.close()
    with pytest.raises(psycopg.OperationalError, match="closed"):
        store.claim("k", "a", now_ms=T0, lease_ms=LEASE)
    assert all(
        isinstance(r, psycopg.OperationalError)
        for r in store.claim_many([("k", "a")], now_ms=T0, lease_ms=LEASE)
    )


def test_a_row_locked_past_the_timeout_fails_the_statement(pg_url: str, table: str) -> None:
    """A handler's own transaction holding the row: the claim gives up after timeout_s."""
    store = PostgresStore(pg_url, table=table, timeout_s=1)
    try:
        key = new_key()
        store.claim(key, "a", now_ms=T0, lease_ms=LEASE)
        with psycopg.connect(pg_url) as holder:
            holder.execute(
                f"SELECT 1 FROM {table} WHERE key = %s FOR UPDATE", (store.prefix + key,)
            )
            started = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled):
                store.claim(key, "b", now_ms=T0, lease_ms=LEASE)
            assert 0.9 < time.monotonic() - started < 5
            holder.rollback()
        assert store.claim(key, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
    finally:
        store.close()


# -- purge -------------------------------------------------------------------------------------


def test_purge_walks_the_table_in_slices_of_pages(
    store: PostgresStore, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "_PURGE_PAGES", 2)
    keys = [f"k{i:05d}" for i in range(3_000)]
    store.claim_many([(k, "a") for k in keys], now_ms=T0, lease_ms=LEASE)
    live = keys[::3]
    store.finish_many([(k, "a", True) for k in live], now_ms=T0, retention_ms=RETENTION)
    counter = Counting(store)
    assert store.purge(now_ms=T0 + LEASE) == len(keys) - len(live)
    assert counter.single > 10  # many slices
    assert {r[0] for r in rows(pg_url, store.table)} == {store.prefix + k for k in live}
    assert store.purge(now_ms=T0 + LEASE) == 0


# -- the server's clock ------------------------------------------------------------------------

FAR_FUTURE = T0 + 1_000 * 86_400_000 * 365
FAR_PAST = 0


def server_ms(url: str) -> int:
    return int(sql(url, "SELECT " + pg._SERVER_NOW)[0][0])


@pytest.fixture
def server_store(pg_url: str, table: str) -> Iterator[PostgresStore]:
    made = PostgresStore(pg_url, table=table)
    yield made
    made.close()


@pytest.mark.parametrize("caller_now", [FAR_PAST, T0, FAR_FUTURE])
def test_the_callers_clock_changes_no_decision(
    server_store: PostgresStore, caller_now: int
) -> None:
    store = server_store
    claim, done, tomb = new_key(), new_key(), new_key()
    assert store.claim(claim, "a", now_ms=caller_now, lease_ms=LEASE) is CLAIMED
    store.complete(done, "a", now_ms=caller_now, retention_ms=RETENTION)
    store.cancel(tomb, now_ms=caller_now, retention_ms=RETENTION)
    for now in (FAR_PAST, T0, FAR_FUTURE):
        assert store.claim(claim, "b", now_ms=now, lease_ms=LEASE) is IN_PROGRESS
        assert store.claim(done, "b", now_ms=now, lease_ms=LEASE) is DONE
        assert store.claim(tomb, "b", now_ms=now, lease_ms=LEASE) is CANCELLED
        assert store.renew(claim, "a", now_ms=now, lease_ms=LEASE) is True
        assert store.renew(claim, "b", now_ms=now, lease_ms=LEASE) is False
    assert store.claim_many([(claim, "b")], now_ms=FAR_FUTURE, lease_ms=LEASE) == [IN_PROGRESS]
    assert store.purge(now_ms=FAR_FUTURE) == 0


def test_records_hold_the_servers_expiry(server_store: PostgresStore, pg_url: str) -> None:
    key = new_key()
    before = server_ms(pg_url)
    server_store.claim(key, "a", now_ms=FAR_PAST, lease_ms=LEASE)
    after = server_ms(pg_url)
    [(_, state, owner, expires_at)] = rows(pg_url, server_store.table)
    assert (state, owner) == ("claimed", "a")
    assert before + LEASE <= expires_at <= after + LEASE


def test_expiry_and_purge_go_by_the_servers_clock(server_store: PostgresStore, pg_url: str) -> None:
    store = server_store
    lapsed, taken, done, live = new_key(), new_key(), new_key(), new_key()
    for key in (lapsed, taken, done):
        store.claim(key, "a", now_ms=T0, lease_ms=LEASE)
    store.complete(done, "a", now_ms=T0, retention_ms=RETENTION)
    store.claim(live, "a", now_ms=T0, lease_ms=LEASE)
    past = server_ms(pg_url) - 1
    sql(
        pg_url,
        f"UPDATE {store.table} SET expires_at = %s WHERE key = ANY(%s)",
        (past, [store.prefix + k for k in (lapsed, taken, done)]),
    )
    # Nobody took `lapsed` over: its owner may still renew it, whatever now_ms says.
    assert store.renew(lapsed, "a", now_ms=FAR_PAST, lease_ms=LEASE) is True
    assert store.claim(lapsed, "b", now_ms=FAR_FUTURE, lease_ms=LEASE) is IN_PROGRESS
    # `taken` is free to another owner even with a caller clock in the past...
    assert store.claim(taken, "b", now_ms=FAR_PAST, lease_ms=LEASE) is CLAIMED
    assert store.renew(taken, "a", now_ms=FAR_PAST, lease_ms=LEASE) is False
    # ...and a done-record past its retention is gone for purge, whatever now_ms says.
    assert store.purge(now_ms=FAR_PAST) == 1
    assert store.claim(done, "b", now_ms=FAR_PAST, lease_ms=LEASE) is CLAIMED
    assert store.claim(live, "b", now_ms=FAR_FUTURE, lease_ms=LEASE) is IN_PROGRESS


def test_a_short_lease_runs_out_for_real(server_store: PostgresStore) -> None:
    key = new_key()
    assert server_store.claim(key, "a", now_ms=T0, lease_ms=200) is CLAIMED
    deadline = time.monotonic() + 10
    while server_store.claim(key, "b", now_ms=T0, lease_ms=LEASE) is not CLAIMED:
        assert time.monotonic() < deadline, "the 200 ms lease never ran out"
        time.sleep(0.05)
    assert server_store.renew(key, "a", now_ms=T0, lease_ms=LEASE) is False


# -- the guards --------------------------------------------------------------------------------


def test_guard_batches_over_postgres(server_store: PostgresStore) -> None:
    guard = Guard(server_store, lease_ms=LEASE, retention_ms=RETENTION)
    k1, k2 = new_key(), new_key()
    results = guard.claim_many([(k1, "a"), ("", "a"), (k2, "a")])
    assert results[0] is CLAIMED
    assert results[2] is CLAIMED
    assert isinstance(results[1], ValueError)
    assert guard.renew(k1, "a") is True
    assert guard.finish_many([(k1, "a", True), (k2, "a", False)]) == [None, None]
    assert guard.claim_many([(k1, "b"), (k2, "b")]) == [DONE, CLAIMED]
    assert guard.stats.claimed == 3
    assert guard.stats.duplicates_skipped == 1


async def test_async_guard_over_postgres_many_deliveries(pg_url: str, table: str) -> None:
    store = AsyncPostgresStore(pg_url, table=table)
    guard = AsyncGuard(store, lease_ms=LEASE, retention_ms=RETENTION)
    try:
        keys = [new_key() for _ in range(20)]

        async def deliver(key: str, owner: str) -> bool:
            if await guard.claim(key, owner) is not CLAIMED:
                return False
            await guard.done(key, owner)
            return True

        ran = await asyncio.gather(*(deliver(k, f"{k}-{i}") for k in keys for i in range(3)))
        assert sum(ran) == len(keys)
        assert guard.stats.claimed == len(keys)
    finally:
        await store.close()


# -- both workers, guarded by PostgreSQL, on a real broker --------------------------------------

QUEUE = "orders.cancel"


@pytest.fixture
def pg_schema_url(pg_url: str) -> Iterator[str]:
    """The database URL with a search_path of a schema of this test alone (dropped
    afterwards): the workers' default table is created there."""
    schema = "rd_test_" + uuid.uuid4().hex[:12]
    sql(pg_url, f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in pg_url else "?"
    yield f"{pg_url}{sep}options=-csearch_path%3D{schema}"
    sql(pg_url, f"DROP SCHEMA {schema} CASCADE")


def test_both_workers_share_one_database_and_run_each_message_once(
    make_topology: Callable[..., Topology], broker_url: str, pg_schema_url: str
) -> None:
    """A sync and an async worker (two stores, two connections) consume one queue with
    the guard of `[idempotency] store = "postgres"`; every message is published twice
    with the same message_id: each runs its handler once, the copies are skipped."""
    topology = make_topology(idempotency={"store": "postgres", "url": pg_schema_url})
    from rabbit_delay.sync import Publisher, connect, declare

    conn = connect(broker_url, name="rd-test declare")
    declare(conn, topology)
    conn.close()
    seen: list[str] = []
    lock = threading.Lock()

    def handle(message: dict[str, Any], ctx: HandlerContext) -> None:
        with lock:
            seen.append(ctx.message_id)
        time.sleep(0.01)

    apps = []
    workers = []
    for kind in KINDS:
        app = App(topology)
        app.add_consumer(QUEUE, handle)
        apps.append(app)
        workers.append(RunningWorker(kind, app, broker_url, close_app=True, prefetch=20).start())
    assert isinstance(apps[0].store(), PostgresStore)
    assert isinstance(apps[1].async_store(), AsyncPostgresStore)
    count = 60
    ids = [f"order-{i}-{uuid.uuid4().hex[:6]}" for i in range(count)]
    try:
        with Publisher(topology, broker_url) as publisher:
            for message_id in ids + ids:  # every message twice
                publisher.publish_delayed({"n": 1}, "1s", queue=QUEUE, message_id=message_id)

        def all_settled() -> bool:
            skipped = sum(w.stats.duplicate for w in workers)
            with lock:
                return len(seen) >= count and len(seen) + skipped >= 2 * count

        wait_for(all_settled, 60, "every copy handled or skipped")
    finally:
        for worker in workers:
            worker.stop()
    assert sorted(seen) == sorted(ids)  # each message once, across both workers
    assert sum(w.stats.duplicate for w in workers) == count
    # The records are in the test's schema, done.
    states = sql(pg_schema_url, "SELECT state, count(*) FROM rabbit_delay_idempotency GROUP BY 1")
    assert states == [("done", count)]
