"""The schedule in Redis (`RedisSchedule`, `AsyncRedisSchedule`), written once for
redis-py's sync and asyncio clients.

Every operation is a Lua script (atomic on the server, one round trip), and the
operations are programs (sans-I/O, like `sql_schedule`): a program yields the script
calls it needs and is sent their replies; `run_sync` runs it on the sync client's
registered scripts, `run_async` on the asyncio client's. The rules are those of
`rabbit_delay._schedule.rules`, written again in Lua (`_LIB`); the store contract tests
hold them to the memory store's answers.

Data layout, under the store's prefix P (`rabbit-delay:` by default) and E, the scope
with `%` and `:` escaped (`%25`, `%3A`), so that no scope, key or queue name can make two
keys meet:

  P sched:E:k:<key>                 a hash per record: every `ScheduleRecord` column
                                    (absent when None) and the payload (body,
                                    content_type, headers as JSON)
  P sched:E:due:all                 due order of every record of the scope
  P sched:E:due:<state>             ... of the scope's records in that state
  P sched:E:due:all:<queue>         ... of the queue's records
  P sched:E:due:<state>:<queue>     ... of the queue's records in that state
  P sched:E:sweep                   scheduled records by sweep_ms (member: key)
  P sched:E:handled                 handled records by updated_ms (member: key)
  P sched:expires                   every finished record by expires_ms (member: E:key)

The due indexes are lexicographic sorted sets (every score 0) of `<due>|<key>`
members, `<due>` being due_ms + 10^15 zero-padded to 16 digits: byte order is exactly
the (due_ms, key) order of `Query` (UTF-8 byte order is code point order), so a page is
one ZRANGEBYLEX from the `Query.after` cursor, with LIMIT: a listing never loads a
whole set, and ties on due_ms order by key. A record is in four due indexes (all and
its state, for its scope and its queue), so a page with or without a state or queue
filter is read from one set, never merged in Lua (whose string comparison is the
server locale's strcoll, not byte order), and `count_due` is one ZLEXCOUNT per
interval of the scheduled set. The records live under `:k:`, not beside the indexes,
so that a key named "due" is a record like any other. due_ms must lie in
[-10^15, 9 * 10^15) (a place outside is refused). Every write rewrites the record's
index entries in the same script, so the indexes hold exactly the records there are.

Clocks: the schedule goes by the caller's clock (every `now_ms` argument), unlike the
guard's records beside it, whose leases and retention follow the server's clock (see
`rabbit_delay._stores.redis`). A record's times are the application's own (due,
created, handled), compared with what its publishers and workers read on their clocks.

Purge: a finished record is in `P sched:expires` by its expires_ms; a purge slice
deletes records whose expires_ms has passed, each with its index entries
(`purge_slice` in `_LIB`), and `purge(now_ms=...)` runs slices until none is left (the
store's `purge()` calls it). Nobody has to call it: every script that writes records
ends with a slice by the writer's clock (a place, a cancel, a reschedule, a sweep, a
worker's batch that finishes records: a slice at least twice what it finished), and so
does the sweeper's `overdue`, which the workers call every sweep interval (a larger
slice). Expired records go at least as fast as records finish while the schedule is
used, and at each sweep while it is idle; only a schedule that nobody writes and no
worker sweeps keeps its expired records, until its next write, sweep or purge.
`needs_purge` stays False: True would make every worker's housekeeping SCAN the whole
keyspace for the guard's records, which expire by TTL anyway. Schedule records get no
Redis TTL: it would follow the server's clock, not the schedule's, and delete a hash
while its index entries stayed behind.

Costs: a script holds the server while it runs. A record written costs about ten
commands (its hash and index entries), so a place of 1,000 entries, atomic as
`ScheduleBook.place_many` promises, holds it some 50 ms; a look-up is one HMGET.

The scripts touch keys they compute (a record's indexes, the purge's records), so the
schedule needs one Redis server, as the store's batches and purge do.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from rabbit_delay._schedule.book import SweptItem
from rabbit_delay._schedule.records import (
    MAX_PAGE,
    Entry,
    Payload,
    Placed,
    Placement,
    Query,
    ScheduleRecord,
    ScheduleState,
    Update,
)

T = TypeVar("T")
# One encoder for every record's headers (json.dumps with arguments builds one per call).
_COMPACT = json.JSONEncoder(separators=(",", ":"))

# One script call: the registered script (sync or asyncio), its keys, its arguments.
Call = tuple[Any, list[str], list[Any]]
Program = Generator[Call, Any, T]

COLUMNS = (
    "scope",
    "key",
    "generation",
    "state",
    "queue",
    "due_ms",
    "message_id",
    "created_ms",
    "updated_ms",
    "attempts",
    "last_error",
    "expires_ms",
    "sweep_ms",
    "replaced",
    "dropped",
    "republished",
)
_NUMERIC = (
    "generation",
    "due_ms",
    "created_ms",
    "updated_ms",
    "attempts",
    "expires_ms",
    "sweep_ms",
    "replaced",
    "dropped",
    "republished",
)
PAYLOAD = ("body", "content_type", "headers")

# due_ms as a due-index member: due + _OFFSET, 16 digits (negative dues sort first).
_OFFSET = 10**15
_DUE_END = 9 * 10**15  # exclusive
PURGE_SLICE = 500  # records per purge script call
PIGGYBACK = 64  # expired records a writing script purges after its own writes


def _lua_list(names: Sequence[str]) -> str:
    return "{" + ", ".join(f"'{n}'" for n in names) + "}"


# The schedule's Lua library: each script sets P (the store's prefix) first. No ordering
# by Lua string comparison (strcoll: it follows the server's locale): the sorted sets
# order. The rules are `rabbit_delay._schedule.rules`, as written there.
_LIB = (
    f"""
