"""The schedule on PostgreSQL: its store contract through PostgresStore (sync, called
through SyncStoreAsAsync) and AsyncPostgresStore, on the guard's caller's clock and on
the server's (the schedule always goes by the caller's); the table, its collation, the
round trips of `scheduled_batch`, failing items, reconnects, purge; processes racing to
publish the same keys; and the measurement's smoke run (benchmarks/bench_schedule_store.py
with 20,000 records, on PostgreSQL and on SQLite).

PostgreSQL: $RABBIT_DELAY_TEST_POSTGRES_URL, else postgresql://postgres@127.0.0.1:5432/test;
unreachable, these tests skip locally and FAIL under CI=1. Each test has a schema of its
own (the stores' default tables are made there), dropped afterwards.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq
from schedule_contract import KEEP, LEASE, RETENTION, T0, NewStore, ScheduleContract, entry

from rabbit_delay import ConfigError
from rabbit_delay._idempotency.guard import SyncStoreAsAsync
from rabbit_delay._schedule.records import Finished, Query, Ref, ScheduleState, Update
from rabbit_delay._stores import postgres as pg
from rabbit_delay.stores import AsyncPostgresStore, ClaimResult, MemoryStore, PostgresStore

pytestmark = [pytest.mark.integration]

PG_URL_ENV = "RABBIT_DELAY_TEST_POSTGRES_URL"
PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_schedule_store.py"
SCOPE = "rd-test"
TABLE = "rabbit_delay_idempotency"


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
def schema(pg_url: str) -> Iterator[str]:
    """A schema of this test alone, dropped afterwards with all it holds."""
    name = "rd_test_" + uuid.uuid4().hex[:12]
    sql(pg_url, f"CREATE SCHEMA {name}")
    yield name
    sql(pg_url, f"DROP SCHEMA {name} CASCADE")


@pytest.fixture
def url(pg_url: str, schema: str) -> str:
    """The database URL with the test's schema as search_path: the stores' tables go there."""
    sep = "&" if "?" in pg_url else "?"
    return f"{pg_url}{sep}options=-csearch_path%3D{schema}"


# -- the contract: sync and async, the guard on the caller's clock and on the server's ------


class TestPostgresSchedule(ScheduleContract):
    @pytest.fixture
    def new_store(self, url: str) -> Iterator[NewStore]:
        made: list[PostgresStore] = []

        def make() -> Any:
            made.append(PostgresStore(url, server_clock=False))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncPostgresSchedule(ScheduleContract):
    @pytest.fixture
    async def new_store(self, url: str) -> AsyncIterator[NewStore]:
        made: list[AsyncPostgresStore] = []

        def make() -> Any:
            made.append(AsyncPostgresStore(url, server_clock=False))
            return made[-1]

        yield make
        for store in made:
            await store.close()


class TestPostgresScheduleServerClock(ScheduleContract):
    @pytest.fixture
    def new_store(self, url: str) -> Iterator[NewStore]:
        made: list[PostgresStore] = []

        def make() -> Any:
            made.append(PostgresStore(url))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncPostgresScheduleServerClock(ScheduleContract):
    @pytest.fixture
    async def new_store(self, url: str) -> AsyncIterator[NewStore]:
        made: list[AsyncPostgresStore] = []

        def make() -> Any:
            made.append(AsyncPostgresStore(url))
            return made[-1]

        yield make
        for store in made:
            await store.close()


def place(store: PostgresStore, *keys: str, now: int = T0) -> None:
    store.schedule.place_many([entry(SCOPE, k) for k in keys], now_ms=now)


def batch(store: PostgresStore, finishes: list[Any], claims: list[Any], now: int = T0) -> Any:
    return store.scheduled_batch(
        finishes, claims, now_ms=now, lease_ms=LEASE, retention_ms=RETENTION
    )


@pytest.fixture
def store(url: str) -> Iterator[PostgresStore]:
    """A store on the caller's clock."""
    made = PostgresStore(url, server_clock=False)
    yield made
    made.close()


# -- the table ------------------------------------------------------------------------------


