"""Build a store from the topology's `[idempotency]` table."""

from __future__ import annotations

from rabbit_delay._idempotency.guard import (
    DEFAULT_PREFIX,
    AsyncIdempotencyStore,
    IdempotencyStore,
    SyncStoreAsAsync,
)
from rabbit_delay._stores.memory import MemoryStore
from rabbit_delay._stores.postgres import AsyncPostgresStore, PostgresStore
from rabbit_delay._stores.redis import AsyncRedisStore, RedisStore
from rabbit_delay._stores.sqlite import AsyncSQLiteStore, SQLiteStore
from rabbit_delay._topology.model import IdempotencyConfig


def as_async(store: IdempotencyStore) -> AsyncIdempotencyStore:
    """Wrap a fast local store (memory, SQLite) for the async worker, on the loop thread.

    A `SQLiteStore` becomes an `AsyncSQLiteStore` (group commit: the operations of one
    loop turn share a transaction); a `PostgresStore` its `AsyncPostgresStore` twin (the
    same database and table, a connection of its own); any other store is called
    directly (`SyncStoreAsAsync`). Do not wrap `RedisStore`, which would block the loop
    on the network: use `AsyncRedisStore`.
    """
    if isinstance(store, SQLiteStore):
        return AsyncSQLiteStore(store)
    if isinstance(store, PostgresStore):
        return AsyncPostgresStore.twin_of(store)
    return SyncStoreAsAsync(store)


def store_from_config(cfg: IdempotencyConfig, *, prefix: str = DEFAULT_PREFIX) -> IdempotencyStore:
    """The synchronous store `cfg` names (`cfg.path` for sqlite, `cfg.url` for redis and
    postgres; the network stores connect on first use).

    Raises ConfigError (redis-py or psycopg missing, SQLite too old, a URL libpq cannot
    parse) and the backend's errors (`sqlite3.Error` for a file that cannot be opened).
    """
    if cfg.store == "memory":
        return MemoryStore(prefix=prefix)
    if cfg.store == "redis":
        return RedisStore(cfg.url, prefix=prefix)
    if cfg.store == "postgres":
        return PostgresStore(cfg.url, prefix=prefix)
    return SQLiteStore(cfg.path, prefix=prefix)


def async_store_from_config(
    cfg: IdempotencyConfig, *, prefix: str = DEFAULT_PREFIX
) -> AsyncIdempotencyStore:
    """For the async worker: `AsyncRedisStore` for redis, `AsyncPostgresStore` for
    postgres, else the local store via `as_async`.

    Raises like `store_from_config`.
    """
    if cfg.store == "redis":
        return AsyncRedisStore(cfg.url, prefix=prefix)
    if cfg.store == "postgres":
        return AsyncPostgresStore(cfg.url, prefix=prefix)
    return as_async(store_from_config(cfg, prefix=prefix))
