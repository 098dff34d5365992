"""Redis store (optional extra `redis`): shared by every worker that reaches the server.

Each operation is one Lua script, so a read-decide-write is atomic on the server and
costs one round trip; the batch operations send their scripts in one pipeline. Records
are strings `<kind>|<expires_at_ms>|<owner>` (kind `c` claim, `d` done, `x` tombstone).

Expiry follows the server's clock (`TIME`), not the caller's: the workers of several
hosts share one clock, so a host whose clock runs ahead cannot take over a live lease.
The guard's `now_ms` arguments are accepted for the protocol and ignored (the
schedule's are not: below). Every guard key carries a Redis TTL so the server drops it
on its own (no purge needed): a done-record or tombstone lives exactly its retention; a
claim lives twice its lease, so that a late `renew` of a lease nobody took over still
finds it (to the other owners, the claim has expired at the end of its lease all the
same).

The schedule (`store.schedule`: `RedisSchedule` / `AsyncRedisSchedule`, see
`rabbit_delay._stores.redis_schedule` for its keys, indexes and purge) lives under the
same prefix, in `<prefix>sched:...` keys (the guard's keys an app writes begin with a
business queue's name, never `sched:`). Its records follow the caller's clock, not the
server's: their times are the application's (due, handled). `scheduled_batch` sends a
worker's finishes and claims in one pipeline, each one script that does the guard's
part and the schedule's check or update together.

`redis` is imported when a store is created, so this module loads without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rabbit_delay._errors import ConfigError
from rabbit_delay._idempotency.guard import (
    DEFAULT_PREFIX,
    VERDICT_RESULT,
    ClaimItem,
    ClaimResult,
    FinishItem,
    ScheduledClaim,
    ScheduledFinish,
)
from rabbit_delay._schedule.records import Verdict
from rabbit_delay._stores import redis_schedule as schedule
from rabbit_delay._stores.redis_schedule import (
    PIGGYBACK,
    AsyncRedisSchedule,
    RedisSchedule,
    ScheduleOps,
    ScheduleScripts,
    escape,
)

if TYPE_CHECKING:
    import redis
    import redis.asyncio

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# Every script starts here: `now` in epoch ms by the server's clock. Before Redis 5 a
# script that read TIME could not write unless it asked for effects replication.
_NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function record(kind, ms, owner)
  return kind .. '|' .. string.format('%d', now + tonumber(ms)) .. '|' .. owner
end
"""

# Every script on one key reads its record here: found (false: no key), and when the
# value is a record, its kind, expiry (ms) and owner.
_READ = """
local function read()
  local v = redis.call('GET', KEYS[1])
  if not v then return false end
  local kind, exp, owner = string.match(v, '^(%a)|(%-?%d+)|(.*)$')
  return true, kind, tonumber(exp), owner
end
"""

# The guard's operations as Lua functions on KEYS[1], for its own scripts and for the
# schedule's claim and finish (below). claim(owner, lease ms, key TTL ms) returns an
# index into _RESULTS.
_CLAIM_FN = """
local function claim(owner, lease, ttl)
  local found, kind, exp, holder = read()
  if found then
    if not kind then
      return redis.error_reply('rabbit-delay: not an idempotency record: ' .. KEYS[1])
    end
    if exp > now then
      if kind == 'd' then return 1 end
      if kind == 'x' then return 3 end
      if holder ~= owner then return 2 end
    end
  end
  redis.call('SET', KEYS[1], record('c', lease, owner), 'PX', ttl)
  return 0
end
"""

# complete(owner, retention ms): a live done-record or tombstone stays.
_COMPLETE_FN = """
local function complete(owner, retention)
  local _, kind, exp = read()
  if kind and kind ~= 'c' and exp > now then return 0 end
  redis.call('SET', KEYS[1], record('d', retention, owner), 'PX', retention)
  return 1
end
"""

# release(owner): only the claim's holder may drop it. No clock needed.
_RELEASE_FN = """
local function release(owner)
  local _, kind, _, holder = read()
  if kind == 'c' and holder == owner then return redis.call('DEL', KEYS[1]) end
  return 0
end
"""