local P
local COLS = {_lua_list(COLUMNS)}
local ALL = {_lua_list(COLUMNS + PAYLOAD)}
local PAYLOAD = {_lua_list(PAYLOAD)}
local NUM = {{}}
for _, f in ipairs({_lua_list(_NUMERIC)}) do NUM[f] = true end
local OFFSET = {_OFFSET}
local DUE_END = {_DUE_END}
"""
    + """
local function fail(message) error({err = 'rabbit-delay: ' .. message}) end
local function fmt(n) return string.format('%d', n) end
local function enc(ms)
  if type(ms) ~= 'number' or ms < -OFFSET or ms >= DUE_END then
    fail('schedule due_ms missing or out of range: ' .. tostring(ms))
  end
  return string.format('%016d', ms + OFFSET)
end
local function opt(s) if s == '' then return nil end return string.sub(s, 2) end
local function base(E) return P .. 'sched:' .. E .. ':' end
local function rkey(E, key) return base(E) .. 'k:' .. key end
local function xkey() return P .. 'sched:expires' end

-- a record's columns (numbers as numbers, None as nil), or nil when there is none
local function get_record(k)
  local v = redis.call('HMGET', k, unpack(COLS))
  if not v[3] then return nil end
  local r = {}
  for i, f in ipairs(COLS) do
    local x = v[i]
    if x then
      if NUM[f] then x = tonumber(x) end
      r[f] = x
    end
  end
  return r
end

local function copy(r)
  local c = {}
  for f, x in pairs(r) do c[f] = x end
  return c
end

-- the record's entries in every index it belongs to: index key -> {score, member}
local function entries_of(E, r)
  local b, m = base(E), enc(r.due_ms) .. '|' .. r.key
  local t = {}
  t[b .. 'due:all'] = {0, m}
  t[b .. 'due:all:' .. r.queue] = {0, m}
  t[b .. 'due:' .. r.state] = {0, m}
  t[b .. 'due:' .. r.state .. ':' .. r.queue] = {0, m}
  if r.state == 'scheduled' and r.sweep_ms then t[b .. 'sweep'] = {r.sweep_ms, r.key} end
  if r.state == 'handled' then t[b .. 'handled'] = {r.updated_ms, r.key} end
  if r.expires_ms then t[xkey()] = {r.expires_ms, E .. ':' .. r.key} end
  return t