def test_the_schedule_table_is_created_on_first_use(url: str, schema: str) -> None:
    store = PostgresStore(url)
    try:
        tables = "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1"
        assert sql(url, tables, (schema,)) == []  # lazy
        assert store.schedule.lookup(SCOPE, "k") is None
        assert sql(url, tables, (schema,)) == [(TABLE,), (f"{TABLE}_schedule",)]
        indexes = sql(
            url,
            "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = %s",
            (schema, f"{TABLE}_schedule"),
        )
        suffixes = {name.removeprefix(f"{TABLE}_schedule_") for (name,) in indexes}
        assert suffixes == {"pkey", "due", "queue", "sweep", "expires", "owner"}
        collations = sql(
            url,
            "SELECT column_name, collation_name FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s AND column_name IN ('scope', 'key') "
            "ORDER BY 1",
            (schema, f"{TABLE}_schedule"),
        )
        assert collations == [("key", "C"), ("scope", "C")]
        assert store.needs_purge
    finally:
        store.close()


def test_a_database_with_the_idempotency_table_only_gets_the_schedule_table(url: str) -> None:
    """A database an earlier version set up: the schedule's table is added beside it."""
    with psycopg.connect(url, autocommit=True) as conn:
        for ddl in pg.IDEMPOTENCY.create(TABLE):
            conn.execute(ddl)
    store = PostgresStore(url)
    try:
        assert store.claim("k", "a", now_ms=T0, lease_ms=LEASE) is ClaimResult.CLAIMED
        place(store, "k")
        assert store.schedule.lookup(SCOPE, "k") is not None
    finally:
        store.close()


def test_a_table_name_too_long_for_the_schedule_s_is_a_config_error(pg_url: str) -> None:
    longest = "t" * pg._MAX_TABLE_NAME
    assert len(f"{longest}_schedule_expires") == 63  # PostgreSQL's longest name
    PostgresStore(pg_url, table=longest).close()
    with pytest.raises(ConfigError, match="too long"):
        PostgresStore(pg_url, table=longest + "t")


async def test_pages_come_in_the_memory_store_s_order(url: str) -> None:
    """Keys compare byte by byte (COLLATE "C"), as Python's str and SQLite do, whatever
    the database's collation: the pages and their cursors agree with the memory store."""
    keys = ["b", "B", "a", "é", "Z", "a-1", "a_1", "ä", "A", "ab", "a b", "0"]
    entries = [entry(SCOPE, k, due=T0 + 1_000 * (i % 2)) for i, k in enumerate(keys)]
    stores: list[Any] = [AsyncPostgresStore(url), SyncStoreAsAsync(MemoryStore())]
    try:
        pages: list[list[str]] = []
        for s in stores:
            await s.schedule.place_many(entries, now_ms=T0)
            seen: list[str] = []
            after = None
            while page := await s.schedule.select(Query(SCOPE, after=after, limit=5)):
                seen.extend(r.key for r in page)
                after = (page[-1].due_ms, page[-1].key)
            pages.append(seen)
        assert pages[0] == pages[1]
        assert sorted(pages[0]) == sorted(keys)
    finally:
        for s in stores:
            await s.close()


# -- scheduled_batch ------------------------------------------------------------------------