# KEYS[1]; ARGV: owner, lease ms, key TTL ms.
_CLAIM = _NOW + _READ + _CLAIM_FN + "return claim(ARGV[1], ARGV[2], ARGV[3])\n"
_RESULTS = (
    ClaimResult.CLAIMED,
    ClaimResult.DONE,
    ClaimResult.IN_PROGRESS,
    ClaimResult.CANCELLED,
)

# KEYS[1]; ARGV: owner, lease ms, key TTL ms. Only a claim by this owner, expired or
# not; never creates a record. Returns 1 when renewed.
_RENEW = (
    _NOW
    + _READ
    + """
local _, kind, _, holder = read()
if kind ~= 'c' or holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], record('c', ARGV[2], ARGV[1]), 'PX', ARGV[3])
return 1
"""
)

# KEYS[1]; ARGV: owner, retention ms.
_COMPLETE = _NOW + _READ + _COMPLETE_FN + "return complete(ARGV[1], ARGV[2])\n"

# KEYS[1]; ARGV: owner.
_RELEASE = _READ + _RELEASE_FN + "return release(ARGV[1])\n"

# KEYS[1]; ARGV: retention ms. Never shortens a tombstone.
_CANCEL = (
    _NOW
    + _READ
    + """
local _, kind, exp = read()
if kind == 'x' and exp >= now + tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], record('x', ARGV[1], ''), 'PX', ARGV[1])
return 1
"""
)

# KEYS: a SCAN batch. Deletes the records expired by the server's clock that the TTL
# has not dropped yet (claims within their grace, records written by a version that
# followed the caller's clock). pcall: a key of another type under the prefix is
# skipped, not an error.
_PURGE = (
    _NOW
    + """
local n = 0
for _, k in ipairs(KEYS) do
  local v = redis.pcall('GET', k)
  if type(v) == 'string' then
    local exp = string.match(v, '^%a|(%-?%d+)|')
    if exp and tonumber(exp) <= now then n = n + redis.call('DEL', k) end
  end
end
return n
"""
)
_SCAN_COUNT = 1_000

# A scheduled delivery's claim. KEYS: the guard's key, the schedule record. ARGV: owner,
# lease ms, key TTL ms, prefix, scope (escaped), generation, now (the caller's clock).
# The schedule's verdict ("superseded", "cancelled", "handled"), else the claim's index
# into _RESULTS.
_SCHEDULED_CLAIM = (
    _NOW
    + _READ
    + _CLAIM_FN
    + schedule.LIB
    + """
P = ARGV[4]
local verdict = check(KEYS[2], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]))
if verdict then return verdict end
return claim(ARGV[1], ARGV[2], ARGV[3])
"""
)

# A scheduled delivery's finish: the complete or release, and its Update. KEYS: the
# guard's key, the schedule record. ARGV: owner, 1 (complete) or 0 (release), retention
# ms, prefix, then `ScheduleOps.update_args` (the update is read, and checked, first).
_SCHEDULED_FINISH = (
    _NOW
    + _READ
    + _COMPLETE_FN
    + _RELEASE_FN
    + schedule.LIB
    + """
P = ARGV[4]
local update = read_update(6)
if ARGV[2] == '1' then complete(ARGV[1], ARGV[3]) else release(ARGV[1]) end
finish(KEYS[2], ARGV[5], update)
return 0
"""
)


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


# A claim's key outlives its lease by this factor (see the module docstring).
_CLAIM_TTL_FACTOR = 2

# One script call of a batch: the registered Script, its keys, its arguments. Scripts
# are typed Any: redis-py's stubs do not declare their `sha` and `script`.
_Call = tuple[Any, list[str], list[str | int]]