end

-- the record's index entries: every one removed (new = nil), or moved from `old` to
-- `new`, touching only those that differ (a finish moves two of seven)
local function reindex(E, old, new)
  local before = old and entries_of(E, old) or {}
  local after = new and entries_of(E, new) or {}
  for k, e in pairs(before) do
    local a = after[k]
    if not a or a[2] ~= e[2] then redis.call('ZREM', k, e[2]) end
  end
  for k, e in pairs(after) do
    local b = before[k]
    if not b or b[2] ~= e[2] or b[1] ~= e[1] then redis.call('ZADD', k, fmt(e[1]), e[2]) end
  end
end

local function index(E, r, add)
  if add then reindex(E, nil, r) else reindex(E, r, nil) end
end

-- write `new` over `old` (nil: a new record), its indexes with it, only the fields and
-- index entries that changed; the payload {body, content_type, headers} when given
local function put_record(k, E, old, new, payload)
  enc(new.due_ms)
  local args, gone = {}, {}
  for _, f in ipairs(COLS) do
    local x = new[f]
    if x == nil then
      if old and old[f] ~= nil then table.insert(gone, f) end
    elseif not old or old[f] ~= x then
      if NUM[f] then x = fmt(x) end
      table.insert(args, f)
      table.insert(args, x)
    end
  end
  if payload then
    for i, f in ipairs(PAYLOAD) do
      table.insert(args, f)
      table.insert(args, payload[i])
    end
  end
  if #args > 0 then redis.call('HSET', k, unpack(args)) end
  if #gone > 0 then redis.call('HDEL', k, unpack(gone)) end
  reindex(E, old, new)
end

-- delete at most n records expired by `now`, with their index entries; how many
local function purge_slice(now, n)
  if n <= 0 then return 0 end
  local x = xkey()
  local expired = redis.call('ZRANGEBYSCORE', x, '-inf', fmt(now), 'LIMIT', 0, n)
  for _, m in ipairs(expired) do
    local E, key = string.match(m, '^([^:]*):(.*)$')
    local ok, r = false, nil
    if E then ok, r = pcall(get_record, rkey(E, key)) end
    if ok and r then
      index(E, r, false)
      redis.call('DEL', rkey(E, key))
    else
      redis.call('ZREM', x, m)
    end
  end
  return #expired
end

-- rules.place: {placement, generation, message_id, due_ms}
local function place(k, E, scope, key, queue, due, mid, keep, sweep, payload, now)
  local old = get_record(k)
  if old and old.state == 'scheduled' then
    if keep then return {'kept', old.generation, old.message_id, old.due_ms} end
    local new = copy(old)
    new.generation = old.generation + 1
    new.queue, new.due_ms, new.message_id, new.updated_ms = queue, due, mid, now
    new.attempts, new.last_error, new.sweep_ms = 0, nil, sweep
    new.replaced, new.republished = old.replaced + 1, 0
    put_record(k, E, old, new, payload)
    return {'replaced', new.generation, mid, due}
  end
  local new = {
    scope = scope, key = key, generation = 1, state = 'scheduled', queue = queue,
    due_ms = due, message_id = mid, created_ms = now, updated_ms = now, attempts = 0,
    sweep_ms = sweep, replaced = 0, dropped = 0, republished = 0,
  }
  if old then
    new.generation, new.replaced, new.dropped = old.generation + 1, old.replaced, old.dropped
  end
  put_record(k, E, old, new, payload)
  return {'created', new.generation, mid, due}
end

-- rules.check, and rules.dropped for a superseded or cancelled copy: the verdict or nil
-- (two fields read; the whole record only for a copy dropped, which is rare)
local function check(k, E, generation, now)
  local v = redis.call('HMGET', k, 'generation', 'state')
  if not v[1] then return nil end
  local current, state = tonumber(v[1]), v[2]
  if generation > current then return nil end
  local verdict
  if generation < current then
    verdict = 'superseded'
  elseif state == 'cancelled' then
    verdict = 'cancelled'
  elseif state == 'handled' then
    return 'handled'
  else
    return nil
  end
  local r = get_record(k)
  local new = copy(r)
  new.dropped, new.updated_ms = r.dropped + 1, now
  put_record(k, E, r, new)
  return verdict
