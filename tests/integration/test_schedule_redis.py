"""The schedule against a real Redis: the store contract through RedisStore and
AsyncRedisStore, then what is Redis's own (paging a large schedule, the purge and its
indexes, look-up latency, one round trip per batch, keys that look like separators).

Redis: RABBIT_DELAY_TEST_REDIS_URL if set, else redis://127.0.0.1:6379/0. Unreachable:
skipped locally, a failure when CI is set. Every test works under a unique key prefix
and deletes its keys afterwards.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from schedule_contract import (
    GRACE,
    KEEP,
    LEASE,
    RETENTION,
    T0,
    NewStore,
    ScheduleContract,
    entry,
    new_key,
)

from integration.test_idempotency_redis import CountingPipelines
from rabbit_delay._idempotency.guard import SyncStoreAsAsync
from rabbit_delay._schedule.records import (
    Finished,
    Placement,
    Query,
    Ref,
    ScheduleState,
    Update,
)
from rabbit_delay._stores.redis_schedule import PURGE_SLICE
from rabbit_delay.stores import AsyncRedisStore, ClaimResult, RedisStore

REDIS_URL_ENV = "RABBIT_DELAY_TEST_REDIS_URL"

# One xdist worker for the module (CI: --dist loadgroup): its large schedules do not
# stall the server under another of its tests' latency figures.
pytestmark = pytest.mark.xdist_group("redis-schedule")


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get(REDIS_URL_ENV, "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        reason = f"no Redis at {url} ({exc}): start one or set {REDIS_URL_ENV}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    finally:
        client.close()
    return url


def _keys(client: redis.Redis[bytes], prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*", count=10_000))


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test alone; its keys (up to a large schedule's) are deleted
    afterwards."""
    value = f"rd-test:{uuid.uuid4().hex}:"
    yield value
    client = redis.Redis.from_url(redis_url)
    try:
        keys = _keys(client, value)
        for start in range(0, len(keys), 1_000):
            client.unlink(*keys[start : start + 1_000])
    finally:
        client.close()


class TestRedisSchedule(ScheduleContract):
    shared_backend = False  # SyncStoreAsAsync runs each call inline: no race to see
    caller_clock = False

    @pytest.fixture
    def new_store(self, redis_url: str, key_prefix: str) -> Iterator[NewStore]:
        made: list[RedisStore] = []

        def make() -> Any:
            made.append(RedisStore(redis_url, prefix=key_prefix))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncRedisSchedule(ScheduleContract):
    caller_clock = False

    @pytest.fixture
    async def new_store(self, redis_url: str, key_prefix: str) -> AsyncIterator[NewStore]:
        made: list[AsyncRedisStore] = []

        def make() -> Any:
            made.append(AsyncRedisStore(redis_url, prefix=key_prefix))
            return made[-1]

        yield make
        for store in made:
            await store.close()


# -- Redis's own --------------------------------------------------------------------------


@pytest.fixture
def store(redis_url: str, key_prefix: str) -> Iterator[RedisStore]:
    made = RedisStore(redis_url, prefix=key_prefix)
    yield made
    made.close()


@pytest.fixture
def scope() -> str:
    return "rd-test-" + uuid.uuid4().hex[:8]


def place_all(store: RedisStore, entries: list[Any], *, now: int = T0, batch: int = 1_000) -> None:
    for start in range(0, len(entries), batch):
        store.schedule.place_many(entries[start : start + batch], now_ms=now)


def finish(store: RedisStore, update: Update, *, now: int = T0) -> Exception | None:
    ref = update.ref
    handled = update.finished is Finished.HANDLED
    finished, _ = store.scheduled_batch(
        [(f"q:{ref.key}", "w1", handled, update)],
        [],
        now_ms=now,
        lease_ms=LEASE,
        retention_ms=RETENTION,
    )
    return finished[0]


def schedule_keys(store: RedisStore, prefix: str) -> list[str]:
    return sorted(k.decode() for k in _keys(store.client, prefix + "sched:"))