class Trips:
    """The round trips and transactions of a connection, from libpq's trace of what it
    sends and receives: a round trip is the client's messages then the server's answer;
    a transaction (the pipeline's implicit one) ends at each ReadyForQuery."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._file = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by stop())
        conn.pgconn.trace(self._file.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        self.lines: list[str] = []

    def stop(self) -> Trips:
        self._conn.pgconn.untrace()
        self._file.seek(0)
        self.lines = [line.split("\t") for line in self._file.read().splitlines()]  # type: ignore[misc]
        self._file.close()
        return self

    def count(self, direction: str, *messages: str) -> int:
        return sum(1 for line in self.lines if line[0] == direction and line[2] in messages)

    @property
    def round_trips(self) -> int:
        """The times the server answered what the client sent (the server sends only
        at a Sync or Flush: psycopg ends a pipeline with both, in one flight)."""
        return sum(
            1
            for before, line in itertools.pairwise(self.lines)
            if (before[0], line[0]) == ("F", "B")
        )

    @property
    def transactions(self) -> int:
        return self.count("B", "ReadyForQuery")

    @property
    def statements(self) -> str:
        return " ".join(line[3] for line in self.lines if line[0] == "F" and line[2] == "Parse")


def test_scheduled_batch_is_one_transaction_in_two_round_trips_or_one(
    store: PostgresStore,
) -> None:
    place(store, "a", "b", "c")
    place(store, "c")  # generation 2: a copy of 1 is superseded
    assert store._conn is not None
    trips = Trips(store._conn)
    finished, claimed = batch(
        store,
        [],
        [
            ("q:a:1", "w1", Ref(SCOPE, "a", 1)),
            ("q:c:1", "w1", Ref(SCOPE, "c", 1)),
            ("plain", "w1", None),
        ],
    )
    trips.stop()
    assert (finished, claimed) == (
        [],
        [ClaimResult.CLAIMED, ClaimResult.SUPERSEDED, ClaimResult.CLAIMED],
    )
    # the check's rows end the first round trip; the claims and the commit are the second
    assert (trips.round_trips, trips.transactions) == (2, 1)
    assert "BEGIN" not in trips.statements
    assert store.schedule.lookup(SCOPE, "c").dropped == 1  # type: ignore[union-attr]

    # Finishes with their updates, claims without a ref: nothing to read, one round trip.
    trips = Trips(store._conn)
    finished, claimed = batch(
        store,
        [
            ("q:a:1", "w1", True, Update(Ref(SCOPE, "a", 1), Finished.HANDLED, KEEP)),
            ("plain", "w1", False, None),
        ],
        [("other", "w2", None), ("plain", "w2", None)],
        now=T0 + 5,
    )
    trips.stop()
    assert (finished, claimed) == ([None, None], [ClaimResult.CLAIMED, ClaimResult.CLAIMED])
    assert (trips.round_trips, trips.transactions) == (1, 1)
    record = store.schedule.lookup(SCOPE, "a")
    assert record is not None
    assert (record.state, record.updated_ms) == (ScheduleState.HANDLED, T0 + 5)

    # Both at once: still two.
    trips = Trips(store._conn)
    finished, claimed = batch(
        store,
        [("q:b:1", "w1", False, None)],
        [("q:a:1", "w3", Ref(SCOPE, "a", 1)), ("q:b:1", "w3", Ref(SCOPE, "b", 1))],
        now=T0 + 6,
    )
    trips.stop()
    assert (finished, claimed) == ([None], [ClaimResult.DONE, ClaimResult.CLAIMED])
    assert (trips.round_trips, trips.transactions) == (2, 1)


async def test_async_scheduled_batch_round_trips(url: str) -> None:
    store = AsyncPostgresStore(url, server_clock=False)
    try:
        await store.schedule.place_many([entry(SCOPE, "a"), entry(SCOPE, "a")], now_ms=T0)
        assert store._conn is not None
        trips = Trips(store._conn)
        finished, claimed = await store.scheduled_batch(
            [("x", "w1", True, Update(Ref(SCOPE, "a", 2), Finished.PARKED, KEEP, "E: boom"))],
            [("q:a:1", "w1", Ref(SCOPE, "a", 1)), ("q:a:2", "w1", Ref(SCOPE, "a", 2))],
            now_ms=T0,
            lease_ms=LEASE,
            retention_ms=RETENTION,
        )
        trips.stop()
        assert (finished, claimed) == ([None], [ClaimResult.SUPERSEDED, ClaimResult.CLAIMED])
        assert (trips.round_trips, trips.transactions) == (2, 1)
        record = await store.schedule.lookup(SCOPE, "a")
        assert record is not None
        assert (record.state, record.attempts, record.dropped) == (ScheduleState.PARKED, 1, 1)
    finally:
        await store.close()


def test_a_failing_item_fails_alone_and_nothing_counts_twice(store: PostgresStore) -> None:
    place(store, "a", "b")
    place(store, "a")
    too_long = os.urandom(6_000).hex()  # past the key index's row size limit
    finished, claimed = batch(
        store,
        [(too_long, "w1", True, None), ("q:b:0", "w1", True, None)],
        [
            ("q:a:1", "w1", Ref(SCOPE, "a", 1)),
            (too_long, "w1", None),
            ("q:b:1", "w1", Ref(SCOPE, "b", 1)),
            (42, "w1", None),
        ],
    )
    assert isinstance(finished[0], psycopg.Error)
    assert finished[1] is None
    assert claimed[0] is ClaimResult.SUPERSEDED
    assert isinstance(claimed[1], psycopg.Error)
    assert claimed[2] is ClaimResult.CLAIMED
    assert isinstance(claimed[3], TypeError)
    # The whole batch was rolled back before each item ran alone: one drop counted.
    assert store.schedule.lookup(SCOPE, "a").dropped == 1  # type: ignore[union-attr]
    assert store.claim("q:b:1", "w2", now_ms=T0, lease_ms=LEASE) is ClaimResult.IN_PROGRESS


def test_a_closed_store_fails_every_item(store: PostgresStore) -> None:
    place(store, "a")
    store.close()
    finished, claimed = batch(store, [("x", "w", True, None)], [("y", "w", Ref(SCOPE, "a", 1))])
    assert all(isinstance(r, psycopg.OperationalError) for r in finished + claimed)
    with pytest.raises(psycopg.OperationalError, match="closed"):
        store.schedule.lookup(SCOPE, "a")


def terminate(url: str, store: Any) -> None:
    assert store._conn is not None
    sql(url, "SELECT pg_terminate_backend(%s)", (store._conn.info.backend_pid,))


def test_a_connection_the_server_dropped_is_opened_again(store: PostgresStore, url: str) -> None:
    place(store, "a")
    terminate(url, store)
    assert store.schedule.lookup(SCOPE, "a") is not None  # a read: sent again
    terminate(url, store)
    place(store, "a")  # a write that failed before its COMMIT: sent again
    assert store.schedule.lookup(SCOPE, "a").generation == 2  # type: ignore[union-attr]
    terminate(url, store)
    # A batch that reads the schedule failed in its first round trip: sent again.
    _, claimed = batch(store, [], [("q:a:2", "w1", Ref(SCOPE, "a", 2))])
    assert claimed == [ClaimResult.CLAIMED]
    terminate(url, store)
    # One that writes only what may be written twice: sent again.
    finished, _ = batch(
        store, [("q:a:2", "w1", True, Update(Ref(SCOPE, "a", 2), Finished.HANDLED, KEEP))], []
    )
    assert finished == [None]
    assert store.schedule.lookup(SCOPE, "a").state is ScheduleState.HANDLED  # type: ignore[union-attr]


def lose_the_connection_after(
    monkeypatch: pytest.MonkeyPatch, store: PostgresStore, name: str
) -> list[int]:
    """Make `store.<name>` (a sender) lose its connection once, right after it sent its
    transaction in full, COMMIT or Sync included: what the server did is unknown. The
    list counts the sendings."""
    sent: list[int] = []
    real = getattr(store, name)

    def send(*args: Any) -> Any:
        result = real(*args)
        sent.append(1)
        if len(sent) == 1:
            store._conn.close()  # type: ignore[union-attr]
            raise psycopg.OperationalError("the connection was lost")
        return result

    monkeypatch.setattr(store, name, send)
    return sent


def test_a_transaction_that_may_have_committed_is_sent_again_only_if_that_is_harmless(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection breaking once the COMMIT (or the pipeline's Sync) may have reached
    the server leaves it unknown whether it was written: a batch that counts something
    (a retry's failure, a dropped copy) and a schedule write are not sent again; their
    items fail (they were written once, never twice). Another is sent again."""
    place(store, "a", "b")
    retry = Update(Ref(SCOPE, "a", 1), Finished.RETRY, KEEP, "E: x", T0 + 90_000, T0 + 150_000)
    sent = lose_the_connection_after(monkeypatch, store, "_send_scheduled")
    finished, _ = batch(store, [("q:a:1", "w1", False, retry)], [])
    assert isinstance(finished[0], psycopg.OperationalError)
    assert len(sent) == 1
    assert store.schedule.lookup(SCOPE, "a").attempts == 1  # type: ignore[union-attr]

    monkeypatch.undo()
    handled = Update(Ref(SCOPE, "b", 1), Finished.HANDLED, KEEP)
    sent = lose_the_connection_after(monkeypatch, store, "_send_scheduled")
    finished, claimed = batch(store, [("q:b:1", "w1", True, handled)], [("q:c", "w1", None)])
    assert (finished, claimed) == ([None], [ClaimResult.CLAIMED])
    assert len(sent) == 2
    assert store.schedule.lookup(SCOPE, "b").state is ScheduleState.HANDLED  # type: ignore[union-attr]

    monkeypatch.undo()
    sent = lose_the_connection_after(monkeypatch, store, "_send_program")
    with pytest.raises(psycopg.OperationalError):
        place(store, "a")
    assert len(sent) == 1
    assert store.schedule.lookup(SCOPE, "a").generation == 2  # type: ignore[union-attr]


