"""Redis store (optional extra `redis`): shared by every worker that reaches the server.

Each operation is one Lua script, so a read-decide-write is atomic on the server and
costs one round trip. Records are strings `<kind>|<expires_at_ms>|<owner>` (kind `c`
claim, `d` done, `x` tombstone): the expiry inside the value follows the caller's
clock, like the other stores, and the key also carries a Redis TTL of the same length
so the server drops it on its own (no purge needed).

`redis` is imported when a store is created, so this module loads without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rabbit_delay.errors import ConfigError
from rabbit_delay.idempotency._core import DEFAULT_PREFIX, ClaimResult

if TYPE_CHECKING:
    import redis
    import redis.asyncio

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# KEYS[1]; ARGV: owner, now, claim value, lease ms. Returns an index into _RESULTS.
_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v then
  local kind, exp, holder = string.match(v, '^(%a)|(%-?%d+)|(.*)$')
  if not kind then
    return redis.error_reply('rabbit-delay: not an idempotency record: ' .. KEYS[1])
  end
  if tonumber(exp) > tonumber(ARGV[2]) then
    if kind == 'd' then return 1 end
    if kind == 'x' then return 3 end
    if holder ~= ARGV[1] then return 2 end
  end
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
return 0
"""
_RESULTS = (
    ClaimResult.CLAIMED,
    ClaimResult.DONE,
    ClaimResult.IN_PROGRESS,
    ClaimResult.CANCELLED,
)

# KEYS[1]; ARGV: now, done value, retention ms. A live done-record or tombstone stays.
_COMPLETE = """
local v = redis.call('GET', KEYS[1])
if v then
  local kind, exp = string.match(v, '^(%a)|(%-?%d+)|')
  if kind and kind ~= 'c' and tonumber(exp) > tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS[1]; ARGV: owner. Only the claim's holder may drop it.
_RELEASE = """
local v = redis.call('GET', KEYS[1])
if v then
  local kind, holder = string.match(v, '^(%a)|%-?%d+|(.*)$')
  if kind == 'c' and holder == ARGV[1] then return redis.call('DEL', KEYS[1]) end
end
return 0
"""

# KEYS[1]; ARGV: tombstone end, tombstone value, retention ms. Never shortens a tombstone.
_CANCEL = """
local v = redis.call('GET', KEYS[1])
if v then
  local kind, exp = string.match(v, '^(%a)|(%-?%d+)|')
  if kind == 'x' and tonumber(exp) >= tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS: a SCAN batch; ARGV: now. Deletes records expired by the caller's clock (the
# server's TTL deletes them anyway: this is for `purge()` callers and clocks that run
# ahead). pcall: a key of another type under the prefix is skipped, not an error.
_PURGE = """
local n = 0
for _, k in ipairs(KEYS) do
  local v = redis.pcall('GET', k)
  if type(v) == 'string' then
    local exp = string.match(v, '^%a|(%-?%d+)|')
    if exp and tonumber(exp) <= tonumber(ARGV[1]) then n = n + redis.call('DEL', k) end
  end
end
return n
"""
_SCAN_COUNT = 1_000


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _ttl(ms: int) -> int:
    # PX must be positive; a record that is already due lives 1 ms.
    return max(1, ms)


def _import_redis() -> Any:
    try:
        import redis
        import redis.asyncio
    except ImportError:
        raise ConfigError(
            "the redis idempotency store needs the redis extra: pip install 'rabbit-delay[redis]'"
        ) from None
    return redis


class _RedisBase:
    needs_purge = False  # every record carries a Redis TTL

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._match = _glob_escape(prefix) + "*"

    def _claim_args(self, owner: str, now_ms: int, lease_ms: int) -> list[str | int]:
        return [owner, now_ms, f"c|{now_ms + lease_ms}|{owner}", _ttl(lease_ms)]

    def _complete_args(self, owner: str, now_ms: int, retention_ms: int) -> list[str | int]:
        return [now_ms, f"d|{now_ms + retention_ms}|{owner}", _ttl(retention_ms)]

    def _cancel_args(self, now_ms: int, retention_ms: int) -> list[str | int]:
        end = now_ms + retention_ms
        return [end, f"x|{end}|", _ttl(retention_ms)]