def index_members(store: RedisStore, prefix: str) -> dict[str, list[str]]:
    """Every index under the prefix and its members."""
    client = store.client
    return {
        name: [m.decode() for m in client.zrange(name, 0, -1)]
        for name in schedule_keys(store, prefix)
        if client.type(name) == b"zset"
    }


def test_a_10000_record_listing_pages_through_every_record_once(
    store: RedisStore, scope: str
) -> None:
    rng = random.Random(21)
    # 97 due times: about a hundred records share each, so pages break inside ties
    entries = [
        entry(
            scope,
            f"key-{rng.randrange(10**9):09d}-{i}",
            due=T0 + 1_000 * rng.randrange(97),
            queue="mail" if i < 3_000 and i % 2 else "orders",
        )
        for i in range(10_000)
    ]
    place_all(store, entries)
    expected = sorted((e.due_ms, e.key) for e in entries)

    def page_through(query: Query) -> list[tuple[int, str]]:
        seen: list[tuple[int, str]] = []
        started = time.perf_counter()
        while True:
            page = store.schedule.select(query)
            seen += [(r.due_ms, r.key) for r in page]
            if len(page) < query.limit:
                break
            query = Query(query.scope, query.queue, limit=query.limit, after=seen[-1])
        took = time.perf_counter() - started
        print(f"listed {len(seen)} records, {query.limit} a page, in {took:.3f} s")
        return seen

    assert page_through(Query(scope, limit=333)) == expected
    assert page_through(Query(scope, limit=1_000)) == expected
    mail = sorted((e.due_ms, e.key) for e in entries if e.queue == "mail")
    assert page_through(Query(scope, queue="mail", limit=250)) == mail
    # a window of due times, from a cursor inside a tie
    low, high = T0 + 10_000, T0 + 20_000
    window = [x for x in expected if low <= x[0] < high]
    cursor = window[len(window) // 2]
    page = store.schedule.select(
        Query(scope, due_after_ms=low, due_before_ms=high, after=cursor, limit=1_000)
    )
    assert [(r.due_ms, r.key) for r in page] == window[len(window) // 2 + 1 :]


def test_purge_leaves_no_index_member_behind(
    store: RedisStore, scope: str, key_prefix: str
) -> None:
    other = scope + ":other"  # a scope with the key separator in it
    entries = [
        entry(s, f"p{i}", due=T0 + 100 * i, queue=("orders", "mail", "a:b")[i % 3])
        for s in (scope, other)
        for i in range(600)
    ]
    place_all(store, entries)
    # handled, parked, retried, cancelled and left scheduled, a fifth each
    for s in (scope, other):
        for i in range(600):
            ref = Ref(s, f"p{i}", 1)
            kind = i % 5
            if kind == 0:
                assert finish(store, Update(ref, Finished.HANDLED, 1_000)) is None
            elif kind == 1:
                assert finish(store, Update(ref, Finished.PARKED, 2_000, "boom")) is None
            elif kind == 2:
                retry = Update(ref, Finished.RETRY, KEEP, "again", T0 + 99_000, T0 + 159_000)
                assert finish(store, retry) is None
            elif kind == 3:
                store.schedule.cancel(s, f"p{i}", now_ms=T0, hold_ms=0)
    # the cancelled ones expire at max(due, now): the last at T0 + 59_900
    assert store.schedule.purge(now_ms=T0 + 60_000) == 2 * 3 * 120
    left = {(s, f"p{i}") for s in (scope, other) for i in range(600) if i % 5 in (2, 4)}
    for s, key in left:
        record = store.schedule.lookup(s, key)
        assert record is not None
        assert record.state is ScheduleState.SCHEDULED
    members = index_members(store, key_prefix)
    assert members  # the scheduled records' entries
    records = {k for k in schedule_keys(store, key_prefix) if ":k:" in k}
    assert len(records) == len(left)
    for name, listed in members.items():
        for member in listed:
            key = member.split("|", 1)[1] if ":due:" in name else member
            escaped = name[len(key_prefix + "sched:") :].split(":", 1)[0]
            assert f"{key_prefix}sched:{escaped}:k:{key}" in records, (name, member)
    assert key_prefix + "sched:expires" not in members
    # finish the rest: nothing at all is left under sched:
    for s, key in left:
        store.schedule.cancel(s, key, now_ms=T0, hold_ms=0)
    assert store.schedule.purge(now_ms=T0 + 200_000) == len(left)
    assert schedule_keys(store, key_prefix) == []


def test_purge_goes_in_slices(store: RedisStore, scope: str, key_prefix: str) -> None:
    n = 2 * PURGE_SLICE + 7
    place_all(store, [entry(scope, f"s{i}", due=T0) for i in range(n)])
    for i in range(n):
        store.schedule.cancel(scope, f"s{i}", now_ms=T0, hold_ms=10)
    assert store.purge(now_ms=T0 + 10) == n  # the store's purge: the schedule's too
    assert schedule_keys(store, key_prefix) == []


def test_expired_records_go_without_a_purge_call(
    store: RedisStore, scope: str, key_prefix: str
) -> None:
    place_all(store, [entry(scope, "done", due=T0), entry(scope, "late", due=T0)])
    assert finish(store, Update(Ref(scope, "done", 1), Finished.HANDLED, 1_000)) is None
    store.schedule.cancel(scope, "late", now_ms=T0, hold_ms=1_000)
    # no Redis TTL: the schedule goes by the caller's clock (here years behind the server's)
    assert store.client.pttl(key_prefix + f"sched:{scope}:k:done") == -1
    store.schedule.place_many([entry(scope, "next", due=T0 + 5_000)], now_ms=T0 + 999)
    assert store.schedule.lookup(scope, "done") is not None
    # the next write after the retention purges (a place here; any write does)
    store.schedule.place_many([entry(scope, "next", due=T0 + 5_000)], now_ms=T0 + 1_000)
    assert store.schedule.lookup(scope, "done") is None
    assert store.schedule.lookup(scope, "late") is None
    assert [r.key for r in store.schedule.select(Query(scope))] == ["next"]
    assert [k.split(":")[-1] for k in schedule_keys(store, key_prefix) if ":k:" in k] == ["next"]
    # ... and the sweeper's look at what is overdue purges too
    ref = Ref(scope, "next", 2)
    assert finish(store, Update(ref, Finished.HANDLED, 1_000), now=T0 + 2_000) is None
    assert store.schedule.overdue(scope, now_ms=T0 + 3_000, limit=10) == []
    assert schedule_keys(store, key_prefix) == []


@pytest.mark.slow
def test_lookup_p99_with_100000_records(store: RedisStore, scope: str) -> None:
    n = 100_000
    started = time.perf_counter()
    place_all(store, [entry(scope, f"order-{i:06d}", due=T0 + i) for i in range(n)])
    print(f"{n} records placed in {time.perf_counter() - started:.1f} s")
    rng = random.Random(7)
    p50s: list[float] = []
    p99s = []
    # The server is shared (other tests, other workers): the best of three rounds.
    for _ in range(3):
        timings = []
        gc.disable()
        try:
            for _ in range(1_000):
                key = f"order-{rng.randrange(n):06d}"
                t = time.perf_counter()
                record = store.schedule.lookup(scope, key)
                timings.append(time.perf_counter() - t)
                assert record is not None
                assert record.key == key
        finally:
            gc.enable()
        timings.sort()
        p50, p99 = timings[499] * 1000, timings[989] * 1000
        p99s.append(p99)
        print(
            f"lookup over 1000 of {n}: p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
            f"max {timings[-1] * 1000:.3f} ms"
        )
        p50s.append(p50)
        if p99 < 5.0:
            break
    # The target (p99 <= 5 ms) is the benchmarks' to show, on a quiet machine: a CI
    # machine runs two brokers and six test workers on two cores. Here: a look-up is one
    # read of one hash, whatever the size (p50), and no round of 1,000 waits on a scan.
    assert min(p50s) < 5.0, p50s
    assert min(p99s) < 50.0, p99s


def test_a_scheduled_batch_is_one_round_trip(store: RedisStore, scope: str) -> None:
    keys = [new_key() for _ in range(20)]
    place_all(store, [entry(scope, k) for k in keys])
    store.scheduled_batch([], [("warm", "w", None)], now_ms=T0, lease_ms=LEASE, retention_ms=1)
    counter = CountingPipelines(store.client)
    claims = [(f"q:{k}", "w1", Ref(scope, k, 1)) for k in keys]
    claims.append(("plain", "w1", None))
    _, claimed = store.scheduled_batch(
        [], claims, now_ms=T0, lease_ms=LEASE, retention_ms=RETENTION
    )
    assert claimed == [ClaimResult.CLAIMED] * 21
    finishes = [
        (f"q:{k}", "w1", True, Update(Ref(scope, k, 1), Finished.HANDLED, KEEP)) for k in keys
    ]
    finishes.append(("plain", "w1", True, None))
    finished, _ = store.scheduled_batch(
        finishes, [], now_ms=T0 + 1, lease_ms=LEASE, retention_ms=RETENTION
    )
    assert finished == [None] * 21
    assert (counter.pipelines, counter.single) == (2, 0)
    assert {r.state for r in store.schedule.select(Query(scope))} == {ScheduleState.HANDLED}


def test_a_failing_item_of_a_scheduled_batch_fails_alone(
    store: RedisStore, scope: str, key_prefix: str
) -> None:
    good, weird = new_key(), new_key()
    place_all(store, [entry(scope, good)])
    store.client.set(f"{key_prefix}sched:{scope}:k:{weird}", "not a record")
    _, claimed = store.scheduled_batch(
        [],
        [(f"q:{good}", "w1", Ref(scope, good, 1)), (f"q:{weird}", "w1", Ref(scope, weird, 1))],
        now_ms=T0,
        lease_ms=LEASE,
        retention_ms=RETENTION,
    )
    assert claimed[0] is ClaimResult.CLAIMED
    assert isinstance(claimed[1], redis.ResponseError)
    # a retry without its times is refused before the guard's record is touched
    broken = Update(Ref(scope, good, 1), Finished.RETRY, KEEP, "x", T0 + 1, None)
    finished, _ = store.scheduled_batch(
        [(f"q:{good}", "w1", True, broken)],
        [],
        now_ms=T0,
        lease_ms=LEASE,
        retention_ms=RETENTION,
    )
    assert isinstance(finished[0], redis.ResponseError)
    assert "sweep_ms" in str(finished[0])
    assert store.claim(f"q:{good}", "w2", now_ms=T0, lease_ms=LEASE) is ClaimResult.IN_PROGRESS
    # nothing half-placed: a batch with a foreign record key places none
    with pytest.raises(redis.ResponseError, match="not a schedule record"):
        store.schedule.place_many([entry(scope, "fresh"), entry(scope, weird)], now_ms=T0)
    assert store.schedule.lookup(scope, "fresh") is None


def test_a_lost_connection_fails_every_slot(key_prefix: str) -> None:
    store = RedisStore("redis://127.0.0.1:1/0", prefix=key_prefix)
    try:
        update = Update(Ref("s", "k", 1), Finished.HANDLED, KEEP)
        finished, claimed = store.scheduled_batch(
            [("k", "w1", True, update)],
            [("k", "w1", Ref("s", "k", 1)), ("j", "w1", None)],
            now_ms=T0,
            lease_ms=LEASE,
            retention_ms=RETENTION,
        )
        assert len(finished) == 1
        assert len(claimed) == 2
        assert all(isinstance(r, redis.ConnectionError) for r in [*finished, *claimed])
        with pytest.raises(redis.ConnectionError):
            store.schedule.lookup("s", "k")
    finally:
        store.close()


async def test_sync_and_async_stores_share_the_schedule(
    redis_url: str, key_prefix: str, scope: str
) -> None:
    sync_store = RedisStore(redis_url, prefix=key_prefix)
    async_store = AsyncRedisStore(redis_url, prefix=key_prefix)
    try:
        key = new_key()
        [placed] = sync_store.schedule.place_many([entry(scope, key)], now_ms=T0)
        assert placed.placement is Placement.CREATED
        [again] = await async_store.schedule.place_many([entry(scope, key)], now_ms=T0)
        assert (again.placement, again.generation) == (Placement.REPLACED, 2)
        _, claimed = await async_store.scheduled_batch(
            [], [("q", "w", Ref(scope, key, 1))], now_ms=T0, lease_ms=LEASE, retention_ms=1
        )
        assert claimed == [ClaimResult.SUPERSEDED]
        record = sync_store.schedule.lookup(scope, key)
        assert record is not None
        assert (record.generation, record.dropped) == (2, 1)
    finally:
        sync_store.close()
        await async_store.close()


def test_threads_race_to_place_one_key(redis_url: str, key_prefix: str, scope: str) -> None:
    stores = [RedisStore(redis_url, prefix=key_prefix) for _ in range(8)]
    key = new_key()
    barrier = threading.Barrier(len(stores))
    generations: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(store: RedisStore) -> None:
        try:
            barrier.wait(timeout=10)
            for _ in range(25):
                [placed] = store.schedule.place_many([entry(scope, key)], now_ms=T0)
                with lock:
                    generations.append(placed.generation)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s in stores:
        s.close()
    assert not errors, errors
    assert sorted(generations) == list(range(1, 201))


def test_separators_in_scopes_keys_and_queues_keep_records_apart(
    store: RedisStore, scope: str
) -> None:
    pairs = [
        (scope + ":k", "x"),
        (scope, "k:x"),
        (scope, "due"),
        (scope, "due:all"),
        (scope, "sweep"),
        (scope + "%3A", "k"),
        (scope + ":", "k"),
        (scope, "ключ|€"),
    ]
    for i, (s, k) in enumerate(pairs):
        store.schedule.place_many([entry(s, k, due=T0 + i, queue="q:due:all")], now_ms=T0)
    for i, (s, k) in enumerate(pairs):
        record = store.schedule.lookup(s, k)
        assert record is not None
        assert (record.scope, record.key, record.generation, record.due_ms) == (s, k, 1, T0 + i)
    listed = store.schedule.select(Query(scope, queue="q:due:all"))
    assert [r.key for r in listed] == [k for s, k in pairs if s == scope]
    assert store.schedule.count_due(scope, "q:due:all", [T0, T0 + 100]) == [5]
    assert store.schedule.count_due(scope, "q", [T0, T0 + 100]) == [0]


def test_due_times_far_from_now(store: RedisStore, scope: str) -> None:
    dues = [-5, 0, 1, T0, 253_402_300_799_999]  # before 1970 .. the end of year 9999
    for i, due in enumerate(dues):
        store.schedule.place_many([entry(scope, f"d{i}", due=due)], now_ms=T0)
    assert [r.due_ms for r in store.schedule.select(Query(scope))] == dues
    assert store.schedule.count_due(scope, None, [-(10**18), 0, 10**18]) == [1, 4]
    page = store.schedule.select(Query(scope, due_after_ms=-(10**18), due_before_ms=10**18))
    assert len(page) == len(dues)
    with pytest.raises(redis.ResponseError, match="out of range"):
        store.schedule.place_many([entry(scope, "far", due=10**16)], now_ms=T0)


def test_the_sweepers_view(store: RedisStore, scope: str) -> None:
    place_all(store, [entry(scope, f"o{i}", due=T0) for i in range(5)])
    now = T0 + GRACE
    overdue = store.schedule.overdue(scope, now_ms=now, limit=3)
    assert [r.key for r in overdue] == ["o0", "o1", "o2"]  # ties: by key
    assert all(r.payload is not None for r in overdue)
    assert store.schedule.overdue(scope, now_ms=now, limit=0) == []
    assert store.schedule.lateness(scope, since_ms=T0, sample=0) is None
