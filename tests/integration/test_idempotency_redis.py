"""The idempotency contract against a real Redis, through RedisStore and AsyncRedisStore.

Redis: RABBIT_DELAY_TEST_REDIS_URL if set, else redis://127.0.0.1:6379/0. Unreachable:
skipped locally, a failure when CI is set. Every test works under a unique key prefix
and deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio
from idempotency_contract import (
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

from rabbit_delay.idempotency import (
    AsyncGuard,
    AsyncIdempotencyStore,
    AsyncRedisStore,
    Guard,
    RedisStore,
    SyncStoreAsAsync,
)

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
        assert 0 < store.client.pttl(key_prefix + claim) <= LEASE
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
