"""The idempotency contract against a real Redis, through RedisStore and AsyncRedisStore.

Redis: RABBIT_DELAY_TEST_REDIS_URL if set, else redis://127.0.0.1:6379/0. Unreachable:
skipped locally, a failure when CI is set. Every test works under a unique key prefix
and deletes its keys afterwards.

Redis judges expiry by its own clock, so the contract's tests that make time pass with
a later `now_ms` skip here; the tests below plant records that ran out by the server's
clock instead, and one waits (with a deadline) for a short lease to run out for real.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
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

from rabbit_delay._idempotency.guard import AsyncGuard, Guard, SyncStoreAsAsync
from rabbit_delay.stores import AsyncIdempotencyStore, AsyncRedisStore, RedisStore

REDIS_URL_ENV = "RABBIT_DELAY_TEST_REDIS_URL"


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


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test alone; its keys are deleted afterwards."""
    value = f"rd-test:{uuid.uuid4().hex}:"
    yield value
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=value + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


class TestRedisStoreContract(StoreContract):
    caller_clock = False

    @pytest.fixture
    def new_store(self, redis_url: str, key_prefix: str) -> Iterator[NewStore]:
        made: list[RedisStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(RedisStore(redis_url, prefix=key_prefix + (prefix or "")))
            return SyncStoreAsAsync(made[-1])

        yield make
        for store in made:
            store.close()


class TestAsyncRedisStoreContract(StoreContract):
    caller_clock = False

    @pytest.fixture
    async def new_store(self, redis_url: str, key_prefix: str) -> AsyncIterator[NewStore]:
        made: list[AsyncRedisStore] = []

        def make(prefix: str | None = None) -> AsyncIdempotencyStore:
            made.append(AsyncRedisStore(redis_url, prefix=key_prefix + (prefix or "")))
            return made[-1]

        yield make
        for store in made:
            await store.close()


def test_threads_race_for_keys_one_wins_each(redis_url: str, key_prefix: str) -> None:
    stores = [RedisStore(redis_url, prefix=key_prefix) for _ in range(8)]
    keys = [new_key() for _ in range(100)]
    barrier = threading.Barrier(len(stores))
    winners: dict[str, list[int]] = {k: [] for k in keys}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(index: int, store: RedisStore) -> None:
        try:
            barrier.wait(timeout=10)
            for key in keys:
                if store.claim(key, f"t{index}", now_ms=T0, lease_ms=LEASE) is CLAIMED:
                    with lock:
                        winners[key].append(index)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s in stores:
        s.close()
    assert not errors, errors
    assert all(len(w) == 1 for w in winners.values()), winners


async def test_sync_and_async_stores_share_records(redis_url: str, key_prefix: str) -> None:
    sync_store = RedisStore(redis_url, prefix=key_prefix)
    async_store = AsyncRedisStore(redis_url, prefix=key_prefix)
    try:
        key = new_key()
        assert sync_store.claim(key, "sync", now_ms=T0, lease_ms=LEASE) is CLAIMED
        assert await async_store.claim(key, "async", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
        sync_store.complete(key, "sync", now_ms=T0, retention_ms=RETENTION)
        assert await async_store.claim(key, "async", now_ms=T0, lease_ms=LEASE) is DONE
    finally:
        sync_store.close()
        await async_store.close()


def test_records_carry_a_redis_ttl(redis_url: str, key_prefix: str) -> None:
    store = RedisStore(redis_url, prefix=key_prefix)
    try:
        claim, done, tomb = new_key(), new_key(), new_key()
        store.claim(claim, "a", now_ms=T0, lease_ms=LEASE)
        store.complete(done, "a", now_ms=T0, retention_ms=RETENTION)
        store.cancel(tomb, now_ms=T0, retention_ms=RETENTION)
        # A claim's key outlives its lease (a late renew still finds it); the lease
        # itself ends after LEASE, inside the record.
        assert LEASE < store.client.pttl(key_prefix + claim) <= 2 * LEASE
        assert LEASE < store.client.pttl(key_prefix + done) <= RETENTION
        assert LEASE < store.client.pttl(key_prefix + tomb) <= RETENTION
        assert not store.needs_purge
    finally:
        store.close()


def test_a_foreign_value_under_the_prefix_is_an_error(redis_url: str, key_prefix: str) -> None:
    store = RedisStore(redis_url, prefix=key_prefix)
    try:
        store.client.set(key_prefix + "weird", "not a record")
        with pytest.raises(redis.ResponseError, match="not an idempotency record"):
            store.claim("weird", "a", now_ms=T0, lease_ms=LEASE)
    finally:
        store.close()


def test_a_shared_client_is_left_open(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        store = RedisStore(prefix=key_prefix, client=client)
        assert store.claim(new_key(), "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
        store.close()
        assert client.ping()
    finally:
        client.close()


def test_guard_over_redis(redis_url: str, key_prefix: str) -> None:
    store = RedisStore(redis_url, prefix=key_prefix)
    guard = Guard(store, lease_ms=LEASE, retention_ms=RETENTION)
    try:
        key = new_key()
        assert guard.claim(key, "a") is CLAIMED
        guard.done(key, "a")
        assert guard.claim(key, "b") is DONE
        assert guard.stats.duplicates_skipped == 1
    finally:
        store.close()


async def test_async_guard_over_redis_many_deliveries(redis_url: str, key_prefix: str) -> None:
    store = AsyncRedisStore(redis_url, prefix=key_prefix)
    guard = AsyncGuard(store, lease_ms=LEASE, retention_ms=RETENTION)
    try:
        keys = [new_key() for _ in range(20)]

        async def deliver(key: str, owner: str) -> bool:
            if await guard.claim(key, owner) is not CLAIMED:
                return False
            await guard.done(key, owner)
            return True

        # Every message delivered three times at once: each runs once.
        ran = await asyncio.gather(*(deliver(k, f"{k}-{i}") for k in keys for i in range(3)))
        assert sum(ran) == len(keys)
        assert guard.stats.claimed == len(keys)
    finally:
        await store.close()


# -- the server's clock ------------------------------------------------------------------

FAR_FUTURE = T0 + 1_000 * 86_400_000 * 365  # a thousand years on
FAR_PAST = 0


def server_ms(client: redis.Redis[bytes]) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def plant(client: redis.Redis[bytes], name: str, kind: str, expires_at: int, owner: str) -> None:
    """A record as the scripts write it, with a long Redis TTL: only the expiry inside
    the value says whether it is live."""
    client.set(name, f"{kind}|{expires_at}|{owner}", px=10 * RETENTION)


@pytest.fixture
def store(redis_url: str, key_prefix: str) -> Iterator[RedisStore]:
    made = RedisStore(redis_url, prefix=key_prefix)
    yield made
    made.close()


@pytest.mark.parametrize("caller_now", [FAR_PAST, T0, FAR_FUTURE])
def test_the_callers_clock_changes_no_decision(store: RedisStore, caller_now: int) -> None:
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
    assert store.purge(now_ms=FAR_FUTURE) == 0  # nothing ran out by the server's clock


def test_records_hold_the_servers_expiry(store: RedisStore, key_prefix: str) -> None:
    key = new_key()
    before = server_ms(store.client)
    store.claim(key, "a", now_ms=FAR_PAST, lease_ms=LEASE)
    after = server_ms(store.client)
    value = store.client.get(key_prefix + key)
    assert value is not None
    kind, expires_at, owner = value.decode().split("|", 2)
    assert (kind, owner) == ("c", "a")
    assert before + LEASE <= int(expires_at) <= after + LEASE


def test_a_lease_run_out_by_the_servers_clock(store: RedisStore, key_prefix: str) -> None:
    lapsed, taken = new_key(), new_key()
    past = server_ms(store.client) - 1
    plant(store.client, key_prefix + lapsed, "c", past, "a")
    plant(store.client, key_prefix + taken, "c", past, "a")
    # Nobody took `lapsed` over: its owner may still renew it, whatever now_ms says.
    assert store.renew(lapsed, "a", now_ms=FAR_PAST, lease_ms=LEASE) is True
    assert store.claim(lapsed, "b", now_ms=FAR_FUTURE, lease_ms=LEASE) is IN_PROGRESS
    # `taken` is free to another owner even with a caller clock in the past...
    assert store.claim(taken, "b", now_ms=FAR_PAST, lease_ms=LEASE) is CLAIMED
    # ...and then lost to its first owner.
    assert store.renew(taken, "a", now_ms=FAR_PAST, lease_ms=LEASE) is False
    assert store.claim(taken, "a", now_ms=FAR_PAST, lease_ms=LEASE) is IN_PROGRESS


def test_done_records_and_tombstones_run_out_by_the_servers_clock(
    store: RedisStore, key_prefix: str
) -> None:
    done, tomb, live_tomb = new_key(), new_key(), new_key()
    now = server_ms(store.client)
    plant(store.client, key_prefix + done, "d", now - 1, "a")
    plant(store.client, key_prefix + tomb, "x", now - 1, "")
    plant(store.client, key_prefix + live_tomb, "x", now + 10 * RETENTION, "")
    assert store.claim(done, "b", now_ms=FAR_PAST, lease_ms=LEASE) is CLAIMED
    assert store.claim(tomb, "b", now_ms=FAR_PAST, lease_ms=LEASE) is CLAIMED
    # A shorter cancel leaves the longer tombstone as it is.
    store.cancel(live_tomb, now_ms=FAR_FUTURE, retention_ms=RETENTION)
    assert store.client.get(key_prefix + live_tomb) == f"x|{now + 10 * RETENTION}|".encode()


def test_purge_goes_by_the_servers_clock(store: RedisStore, key_prefix: str) -> None:
    lapsed, live = new_key(), new_key()
    plant(store.client, key_prefix + lapsed, "c", server_ms(store.client) - 1, "a")
    assert store.claim(live, "a", now_ms=T0, lease_ms=LEASE) is CLAIMED
    assert store.purge(now_ms=FAR_PAST) == 1
    assert store.claim(live, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS


def test_old_records_written_by_the_callers_clock_still_read(
    store: RedisStore, key_prefix: str
) -> None:
    key = new_key()
    plant(store.client, key_prefix + key, "d", server_ms(store.client) + RETENTION, "old|owner")
    assert store.claim(key, "b", now_ms=T0, lease_ms=LEASE) is DONE


def test_a_short_lease_runs_out_for_real(store: RedisStore) -> None:
    key = new_key()
    assert store.claim(key, "a", now_ms=T0, lease_ms=200) is CLAIMED
    deadline = time.monotonic() + 10
    while store.claim(key, "b", now_ms=T0, lease_ms=LEASE) is not CLAIMED:
        assert time.monotonic() < deadline, "the 200 ms lease never ran out"
        time.sleep(0.05)
    assert store.renew(key, "a", now_ms=T0, lease_ms=LEASE) is False


# -- batches: one round trip, errors in their slots, NOSCRIPT -----------------------------


class CountingPipelines:
    """Counts the round trips of a client: commands sent alone and pipelines executed."""

    def __init__(self, client: Any) -> None:
        self.single = 0
        self.pipelines = 0
        original_execute_command = client.execute_command
        original_pipeline = client.pipeline

        def execute_command(*args: Any, **kwargs: Any) -> Any:
            self.single += 1
            return original_execute_command(*args, **kwargs)

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = original_pipeline(*args, **kwargs)
            original_execute = pipe.execute

            def execute(*a: Any, **kw: Any) -> Any:
                self.pipelines += 1
                return original_execute(*a, **kw)

            pipe.execute = execute
            pipe.immediate_execute_command = _counting(self, pipe.immediate_execute_command)
            return pipe

        client.execute_command = execute_command
        client.pipeline = pipeline


def _counting(counter: CountingPipelines, call: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        counter.single += 1
        return call(*args, **kwargs)

    return wrapped


def test_a_batch_is_one_round_trip(store: RedisStore) -> None:
    store.claim_many([(new_key(), "warm")], now_ms=T0, lease_ms=LEASE)  # loads the scripts
    counter = CountingPipelines(store.client)
    keys = [new_key() for _ in range(50)]
    assert store.claim_many([(k, "a") for k in keys], now_ms=T0, lease_ms=LEASE) == [CLAIMED] * 50
    items = [(k, "a", True) for k in keys]
    assert store.finish_many(items, now_ms=T0, retention_ms=RETENTION) == [None] * 50
    assert (counter.pipelines, counter.single) == (2, 0)


def test_a_failing_item_fails_alone(store: RedisStore, key_prefix: str) -> None:
    good, weird = new_key(), new_key()
    store.client.set(key_prefix + weird, "not a record")
    results = store.claim_many([(good, "a"), (weird, "a")], now_ms=T0, lease_ms=LEASE)
    assert results[0] is CLAIMED
    assert isinstance(results[1], redis.ResponseError)
    assert "not an idempotency record" in str(results[1])
    store.client.lpush(key_prefix + "a-list", "x")  # WRONGTYPE for GET
    finished = store.finish_many(
        [(good, "a", True), ("a-list", "a", True)], now_ms=T0, retention_ms=RETENTION
    )
    assert finished[0] is None
    assert isinstance(finished[1], redis.ResponseError)
    assert store.claim(good, "b", now_ms=T0, lease_ms=LEASE) is DONE


def test_a_lost_connection_fails_every_item(key_prefix: str) -> None:
    store = RedisStore("redis://127.0.0.1:1/0", prefix=key_prefix)  # nothing listens there
    try:
        results = store.claim_many([("k1", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE)
        assert all(isinstance(r, redis.ConnectionError) for r in results), results
        finished = store.finish_many([("k1", "a", True)], now_ms=T0, retention_ms=RETENTION)
        assert isinstance(finished[0], redis.ConnectionError)
    finally:
        store.close()


def _fresh_script(store: RedisStore | AsyncRedisStore) -> None:
    """Swap the claim script for a variant the server has never seen (a unique comment),
    as after SCRIPT FLUSH or a failover, without flushing the shared server."""
    text = f"-- {uuid.uuid4().hex}\n" + store._claim.script
    store._claim = store.client.register_script(text)  # type: ignore[assignment]
    store._scripts = (store._claim, *store._scripts[1:])


def test_noscript_loads_the_scripts_and_sends_those_items_again(store: RedisStore) -> None:
    store.finish_many([(new_key(), "warm", False)], now_ms=T0, retention_ms=RETENTION)
    assert store._scripts_loaded
    _fresh_script(store)
    key, other = new_key(), new_key()
    # Both claims meet NOSCRIPT (nothing ran), then run after the scripts are loaded.
    assert store.claim_many([(key, "a"), (other, "a")], now_ms=T0, lease_ms=LEASE) == [
        CLAIMED,
        CLAIMED,
    ]
    assert store.claim(key, "b", now_ms=T0, lease_ms=LEASE) is IN_PROGRESS
    assert store.client.script_exists(store._claim.sha) == [True]


async def test_async_noscript_and_errors_in_their_slots(redis_url: str, key_prefix: str) -> None:
    store = AsyncRedisStore(redis_url, prefix=key_prefix)
    try:
        await store.finish_many([(new_key(), "warm", False)], now_ms=T0, retention_ms=RETENTION)
        _fresh_script(store)
        key, weird = new_key(), new_key()
        await store.client.set(key_prefix + weird, "not a record")
        results = await store.claim_many([(key, "a"), (weird, "a")], now_ms=T0, lease_ms=LEASE)
        assert results[0] is CLAIMED
        assert isinstance(results[1], redis.ResponseError)
        assert await store.claim(key, "b", now_ms=FAR_FUTURE, lease_ms=LEASE) is IN_PROGRESS
        assert await store.renew(key, "a", now_ms=FAR_PAST, lease_ms=LEASE) is True
    finally:
        await store.close()


async def test_async_lost_connection_fails_every_item(key_prefix: str) -> None:
    store = AsyncRedisStore("redis://127.0.0.1:1/0", prefix=key_prefix)
    try:
        results = await store.claim_many([("k1", "a"), ("k2", "a")], now_ms=T0, lease_ms=LEASE)
        assert all(isinstance(r, redis.ConnectionError) for r in results), results
    finally:
        await store.close()


def test_guard_batches_over_redis(store: RedisStore) -> None:
    guard = Guard(store, lease_ms=LEASE, retention_ms=RETENTION)
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