end

-- a worker's Update from ARGV[i..i+6]: generation, finished, retention, error,
-- due, sweep, now (checked before anything is written)
local function read_update(i)
  local u = {
    generation = tonumber(ARGV[i]), finished = ARGV[i + 1], retention = tonumber(ARGV[i + 2]),
    error = opt(ARGV[i + 3]), due = tonumber(ARGV[i + 4]), sweep = tonumber(ARGV[i + 5]),
    now = tonumber(ARGV[i + 6]),
  }
  if u.finished == 'retry' then
    enc(u.due)
    if not u.sweep then fail('a retry needs its sweep_ms') end
  end
  return u
end

-- rules.finish; true when the record changed
local function finish(k, E, u)
  local r = get_record(k)
  if not r or r.generation ~= u.generation then return false end
  if r.state ~= 'scheduled' and r.state ~= 'parked' then return false end
  local new = copy(r)
  new.updated_ms = u.now
  if u.finished == 'handled' then
    new.state, new.expires_ms, new.sweep_ms = 'handled', u.now + u.retention, nil
  else
    new.attempts, new.last_error = r.attempts + 1, u.error
    if u.finished == 'parked' then
      new.state, new.expires_ms, new.sweep_ms = 'parked', u.now + u.retention, nil
    else
      new.state, new.due_ms, new.expires_ms, new.sweep_ms = 'scheduled', u.due, nil, u.sweep
    end
  end
  put_record(k, E, r, new)
  return true
end
"""
)

# KEYS: the entries' records. ARGV: P, now, purge slice, then 11 per entry (scope, E,
# key, queue, due, message_id, on_conflict, sweep, body, content_type, headers).
# Every record key and due is checked before the first write.
_PLACE = (
    _LIB
    + """
P = ARGV[1]
local now, W = tonumber(ARGV[2]), 11
for i, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k).ok
  if t ~= 'none' and t ~= 'hash' then fail('not a schedule record: ' .. k) end
  enc(tonumber(ARGV[3 + (i - 1) * W + 5]))
end
local out = {}
for i, k in ipairs(KEYS) do
  local b = 3 + (i - 1) * W
  out[i] = place(
    k, ARGV[b + 2], ARGV[b + 1], ARGV[b + 3], ARGV[b + 4], tonumber(ARGV[b + 5]), ARGV[b + 6],
    ARGV[b + 7] == 'keep', tonumber(ARGV[b + 8]), {ARGV[b + 9], ARGV[b + 10], ARGV[b + 11]}, now
  )
end
purge_slice(now, tonumber(ARGV[3]))
return out
"""
)

# KEYS[1]: a record. Its columns and payload (nil generation: none).
_LOOKUP = (
    _LIB
    + """
return redis.call('HMGET', KEYS[1], unpack(ALL))
"""
)

# KEYS[1]: a due index. ARGV: record key prefix (P sched:E:k:), lex min, lex max, limit.
# The records' columns in index order (a member without its record is passed over).
_SELECT = (
    _LIB
    + """