async def test_async_connection_the_server_dropped_is_opened_again(url: str) -> None:
    store = AsyncPostgresStore(url, server_clock=False)
    try:
        await store.schedule.place_many([entry(SCOPE, "a")], now_ms=T0)
        terminate(url, store)
        found, record = await store.schedule.cancel(SCOPE, "a", now_ms=T0, hold_ms=KEEP)
        assert found is ScheduleState.SCHEDULED
        assert record is not None
        assert record.state is ScheduleState.CANCELLED
        terminate(url, store)
        _, claimed = await store.scheduled_batch(
            [], [("q:a:1", "w", Ref(SCOPE, "a", 1))], now_ms=T0, lease_ms=LEASE, retention_ms=1
        )
        assert claimed == [ClaimResult.CANCELLED]
    finally:
        await store.close()


# -- purge ----------------------------------------------------------------------------------


def test_purge_deletes_expired_schedule_records_in_slices(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "_SCHEDULE_PURGE_ROWS", 3)
    keys = [f"p{i}" for i in range(10)]
    place(store, *keys)
    handled = keys[:7]
    batch(store, [], [(f"q:{k}", "w", Ref(SCOPE, k, 1)) for k in handled])
    batch(
        store,
        [(f"q:{k}", "w", True, Update(Ref(SCOPE, k, 1), Finished.HANDLED, 1_000)) for k in handled],
        [],
    )
    assert store._conn is not None
    trips = Trips(store._conn)
    # the schedule's records by the caller's clock; the done-records live on
    assert store.purge(now_ms=T0 + 1_000) == 7
    trips.stop()
    assert trips.count("F", "Parse") >= 4  # the pages of the idempotency table, 3 slices
    assert [k for k in keys if store.schedule.lookup(SCOPE, k) is not None] == keys[7:]
    assert store.claim(f"q:{keys[0]}", "w2", now_ms=T0 + 1_000, lease_ms=LEASE) is (
        ClaimResult.DONE
    )


