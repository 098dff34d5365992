"""Idempotency stores: where a worker's guard records which messages were handled.

    from rabbit_delay import App
    from rabbit_delay.stores import RedisStore

    app = App("topology/orders.toml", store=RedisStore("redis://127.0.0.1:6379/0"))

By default an app builds its store from the topology's `[idempotency]` table (SQLite,
next to the topology file). Every store implements the `IdempotencyStore` protocol
(`AsyncIdempotencyStore` for the async worker); `ClaimResult` is what a claim answers.
`RedisStore` and `AsyncRedisStore` need the `redis` extra, `PostgresStore` and
`AsyncPostgresStore` the `postgres` extra (psycopg 3), each imported only when a store
is created. `Guard` / `AsyncGuard` bind a store to a lease and a retention: what a worker
claims and records through, and what an application's own consumer may use (the inbox
pattern). See docs/idempotency.md.
"""

from rabbit_delay._idempotency.guard import (
    AsyncGuard,
    AsyncIdempotencyStore,
    ClaimResult,
    Guard,
    IdempotencyStore,
)
from rabbit_delay._stores.memory import MemoryStore
from rabbit_delay._stores.postgres import AsyncPostgresStore, PostgresStore
from rabbit_delay._stores.redis import AsyncRedisStore, RedisStore
from rabbit_delay._stores.sqlite import AsyncSQLiteStore, SQLiteStore

__all__ = [
    "AsyncGuard",
    "AsyncIdempotencyStore",
    "AsyncPostgresStore",
    "AsyncRedisStore",
    "AsyncSQLiteStore",
    "ClaimResult",
    "Guard",
    "IdempotencyStore",
    "MemoryStore",
    "PostgresStore",
    "RedisStore",
    "SQLiteStore",
]
