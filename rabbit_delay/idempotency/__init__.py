"""Idempotency for consumers: run a handler once per message key, even on redelivery.

Before the handler runs, the worker claims the message's key (its message_id); after
success it records the key done. A duplicate of a done message is acked and skipped;
a duplicate that arrives while the first copy is being handled is not run beside it;
a claim is a lease, renewed (`renew`) while the handler runs, so a crashed worker does
not block its key for ever. `cancel(key)` leaves a tombstone: the scheduled message with
that key is dropped when it comes due. `claim_many` / `finish_many` do a prefetched
batch in one transaction or round trip.

    claim(key, owner)          -> CLAIMED      run the handler, then complete() / release()
                               -> DONE         ack, skip (a duplicate)
                               -> IN_PROGRESS  another owner holds a live lease
                               -> CANCELLED    ack, drop (a tombstone)

Stores share one protocol (`IdempotencyStore`, and `AsyncIdempotencyStore` for the
async worker): `MemoryStore`, `SQLiteStore` (the default; durable, WAL, one file
shared by processes, the inbox pattern through `mark_done_in`; `AsyncSQLiteStore`
adds group commit), `RedisStore` /
`AsyncRedisStore` (extra `redis`, imported only when one is created). `Guard` and
`AsyncGuard` bind a store to the lease, retention and clock, and count outcomes.
See docs/idempotency.md.
"""

from __future__ import annotations

from rabbit_delay.idempotency._core import (
    DEFAULT_PREFIX,
    AsyncGuard,
    AsyncIdempotencyStore,
    ClaimResult,
    Clock,
    Guard,
    GuardStats,
    IdempotencyStore,
    SyncStoreAsAsync,
)
from rabbit_delay.idempotency._factory import as_async, async_store_from_config, store_from_config
from rabbit_delay.idempotency._memory import MemoryStore
from rabbit_delay.idempotency._redis import DEFAULT_REDIS_URL, AsyncRedisStore, RedisStore
from rabbit_delay.idempotency._sqlite import DEFAULT_TABLE, AsyncSQLiteStore, SQLiteStore

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_REDIS_URL",
    "DEFAULT_TABLE",
    "AsyncGuard",
    "AsyncIdempotencyStore",
    "AsyncRedisStore",
    "AsyncSQLiteStore",
    "ClaimResult",
    "Clock",
    "Guard",
    "GuardStats",
    "IdempotencyStore",
    "MemoryStore",
    "RedisStore",
    "SQLiteStore",
    "SyncStoreAsAsync",
    "as_async",
    "async_store_from_config",
    "store_from_config",
]