def test_the_schedule_goes_by_the_callers_clock_on_a_server_clock_store(url: str) -> None:
    store = PostgresStore(url)  # the guard's records by the server's clock
    try:
        place(store, "k")
        batch(store, [], [("q:k", "w", Ref(SCOPE, "k", 1))])
        update = Update(Ref(SCOPE, "k", 1), Finished.HANDLED, 1_000)
        batch(store, [("q:k", "w", True, update)], [], now=T0 + 7)
        record = store.schedule.lookup(SCOPE, "k")
        assert record is not None
        assert (record.created_ms, record.updated_ms, record.expires_ms) == (T0, T0 + 7, T0 + 1_007)
        assert store.purge(now_ms=T0 + 1_007) == 1  # the schedule's record, by now_ms
        assert store.schedule.lookup(SCOPE, "k") is None
        # the done-record expires by the server's clock, RETENTION from now
        assert store.claim("q:k", "w2", now_ms=T0 + 10**12, lease_ms=LEASE) is ClaimResult.DONE
    finally:
        store.close()


# -- concurrency ----------------------------------------------------------------------------

_PLACER = textwrap.dedent(
    """
    import json, random, sys, uuid
    from rabbit_delay._schedule.records import Entry, OnConflict, Payload
    from rabbit_delay.stores import PostgresStore

    url, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    keys = [f"key-{i}" for i in range(count)]
    rng.shuffle(keys)  # each process in its own order, in batches of its own sizes
    store = PostgresStore(url)
    sys.stdin.readline()  # every process creates the tables at once, then places
    payload = Payload(b"{}", "application/json")
    placed = {}
    i = 0
    while i < len(keys):
        chunk = keys[i : i + rng.randint(1, 9)]
        entries = [
            Entry("scope", k, "orders", 5_000, uuid.uuid4().hex, payload, OnConflict.REPLACE, 9_000)
            for k in chunk
        ]
        for key, answer in zip(chunk, store.schedule.place_many(entries, now_ms=1_000)):
            placed[key] = answer.generation
        i += len(chunk)
    store.close()
    print(json.dumps(placed))
    """
)