class RedisStore(_RedisBase):
    """A synchronous Redis store (redis-py; thread-safe through its connection pool).

    Pass `client` to share an existing `redis.Redis`; the store then leaves it open on
    `close()`. Raises ConfigError when redis-py is not installed. Operations raise
    `redis.RedisError` (ConnectionError, TimeoutError, ResponseError).
    """

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.Redis[bytes] | None = None,
    ) -> None:
        super().__init__(prefix)
        lib = _import_redis()
        self._owns_client = client is None
        self.client: redis.Redis[bytes] = lib.Redis.from_url(url) if client is None else client
        self._claim = self.client.register_script(_CLAIM)
        self._complete = self.client.register_script(_COMPLETE)
        self._release = self.client.register_script(_RELEASE)
        self._cancel = self.client.register_script(_CANCEL)
        self._purge = self.client.register_script(_PURGE)

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim`. Raises `redis.RedisError`."""
        code = self._claim(keys=[self.prefix + key], args=self._claim_args(owner, now_ms, lease_ms))
        return _RESULTS[int(code)]

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete`. Raises `redis.RedisError`."""
        args = self._complete_args(owner, now_ms, retention_ms)
        self._complete(keys=[self.prefix + key], args=args)

    def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `redis.RedisError`."""
        self._release(keys=[self.prefix + key], args=[owner])

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `redis.RedisError`."""
        self._cancel(keys=[self.prefix + key], args=self._cancel_args(now_ms, retention_ms))

    def purge(self, *, now_ms: int) -> int:
        """SCAN this prefix and delete records expired by `now_ms`; returns how many.

        Not needed in normal running (`needs_purge` is False): Redis expires records
        itself. Walks the whole keyspace. Raises `redis.RedisError`.
        """
        total = 0
        batch: Sequence[bytes]
        cursor = 0
        while True:
            cursor, batch = self.client.scan(cursor, match=self._match, count=_SCAN_COUNT)
            if batch:
                total += int(self._purge(keys=list(batch), args=[now_ms]))
            if cursor == 0:
                return total

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


class AsyncRedisStore(_RedisBase):
    """`RedisStore` over `redis.asyncio`; the same records, so both can share a server.

    Raises ConfigError when redis-py is not installed; operations raise
    `redis.RedisError`.
    """

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.asyncio.Redis[bytes] | None = None,
    ) -> None:
        super().__init__(prefix)
        lib = _import_redis()
        self._owns_client = client is None
        self.client: redis.asyncio.Redis[bytes] = (
            lib.asyncio.Redis.from_url(url) if client is None else client
        )
        self._claim = self.client.register_script(_CLAIM)
        self._complete = self.client.register_script(_COMPLETE)
        self._release = self.client.register_script(_RELEASE)
        self._cancel = self.client.register_script(_CANCEL)
        self._purge = self.client.register_script(_PURGE)

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim`. Raises `redis.RedisError`."""
        args = self._claim_args(owner, now_ms, lease_ms)
        code = await self._claim(keys=[self.prefix + key], args=args)
        return _RESULTS[int(code)]

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete`. Raises `redis.RedisError`."""
        args = self._complete_args(owner, now_ms, retention_ms)
        await self._complete(keys=[self.prefix + key], args=args)

    async def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `redis.RedisError`."""
        await self._release(keys=[self.prefix + key], args=[owner])

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel`. Raises `redis.RedisError`."""
        args = self._cancel_args(now_ms, retention_ms)
        await self._cancel(keys=[self.prefix + key], args=args)

    async def purge(self, *, now_ms: int) -> int:
        """See `RedisStore.purge`. Raises `redis.RedisError`."""
        total = 0
        batch: Sequence[bytes]
        cursor = 0
        while True:
            cursor, batch = await self.client.scan(cursor, match=self._match, count=_SCAN_COUNT)
            if batch:
                total += int(await self._purge(keys=list(batch), args=[now_ms]))
            if cursor == 0:
                return total

    async def close(self) -> None:
        if self._owns_client:
            # aclose() since redis-py 5.0.1, where close() became deprecated.
            closer = getattr(self.client, "aclose", None) or self.client.close
            await closer()