local records, low, high, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local out = {}
while #out < limit do
  local members = redis.call('ZRANGEBYLEX', KEYS[1], low, high, 'LIMIT', 0, limit - #out)
  if #members == 0 then break end
  for _, m in ipairs(members) do
    local v = redis.call('HMGET', records .. string.sub(m, 18), unpack(COLS))
    if v[3] then table.insert(out, v) end
    low = '(' .. m
  end
end
return out
"""
)

# KEYS[1]: a record. ARGV: P, E, now, hold, purge slice. {} (unknown), or {the state
# found, the record's columns and payload as it now is}.
_CANCEL = (
    _LIB
    + """
P = ARGV[1]
local now = tonumber(ARGV[3])
local r = get_record(KEYS[1])
local out = {}
if r then
  if r.state == 'scheduled' or r.state == 'parked' then
    local new = copy(r)
    new.state, new.updated_ms, new.sweep_ms = 'cancelled', now, nil
    new.expires_ms = math.max(r.due_ms, now) + tonumber(ARGV[4])
    put_record(KEYS[1], ARGV[2], r, new)
  end
  out = {r.state, redis.call('HMGET', KEYS[1], unpack(ALL))}
end
purge_slice(now, tonumber(ARGV[5]))
return out
"""
)

# KEYS[1]: a record. ARGV: P, E, due, message_id, now, sweep, purge slice. As _CANCEL.
_RESCHEDULE = (
    _LIB
    + """
P = ARGV[1]
local now = tonumber(ARGV[5])
local r = get_record(KEYS[1])
local out = {}
if r then
  if r.state == 'scheduled' then
    local new = copy(r)
    new.generation, new.due_ms, new.message_id = r.generation + 1, tonumber(ARGV[3]), ARGV[4]
    new.updated_ms, new.attempts, new.last_error = now, 0, nil
    new.sweep_ms, new.replaced, new.republished = tonumber(ARGV[6]), r.replaced + 1, 0
    put_record(KEYS[1], ARGV[2], r, new)
  end
  out = {r.state, redis.call('HMGET', KEYS[1], unpack(ALL))}
end
purge_slice(now, tonumber(ARGV[7]))
return out
"""
)

# KEYS[1]: the scope's sweep index. ARGV: P, record key prefix, now, limit, purge slice.
# The overdue records' columns and payloads, oldest sweep first (ties: by key).
_OVERDUE = (
    _LIB
    + """
P = ARGV[1]
local now, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
if limit > 0 then
  local keys = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(now), 'LIMIT', 0, limit)
  for _, key in ipairs(keys) do
    local v = redis.call('HMGET', ARGV[2] .. key, unpack(ALL))
    if v[3] then table.insert(out, v) end
  end
end
purge_slice(now, tonumber(ARGV[5]))
return out
"""
)

# KEYS: records. ARGV: P, E, now, purge slice, then (generation, next sweep) per record.
_SWEPT = (
    _LIB
    + """
P = ARGV[1]
local now = tonumber(ARGV[3])
for i, k in ipairs(KEYS) do
  local r = get_record(k)
  local generation = tonumber(ARGV[3 + 2 * i])
  if r and r.generation == generation and r.state == 'scheduled' then
    local new = copy(r)
    new.republished, new.sweep_ms = r.republished + 1, tonumber(ARGV[4 + 2 * i])
    new.updated_ms = now
    put_record(k, ARGV[2], r, new)
  end
end
purge_slice(now, tonumber(ARGV[4]))
return 0
"""
)

# KEYS[1]: the scope's handled index. ARGV: record key prefix, since, sample.
_LATENESS = (
    _LIB
    + """
local sample = tonumber(ARGV[3])
if sample <= 0 then return false end
local keys = redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', ARGV[2], 'LIMIT', 0, sample)
local late = nil
for _, key in ipairs(keys) do
  local v = redis.call('HMGET', ARGV[1] .. key, 'updated_ms', 'due_ms')
  if v[1] then
    local l = tonumber(v[1]) - tonumber(v[2])
    if late == nil or l > late then late = l end
  end
end
if late == nil then return false end
return late
"""
)

# KEYS[1]: a due index. ARGV: (lex min, lex max) per interval. The count of each.
_COUNT = """
local out = {}
for i = 1, #ARGV, 2 do
  table.insert(out, redis.call('ZLEXCOUNT', KEYS[1], ARGV[i], ARGV[i + 1]))
end
return out
"""

# ARGV: P, now, slice. Deletes at most `slice` expired records; how many.
PURGE = (
    _LIB
    + """