def test_processes_publishing_the_same_keys_get_distinct_generations(url: str) -> None:
    """Four processes, each its own connection, create the tables at once and publish
    the same 50 new keys, in their own orders and batches: every key gets generations
    1, 2, 3 and 4, each exactly once, and no transaction deadlocks or fails."""
    count, processes = 50, 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PLACER, url, str(count), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(processes)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    generations: dict[str, list[int]] = {f"key-{i}": [] for i in range(count)}
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        for key, generation in json.loads(out).items():
            generations[key].append(generation)
    assert all(sorted(g) == [1, 2, 3, 4] for g in generations.values()), generations
    store = PostgresStore(url)
    try:
        for key in generations:
            record = store.schedule.lookup("scope", key)
            assert record is not None
            assert (record.generation, record.replaced) == (4, 3)
    finally:
        store.close()


def test_batches_of_the_same_keys_in_opposite_orders_do_not_deadlock(url: str) -> None:
    """The keys of a place_many are locked in key order, whatever the entries' order."""
    keys = [f"k{i:02d}" for i in range(40)]
    rounds = 5
    stores = [PostgresStore(url, timeout_s=30) for _ in range(2)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(store: PostgresStore, order: list[str]) -> None:
        try:
            barrier.wait(timeout=10)
            for _ in range(rounds):
                store.schedule.place_many([entry(SCOPE, k) for k in order], now_ms=T0)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(stores[0], keys)),
        threading.Thread(target=run, args=(stores[1], keys[::-1])),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        generations = {stores[0].schedule.lookup(SCOPE, k).generation for k in keys}  # type: ignore[union-attr]
        assert generations == {2 * rounds}
    finally:
        for store in stores:
            store.close()


# -- the measurement, CI-sized ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_the_measurement_runs_with_20000_records(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """benchmarks/bench_schedule_store.py, CI-sized: only that every figure is there and
    sane (the figures themselves are the benchmark's business)."""
    args = [sys.executable, str(BENCH), "--store", kind, "--records", "20000"]
    args += ["--lookups", "300", "--pages", "50", "--out", str(tmp_path / "result.json")]
    if kind == "postgres":
        args += ["--url", request.getfixturevalue("url")]
    else:
        args += ["--dir", str(tmp_path)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["store"] == kind
    assert result["records"] == 20_000
    assert 100 < result["bytes_per_record"] < 10_000
    for name in ("lookup", "page", "overdue_empty"):
        figures = result[name]
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"] < 5_000, name
    assert result["lookup"]["found"] == result["lookup"]["n"] == 300
    assert result["page"]["rows"] == 100
    assert result["overdue_empty"]["rows"] == 0
    if kind == "postgres":  # the bench dropped its tables
        assert sql(
            request.getfixturevalue("url"),
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'rd_bench_%%'",
        ) == [(0,)]