class _RedisBase:
    # The guard's records carry a Redis TTL; the schedule's writes purge its expired
    # records as they go (rabbit_delay._stores.redis_schedule).
    needs_purge = False

    def __init__(self, prefix: str, lib: Any) -> None:
        self.prefix = prefix
        self._match = _glob_escape(prefix) + "*"
        self._redis_error: type[Exception] = lib.RedisError
        self._no_script: type[Exception] = lib.exceptions.NoScriptError
        # The batches send EVALSHA straight into a pipeline (a Script called with
        # client=pipe would cost a SCRIPT EXISTS round trip per batch): the scripts
        # are loaded once before the first batch, and again after a NOSCRIPT.
        self._scripts_loaded = False

    def _register_scripts(self, client: Any) -> None:
        """The Lua scripts, registered on `client` (redis-py's sync and asyncio clients
        register them alike; their calls return a reply or an awaitable of one)."""
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)
        self._cancel = client.register_script(_CANCEL)
        self._purge = client.register_script(_PURGE)
        self._scheduled_claim = client.register_script(_SCHEDULED_CLAIM)
        self._scheduled_finish = client.register_script(_SCHEDULED_FINISH)
        self._schedule_ops = ScheduleOps(self.prefix, ScheduleScripts(client))
        # what a batch may run, loaded before the first one (purge runs on its own)
        self._scripts: tuple[Any, ...] = (
            self._claim,
            self._renew,
            self._complete,
            self._release,
            self._cancel,
            self._scheduled_claim,
            self._scheduled_finish,
            self._schedule_ops.scripts.purge,
        )

    @staticmethod
    def _claim_args(owner: str, lease_ms: int) -> list[str | int]:
        return [owner, lease_ms, _ttl(lease_ms * _CLAIM_TTL_FACTOR)]

    @staticmethod
    def _complete_args(owner: str, retention_ms: int) -> list[str | int]:
        return [owner, _ttl(retention_ms)]

    def _claim_calls(self, items: Sequence[ClaimItem], lease_ms: int) -> list[_Call]:
        return [
            (self._claim, [self.prefix + key], self._claim_args(owner, lease_ms))
            for key, owner in items
        ]

    def _finish_calls(self, items: Sequence[FinishItem], retention_ms: int) -> list[_Call]:
        return [
            (self._complete, [self.prefix + key], self._complete_args(owner, retention_ms))
            if succeeded
            else (self._release, [self.prefix + key], [owner])
            for key, owner, succeeded in items
        ]

    def _scheduled_calls(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> list[_Call]:
        """One script call per finish, then per claim (the guard's own scripts for those
        without an Update or Ref), then, when records were finished, a purge slice by
        the caller's clock (at least twice as many records as were finished)."""
        ops = self._schedule_ops
        calls: list[_Call] = []
        updates = 0
        for key, owner, succeeded, update in finishes:
            if update is None:
                calls += self._finish_calls([(key, owner, succeeded)], retention_ms)
                continue
            updates += 1
            keys = [self.prefix + key, ops.record_key(update.ref.scope, update.ref.key)]
            args: list[str | int] = [owner, 1 if succeeded else 0, _ttl(retention_ms)]
            args += [self.prefix, *ops.update_args(update, now_ms)]
            calls.append((self._scheduled_finish, keys, args))
        for key, owner, ref in claims:
            if ref is None:
                calls += self._claim_calls([(key, owner)], lease_ms)
                continue
            keys = [self.prefix + key, ops.record_key(ref.scope, ref.key)]
            args = [*self._claim_args(owner, lease_ms), self.prefix, escape(ref.scope)]
            args += [ref.generation, now_ms]
            calls.append((self._scheduled_claim, keys, args))
        if updates:
            calls.append(ops.purge_call(now_ms, max(PIGGYBACK, 2 * updates)))
        return calls

    @staticmethod
    def _scheduled_results(
        replies: Sequence[Any], finishes: int, claims: int
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        # the purge slice's reply, if any, is left out: it has no slot
        finished = [_finish_result(reply) for reply in replies[:finishes]]
        claimed = [_claim_result(reply) for reply in replies[finishes : finishes + claims]]
        return finished, claimed

    def _missing_scripts(self, replies: Sequence[Any]) -> list[int]:
        # NOSCRIPT: the server lost its script cache (restart, failover, SCRIPT FLUSH).
        # Such an item did not run, so sending it again is safe.
        return [i for i, reply in enumerate(replies) if isinstance(reply, self._no_script)]


def _claim_result(reply: Any) -> ClaimResult | Exception:
    if isinstance(reply, Exception):
        return reply
    if isinstance(reply, bytes | str):  # the schedule's verdict
        return VERDICT_RESULT[Verdict(reply.decode() if isinstance(reply, bytes) else reply)]
    return _RESULTS[int(reply)]


def _finish_result(reply: Any) -> Exception | None:
    return reply if isinstance(reply, Exception) else None


class RedisStore(_RedisBase):
    """A synchronous Redis store (redis-py; thread-safe through its connection pool).

    Pass `client` to share an existing `redis.Redis`; the store then leaves it open on
    `close()`. Expiry follows the server's clock: every `now_ms` argument is ignored.
    Raises ConfigError when redis-py is not installed. Operations raise
    `redis.RedisError` (ConnectionError, TimeoutError, ResponseError); the batch
    operations return them in their slots instead.
    """

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.Redis[bytes] | None = None,
    ) -> None:
        lib = _import_redis()
        super().__init__(prefix, lib)
        self._owns_client = client is None
        self.client: redis.Redis[bytes] = lib.Redis.from_url(url) if client is None else client
        self._register_scripts(self.client)
        self.schedule = RedisSchedule(self._schedule_ops)

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim` (`now_ms` ignored). Raises `redis.RedisError`."""
        code = self._claim(keys=[self.prefix + key], args=self._claim_args(owner, lease_ms))
        return _RESULTS[int(code)]

    def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """See `IdempotencyStore.renew` (`now_ms` ignored). Raises `redis.RedisError`."""
        return (
            int(self._renew(keys=[self.prefix + key], args=self._claim_args(owner, lease_ms))) == 1
        )

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete` (`now_ms` ignored). Raises `redis.RedisError`."""
        self._complete(keys=[self.prefix + key], args=self._complete_args(owner, retention_ms))

    def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `redis.RedisError`."""
        self._release(keys=[self.prefix + key], args=[owner])

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel` (`now_ms` ignored). Raises `redis.RedisError`."""
        self._cancel(keys=[self.prefix + key], args=[_ttl(retention_ms)])

    def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """See `IdempotencyStore.claim_many`: one pipeline, one round trip (`now_ms`
        ignored)."""
        replies = self._pipeline(self._claim_calls(items, lease_ms))
        return [_claim_result(reply) for reply in replies]

    def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `IdempotencyStore.finish_many`: one pipeline, one round trip (`now_ms`
        ignored)."""
        calls = self._finish_calls(items, retention_ms)
        return [_finish_result(reply) for reply in self._pipeline(calls)]

    def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `SchedulingStore.scheduled_batch`: one pipeline, one round trip; each
        item one script, atomic with its schedule check or update (the guard's records
        by the server's clock, the schedule's by `now_ms`)."""
        calls = self._scheduled_calls(finishes, claims, now_ms, lease_ms, retention_ms)
        return self._scheduled_results(self._pipeline(calls), len(finishes), len(claims))

    def purge(self, *, now_ms: int) -> int:
        """Delete the schedule's records expired by `now_ms` (`RedisSchedule.purge`),
        then SCAN this prefix and delete the guard's records expired by the server's
        clock; returns how many.

        Not needed in normal running (`needs_purge` is False): Redis expires the guard's
        records itself, and the schedule's writes purge what expired (see
        `rabbit_delay._stores.redis_schedule`). Walks the whole keyspace. Raises
        `redis.RedisError`.
        """
        total = self.schedule.purge(now_ms=now_ms)
        batch: Sequence[bytes]
        cursor = 0
        while True:
            cursor, batch = self.client.scan(cursor, match=self._match, count=_SCAN_COUNT)
            if batch:
                total += int(self._purge(keys=list(batch)))
            if cursor == 0:
                return total

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def _pipeline(self, calls: list[_Call]) -> list[Any]:
        if not calls:
            return []
        try:
            if not self._scripts_loaded:
                self._load_scripts()
            replies = self._send(calls)
            missing = self._missing_scripts(replies)
            if missing:
                self._load_scripts()
                for i, reply in zip(missing, self._send([calls[i] for i in missing]), strict=True):
                    replies[i] = reply
        except self._redis_error as exc:  # the connection failed: every item with it
            return [exc] * len(calls)
        return replies

    def _send(self, calls: list[_Call]) -> list[Any]:
        with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return list(pipe.execute(raise_on_error=False))

    def _load_scripts(self) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            for script in self._scripts:
                pipe.script_load(script.script)
            for script, sha in zip(self._scripts, pipe.execute(), strict=True):
                script.sha = sha.decode() if isinstance(sha, bytes) else sha
        self._scripts_loaded = True


class AsyncRedisStore(_RedisBase):
    """`RedisStore` over `redis.asyncio`; the same records, so both can share a server.

    Raises ConfigError when redis-py is not installed; operations raise
    `redis.RedisError`, except the batch operations, which return them in their slots.
    """

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.asyncio.Redis[bytes] | None = None,
    ) -> None:
        lib = _import_redis()
        super().__init__(prefix, lib)
        self._owns_client = client is None
        self.client: redis.asyncio.Redis[bytes] = (
            lib.asyncio.Redis.from_url(url) if client is None else client
        )
        self._register_scripts(self.client)
        self.schedule = AsyncRedisSchedule(self._schedule_ops)

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """See `IdempotencyStore.claim` (`now_ms` ignored). Raises `redis.RedisError`."""
        code = await self._claim(keys=[self.prefix + key], args=self._claim_args(owner, lease_ms))
        return _RESULTS[int(code)]

    async def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """See `IdempotencyStore.renew` (`now_ms` ignored). Raises `redis.RedisError`."""
        args = self._claim_args(owner, lease_ms)
        return int(await self._renew(keys=[self.prefix + key], args=args)) == 1

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.complete` (`now_ms` ignored). Raises `redis.RedisError`."""
        args = self._complete_args(owner, retention_ms)
        await self._complete(keys=[self.prefix + key], args=args)

    async def release(self, key: str, owner: str) -> None:
        """See `IdempotencyStore.release`. Raises `redis.RedisError`."""
        await self._release(keys=[self.prefix + key], args=[owner])

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """See `IdempotencyStore.cancel` (`now_ms` ignored). Raises `redis.RedisError`."""
        await self._cancel(keys=[self.prefix + key], args=[_ttl(retention_ms)])

    async def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """See `RedisStore.claim_many`."""
        replies = await self._pipeline(self._claim_calls(items, lease_ms))
        return [_claim_result(reply) for reply in replies]

    async def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """See `RedisStore.finish_many`."""
        calls = self._finish_calls(items, retention_ms)
        return [_finish_result(reply) for reply in await self._pipeline(calls)]

    async def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `RedisStore.scheduled_batch`."""
        calls = self._scheduled_calls(finishes, claims, now_ms, lease_ms, retention_ms)
        replies = await self._pipeline(calls)
        return self._scheduled_results(replies, len(finishes), len(claims))

    async def purge(self, *, now_ms: int) -> int:
        """See `RedisStore.purge`. Raises `redis.RedisError`."""
        total = await self.schedule.purge(now_ms=now_ms)
        batch: Sequence[bytes]
        cursor = 0
        while True:
            cursor, batch = await self.client.scan(cursor, match=self._match, count=_SCAN_COUNT)
            if batch:
                total += int(await self._purge(keys=list(batch)))
            if cursor == 0:
                return total

    async def close(self) -> None:
        if self._owns_client:
            # aclose() since redis-py 5.0.1, where close() became deprecated.
            closer = getattr(self.client, "aclose", None) or self.client.close
            await closer()

    async def _pipeline(self, calls: list[_Call]) -> list[Any]:
        if not calls:
            return []
        try:
            if not self._scripts_loaded:
                await self._load_scripts()
            replies = await self._send(calls)
            missing = self._missing_scripts(replies)
            if missing:
                await self._load_scripts()
                again = await self._send([calls[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except self._redis_error as exc:  # the connection failed: every item with it
            return [exc] * len(calls)
        return replies

    async def _send(self, calls: list[_Call]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    async def _load_scripts(self) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for script in self._scripts:
                pipe.script_load(script.script)
            for script, sha in zip(self._scripts, await pipe.execute(), strict=True):
                script.sha = sha.decode() if isinstance(sha, bytes) else sha
        self._scripts_loaded = True