P = ARGV[1]
return purge_slice(tonumber(ARGV[2]), tonumber(ARGV[3]))
"""
)

# The library, for the store's scheduled claim and finish scripts
# (rabbit_delay._stores.redis): `check` and `read_update` / `finish` after setting P.
LIB = _LIB


def escape(scope: str) -> str:
    """The scope as a key segment: no `:` in it (and `%` escaped, so it stays one-to-one)."""
    return scope.replace("%", "%25").replace(":", "%3A")


def _enc(ms: int) -> str:
    return f"{ms + _OFFSET:016d}"


def _from(ms: int) -> str:
    """The lex bound `due_ms >= ms`."""
    if ms <= -_OFFSET:
        return "-"
    return "+" if ms >= _DUE_END else "[" + _enc(ms)


def _below(ms: int) -> str:
    """The lex bound `due_ms < ms`."""
    if ms <= -_OFFSET:
        return "-"
    return "+" if ms >= _DUE_END else "(" + _enc(ms)


def _after(due_ms: int, key: str) -> str:
    """The lex bound `(due_ms, key) > cursor`."""
    if due_ms < -_OFFSET:
        return "-"
    return "+" if due_ms >= _DUE_END else "(" + _enc(due_ms) + "|" + key


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: Any) -> int | None:
    return None if value is None else int(value)


def record_of(values: Sequence[Any]) -> ScheduleRecord | None:
    """A record from its HMGET reply (`COLUMNS`, then `PAYLOAD` when there); None when
    there is no record."""
    if values[2] is None:
        return None
    payload = None
    if len(values) > len(COLUMNS) and values[len(COLUMNS)] is not None:
        body, content_type, headers = values[len(COLUMNS) :]
        payload = Payload(
            body if isinstance(body, bytes) else _text(body).encode(),
            _text(content_type) if content_type else "application/octet-stream",
            json.loads(headers) if headers else {},
        )
    error = values[10]
    return ScheduleRecord(
        scope=_text(values[0]),
        key=_text(values[1]),
        generation=int(values[2]),
        state=ScheduleState(_text(values[3])),
        queue=_text(values[4]),
        due_ms=int(values[5]),
        message_id=_text(values[6]),
        created_ms=int(values[7]),
        updated_ms=int(values[8]),
        attempts=int(values[9]),
        last_error=None if error is None else _text(error),
        expires_ms=_number(values[11]),
        sweep_ms=_number(values[12]),
        replaced=int(values[13]),
        dropped=int(values[14]),
        republished=int(values[15]),
        payload=payload,
    )


def _optional(text: str | None) -> str:
    # Lua's `opt`: "" is None, anything else a string after its first character
    return "" if text is None else "=" + text


def _found(reply: Sequence[Any]) -> tuple[ScheduleState | None, ScheduleRecord | None]:
    if not reply:
        return None, None
    return ScheduleState(_text(reply[0])), record_of(reply[1])


class ScheduleScripts:
    """The schedule's scripts, registered on one client (sync or asyncio: redis-py
    registers them alike; a call returns the reply, or an awaitable of it, and loads
    the script again after a NOSCRIPT)."""

    def __init__(self, client: Any) -> None:
        self.place = client.register_script(_PLACE)
        self.lookup = client.register_script(_LOOKUP)
        self.select = client.register_script(_SELECT)
        self.cancel = client.register_script(_CANCEL)
        self.reschedule = client.register_script(_RESCHEDULE)
        self.overdue = client.register_script(_OVERDUE)
        self.swept = client.register_script(_SWEPT)
        self.lateness = client.register_script(_LATENESS)
        self.count = client.register_script(_COUNT)
        self.purge = client.register_script(PURGE)


class ScheduleOps:
    """The `ScheduleBook` operations of one prefix, as programs of script calls."""

    def __init__(self, prefix: str, scripts: ScheduleScripts) -> None:
        self.prefix = prefix
        self.scripts = scripts

    # -- keys (the module docstring's layout; the scripts build the same) ----------------

    def _base(self, scope: str) -> str:
        return f"{self.prefix}sched:{escape(scope)}:"

    def record_key(self, scope: str, key: str) -> str:
        return self._base(scope) + "k:" + key

    def due_key(self, scope: str, state: ScheduleState | None, queue: str | None) -> str:
        name = self._base(scope) + "due:" + ("all" if state is None else state.value)
        return name if queue is None else name + ":" + queue

    # -- the worker's side: the store's scheduled finish script reads these ----------

    @staticmethod
    def update_args(update: Update, now_ms: int) -> list[str | int]:
        """The scope (escaped), then what `read_update` reads."""
        return [
            escape(update.ref.scope),
            update.ref.generation,
            update.finished.value,
            update.retention_ms,
            _optional(update.error),
            "" if update.due_ms is None else update.due_ms,
            "" if update.sweep_ms is None else update.sweep_ms,
            now_ms,
        ]

    def purge_call(self, now_ms: int, slice_rows: int) -> Call:
        return (self.scripts.purge, [], [self.prefix, now_ms, slice_rows])

    # -- ScheduleBook ------------------------------------------------------------------

    def place_many(self, entries: Sequence[Entry], now_ms: int) -> Program[list[Placed]]:
        if not entries:
            return []
        keys: list[str] = []
        args: list[Any] = [self.prefix, now_ms, max(PIGGYBACK, len(entries))]
        for e in entries:
            keys.append(self.record_key(e.scope, e.key))
            headers = _COMPACT.encode(dict(e.payload.headers))
            args += [e.scope, escape(e.scope), e.key, e.queue, e.due_ms, e.message_id]
            args += [e.on_conflict.value, e.sweep_ms, e.payload.body, e.payload.content_type]
            args.append(headers)
        reply = yield (self.scripts.place, keys, args)
        return [
            Placed(Placement(_text(how)), int(generation), _text(message_id), int(due))
            for how, generation, message_id, due in reply
        ]

    def lookup(self, scope: str, key: str) -> Program[ScheduleRecord | None]:
        reply = yield (self.scripts.lookup, [self.record_key(scope, key)], [])
        return record_of(reply)

    def select(self, query: Query) -> Program[list[ScheduleRecord]]:
        low = "-"
        if query.due_after_ms is not None:
            low = _from(query.due_after_ms)
        if query.after is not None and (
            query.due_after_ms is None or query.after[0] >= query.due_after_ms
        ):
            low = _after(*query.after)
        high = "+" if query.due_before_ms is None else _below(query.due_before_ms)
        limit = min(max(query.limit, 1), MAX_PAGE)
        index = self.due_key(query.scope, query.state, query.queue)
        args = [self.record_key(query.scope, ""), low, high, limit]
        reply = yield (self.scripts.select, [index], args)
        return [r for r in map(record_of, reply) if r is not None]

    def cancel(
        self, scope: str, key: str, now_ms: int, hold_ms: int
    ) -> Program[tuple[ScheduleState | None, ScheduleRecord | None]]:
        args = [self.prefix, escape(scope), now_ms, hold_ms, PIGGYBACK]
        return _found((yield (self.scripts.cancel, [self.record_key(scope, key)], args)))

    def reschedule(
        self, scope: str, key: str, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> Program[tuple[ScheduleState | None, ScheduleRecord | None]]:
        args = [self.prefix, escape(scope), due_ms, message_id, now_ms, sweep_ms, PIGGYBACK]
        return _found((yield (self.scripts.reschedule, [self.record_key(scope, key)], args)))

    def overdue(self, scope: str, now_ms: int, limit: int) -> Program[list[ScheduleRecord]]:
        sweep = self._base(scope) + "sweep"
        args = [self.prefix, self.record_key(scope, ""), now_ms, limit, PURGE_SLICE]
        reply = yield (self.scripts.overdue, [sweep], args)
        return [r for r in map(record_of, reply) if r is not None]

    def swept(self, scope: str, items: Sequence[SweptItem], now_ms: int) -> Program[None]:
        if not items:
            return
        keys = [self.record_key(scope, key) for key, _, _ in items]
        args: list[Any] = [self.prefix, escape(scope), now_ms, max(PIGGYBACK, len(items))]
        for _, generation, next_ms in items:
            args += [generation, next_ms]
        yield (self.scripts.swept, keys, args)

    def lateness(self, scope: str, since_ms: int, sample: int) -> Program[int | None]:
        handled = self._base(scope) + "handled"
        args = [self.record_key(scope, ""), since_ms, sample]
        return _number((yield (self.scripts.lateness, [handled], args)))

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> Program[list[int]]:
        if len(edges) < 2:
            return []
        bounds: list[str] = []
        for low, high in itertools.pairwise(edges):
            bounds += [_from(low), _below(high)]
        index = self.due_key(scope, ScheduleState.SCHEDULED, queue)
        reply = yield (self.scripts.count, [index], bounds)
        return [int(n) for n in reply]

    def purge(self, now_ms: int) -> Program[int]:
        """Slices of `PURGE_SLICE` until a slice finds fewer."""
        total = 0
        while True:
            n = int((yield self.purge_call(now_ms, PURGE_SLICE)))
            total += n
            if n < PURGE_SLICE:
                return total


def run_sync(program: Program[T]) -> T:
    """Run `program` on a sync client's scripts."""
    try:
        script, keys, args = next(program)
        while True:
            script, keys, args = program.send(script(keys=keys, args=args))
    except StopIteration as stop:
        result: T = stop.value
        return result


async def run_async(program: Program[T]) -> T:
    """Run `program` on an asyncio client's scripts."""
    try:
        script, keys, args = next(program)
        while True:
            script, keys, args = program.send(await script(keys=keys, args=args))
    except StopIteration as stop:
        result: T = stop.value
        return result


class RedisSchedule:
    """`RedisStore`'s schedule (`ScheduleBook`), on the store's client. Operations raise
    `redis.RedisError`."""

    def __init__(self, ops: ScheduleOps) -> None:
        self._ops = ops

    def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        """See `ScheduleBook.place_many`: one script. Every record key and due time is
        checked before the first write, so an error leaves nothing half-placed."""
        return run_sync(self._ops.place_many(entries, now_ms))

    def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        return run_sync(self._ops.lookup(scope, key))

    def select(self, query: Query) -> list[ScheduleRecord]:
        return run_sync(self._ops.select(query))

    def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return run_sync(self._ops.cancel(scope, key, now_ms, hold_ms))

    def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return run_sync(self._ops.reschedule(scope, key, due_ms, message_id, now_ms, sweep_ms))

    def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        """See `ScheduleBook.overdue`; also purges a slice of expired records."""
        return run_sync(self._ops.overdue(scope, now_ms, limit))

    def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        run_sync(self._ops.swept(scope, items, now_ms))

    def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        return run_sync(self._ops.lateness(scope, since_ms, sample))

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        return run_sync(self._ops.count_due(scope, queue, edges))

    def purge(self, *, now_ms: int) -> int:
        """See `ScheduleBook.purge`: slices of `PURGE_SLICE` records, each one script."""
        return run_sync(self._ops.purge(now_ms))


class AsyncRedisSchedule:
    """`AsyncRedisStore`'s schedule (`AsyncScheduleBook`): `RedisSchedule` on the
    asyncio client."""

    def __init__(self, ops: ScheduleOps) -> None:
        self._ops = ops

    async def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        return await run_async(self._ops.place_many(entries, now_ms))

    async def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        return await run_async(self._ops.lookup(scope, key))

    async def select(self, query: Query) -> list[ScheduleRecord]:
        return await run_async(self._ops.select(query))

    async def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return await run_async(self._ops.cancel(scope, key, now_ms, hold_ms))

    async def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        program = self._ops.reschedule(scope, key, due_ms, message_id, now_ms, sweep_ms)
        return await run_async(program)

    async def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        return await run_async(self._ops.overdue(scope, now_ms, limit))

    async def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        await run_async(self._ops.swept(scope, items, now_ms))

    async def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        return await run_async(self._ops.lateness(scope, since_ms, sample))

    async def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        return await run_async(self._ops.count_due(scope, queue, edges))

    async def purge(self, *, now_ms: int) -> int:
        return await run_async(self._ops.purge(now_ms))
