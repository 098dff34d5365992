"""The idempotency contract: claim results, the store protocols and the guards. Pure."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from rabbit_delay._envelope import now_ms as wall_clock_ms
from rabbit_delay._errors import ConfigError
from rabbit_delay._schedule.book import SyncBookAsAsync
from rabbit_delay._schedule.records import Ref, Update, Verdict
from rabbit_delay._schedule.rules import RECORD_BUSY, RECORD_CLAIMED

DEFAULT_PREFIX = "rabbit-delay:"

Clock = Callable[[], int]

# Batch items: (key, owner) to claim; (key, owner, succeeded) to finish, where True
# completes the key and False releases the claim.
ClaimItem = tuple[str, str]
FinishItem = tuple[str, str, bool]
# The same with the delivery's schedule reference / the schedule update of its result
# (None: a delivery the schedule does not know), for a store that keeps a schedule.
ScheduledClaim = tuple[str, str, Ref | None]
ScheduledFinish = tuple[str, str, bool, Update | None]


class ClaimResult(StrEnum):
    """What a claim found, and so what the worker does with the delivery."""

    CLAIMED = "claimed"  # run the handler
    DONE = "done"  # already handled: ack and skip
    IN_PROGRESS = "in_progress"  # another owner holds a live lease: do not run it now
    CANCELLED = "cancelled"  # a tombstone, or its schedule generation was cancelled: ack and drop
    SUPERSEDED = "superseded"  # a newer generation of its schedule key replaced it: ack and drop


# What the schedule's verdict on a delivery makes of its claim.
VERDICT_RESULT = {
    Verdict.SUPERSEDED: ClaimResult.SUPERSEDED,
    Verdict.CANCELLED: ClaimResult.CANCELLED,
    Verdict.HANDLED: ClaimResult.DONE,
}
# The same, with the claims a record holds (`rules.claim_on_record`): the store's answer
# to a scheduled claim that needs no guard row.
SCHEDULE_RESULT: dict[str, ClaimResult] = {
    **{str(verdict): result for verdict, result in VERDICT_RESULT.items()},
    RECORD_CLAIMED: ClaimResult.CLAIMED,
    RECORD_BUSY: ClaimResult.IN_PROGRESS,
}


class IdempotencyStore(Protocol):
    """Where claims, done-records and tombstones live. Synchronous.

    Times are epoch milliseconds passed in by the caller (a testable clock); a record
    whose `expires_at` is at or before `now_ms` counts as absent. The Redis stores (and
    the PostgreSQL stores by default) ignore `now_ms` and judge by the server's clock,
    the one clock every worker shares. Keys are namespaced by the store's prefix. Errors
    of the backend (`sqlite3.Error`, `redis.RedisError`, `psycopg.Error`) propagate
    unchanged, except from the batch operations, which return them in their slots.
    """

    @property
    def needs_purge(self) -> bool:
        """True when expired rows stay until `purge()`; False when the backend expires them."""
        ...

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        """CLAIMED if free, expired, or already held by `owner` (the lease is renewed);
        DONE / CANCELLED for a live done-record / tombstone; IN_PROGRESS if another
        owner holds a live lease."""
        ...

    def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        """Record `key` done for `retention_ms`; a no-op on a live done-record or tombstone."""
        ...

    def release(self, key: str, owner: str) -> None:
        """Drop `owner`'s claim so a retry can run; a no-op if `owner` no longer holds it."""
        ...

    def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        """Extend `owner`'s claim to `now_ms + lease_ms`; never creates a record.

        True when the record is a claim by `owner`, even one whose lease ran out that
        nobody took over since; False when it was released, completed, cancelled, taken
        over by another owner, or is absent (the handler has lost its lease).
        """
        ...

    def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        """`claim` each (key, owner) in one transaction or round trip, in order.

        A failing item gets its exception in its slot and the others still run; a
        failure of the whole batch (connection lost, database locked) puts the same
        exception in every slot. Backend errors are never raised.
        """
        ...

    def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        """For each (key, owner, succeeded): `complete` when succeeded, else `release`.

        One transaction or round trip; errors into their slots like `claim_many`.
        """
        ...

    def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        """Write a tombstone, overriding a claim or done-record, for `retention_ms`."""
        ...

    def purge(self, *, now_ms: int) -> int:
        """Delete expired claims, done-records and tombstones; returns how many."""
        ...

    def close(self) -> None: ...


class AsyncIdempotencyStore(Protocol):
    """`IdempotencyStore` with coroutine methods (same semantics)."""

    @property
    def needs_purge(self) -> bool: ...

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult: ...

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None: ...

    async def release(self, key: str, owner: str) -> None: ...

    async def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool: ...

    async def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]: ...

    async def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]: ...

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None: ...

    async def purge(self, *, now_ms: int) -> int: ...

    async def close(self) -> None: ...


class SchedulingStore(Protocol):
    """A store that also keeps a schedule (`rabbit_delay._schedule.book`): a worker's
    claims and finishes go with their schedule checks and updates."""

    def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """The finishes, then the claims, in one transaction or round trip.

        A claim with a Ref first asks the schedule (`rules.check`): a superseded or
        cancelled generation is not claimed (SUPERSEDED / CANCELLED, and the record
        counts the dropped copy), a handled one answers DONE; otherwise the key is
        claimed as by `claim`. A finish with an Update writes it (`rules.finish`) with
        the complete or release. Errors go into slots like `claim_many`'s.
        """
        ...


class AsyncSchedulingStore(Protocol):
    async def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]: ...


AnyStore = IdempotencyStore | AsyncIdempotencyStore
_T = TypeVar("_T")
_R = TypeVar("_R")
_Item = TypeVar("_Item", ClaimItem, FinishItem, ScheduledClaim, ScheduledFinish)
_Store = TypeVar("_Store", bound=AnyStore)


# -- calls that tolerate a store written before renew and the batch operations ----------
# (a user's own store): the guards, SyncStoreAsAsync and MemoryStore go through these.
# Written once for sync and async stores, as programs: each yields the store calls to
# make (no arguments) and is sent back what each returned, or the exception it raised;
# `run` makes the calls of a sync store, `run_async` awaits those of an async one.

Call = Callable[[], Any]
StoreProgram = Generator[Call, Any, _T]


class _Running(Generic[_T]):
    """A store program being run: the call it waits for, None once it returned `result`."""

    def __init__(self, program: StoreProgram[_T]) -> None:
        self.program = program
        self.call: Call | None = next(program)
        self.result: _T

    def send(self, outcome: object) -> None:
        """Give the program what its call returned (or the exception it raised)."""
        try:
            self.call = self.program.send(outcome)
        except StopIteration as stop:
            self.call, self.result = None, stop.value


def run(program: StoreProgram[_T]) -> _T:
    """Run `program` against a sync store."""
    running = _Running(program)
    while running.call is not None:
        try:
            outcome = running.call()
        except Exception as exc:
            outcome = exc
        running.send(outcome)
    return running.result


async def run_async(program: StoreProgram[_T]) -> _T:
    """Run `program` against an async store: each call's result is awaited."""
    running = _Running(program)
    while running.call is not None:
        try:
            outcome = await running.call()
        except Exception as exc:
            outcome = exc
        running.send(outcome)
    return running.result


def _raised(outcome: object) -> object:
    """The outcome of a call whose errors propagate: raised when it is one."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def renew_with(
    store: AnyStore, key: str, owner: str, *, now_ms: int, lease_ms: int
) -> StoreProgram[bool]:
    """`renew`; a claim by `owner` stands in for it on a store without renew."""
    renew = getattr(store, "renew", None)
    if renew is None:
        # A re-entrant claim extends the lease too, but unlike renew it would also take
        # a key that is free again: the best such a store can do.
        claim = partial(store.claim, key, owner, now_ms=now_ms, lease_ms=lease_ms)
        return _raised((yield claim)) is ClaimResult.CLAIMED
    return bool(_raised((yield partial(renew, key, owner, now_ms=now_ms, lease_ms=lease_ms))))


def claim_each(
    store: AnyStore, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
) -> StoreProgram[list[ClaimResult | Exception]]:
    """`claim` each (key, owner) by itself; an error goes to its own slot."""
    results: list[ClaimResult | Exception] = []
    for key, owner in items:
        claimed = yield partial(store.claim, key, owner, now_ms=now_ms, lease_ms=lease_ms)
        results.append(claimed)
    return results


def finish_each(
    store: AnyStore, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
) -> StoreProgram[list[Exception | None]]:
    """For each (key, owner, succeeded) by itself: `complete` when succeeded, else
    `release`; None in its slot, or the error."""
    results: list[Exception | None] = []
    for key, owner, succeeded in items:
        if succeeded:
            call = partial(store.complete, key, owner, now_ms=now_ms, retention_ms=retention_ms)
        else:
            call = partial(store.release, key, owner)
        outcome = yield call
        results.append(outcome if isinstance(outcome, Exception) else None)
    return results


def _batch_or_each(
    store: AnyStore,
    operation: str,
    items: Sequence[_Item],
    each: Callable[..., StoreProgram[list[_R | Exception]]],
    **times: int,
) -> StoreProgram[list[_R | Exception]]:
    """The store's batch `operation` over `items` (a failure of the whole batch goes to
    every slot), or `each` item by itself on a store without it."""
    batch = getattr(store, operation, None)
    if batch is None:
        return (yield from each(store, items, **times))
    replies = yield partial(batch, items, **times)
    return [replies] * len(items) if isinstance(replies, Exception) else list(replies)


def claim_many_with(
    store: AnyStore, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
) -> StoreProgram[list[ClaimResult | Exception]]:
    """`claim_many`, or `claim_each` on a store without it."""
    return _batch_or_each(store, "claim_many", items, claim_each, now_ms=now_ms, lease_ms=lease_ms)


def finish_many_with(
    store: AnyStore, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
) -> StoreProgram[list[Exception | None]]:
    """`finish_many`, or `finish_each` on a store without it."""
    return _batch_or_each(
        store, "finish_many", items, finish_each, now_ms=now_ms, retention_ms=retention_ms
    )


class SyncStoreAsAsync:
    """An `AsyncIdempotencyStore` that calls a local store directly, on the event loop.

    Right for the memory and SQLite stores, whose operations take microseconds: a
    thread hop would cost more than the call. The one stall is SQLite's busy wait when
    another process holds the write lock (bounded by the store's busy timeout).
    """

    __slots__ = ("store",)

    def __init__(self, store: IdempotencyStore) -> None:
        self.store = store

    @property
    def needs_purge(self) -> bool:
        return self.store.needs_purge

    async def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        return self.store.claim(key, owner, now_ms=now_ms, lease_ms=lease_ms)

    async def complete(self, key: str, owner: str, *, now_ms: int, retention_ms: int) -> None:
        self.store.complete(key, owner, now_ms=now_ms, retention_ms=retention_ms)

    async def release(self, key: str, owner: str) -> None:
        self.store.release(key, owner)

    async def renew(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> bool:
        return run(renew_with(self.store, key, owner, now_ms=now_ms, lease_ms=lease_ms))

    async def claim_many(
        self, items: Sequence[ClaimItem], *, now_ms: int, lease_ms: int
    ) -> list[ClaimResult | Exception]:
        return run(claim_many_with(self.store, items, now_ms=now_ms, lease_ms=lease_ms))

    async def finish_many(
        self, items: Sequence[FinishItem], *, now_ms: int, retention_ms: int
    ) -> list[Exception | None]:
        return run(finish_many_with(self.store, items, now_ms=now_ms, retention_ms=retention_ms))

    async def cancel(self, key: str, *, now_ms: int, retention_ms: int) -> None:
        self.store.cancel(key, now_ms=now_ms, retention_ms=retention_ms)

    async def purge(self, *, now_ms: int) -> int:
        return self.store.purge(now_ms=now_ms)

    async def close(self) -> None:
        self.store.close()

    @property
    def schedule(self) -> SyncBookAsAsync | None:
        """The wrapped store's schedule, if it keeps one (its book called directly)."""
        book = getattr(self.store, "schedule", None)
        return None if book is None else SyncBookAsAsync(book)

    async def scheduled_batch(
        self,
        finishes: Sequence[ScheduledFinish],
        claims: Sequence[ScheduledClaim],
        *,
        now_ms: int,
        lease_ms: int,
        retention_ms: int,
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        batch = getattr(self.store, "scheduled_batch", None)
        if batch is None:
            raise ConfigError(f"the store {type(self.store).__name__} keeps no schedule")
        result: tuple[list[Exception | None], list[ClaimResult | Exception]] = batch(
            finishes, claims, now_ms=now_ms, lease_ms=lease_ms, retention_ms=retention_ms
        )
        return result


@dataclass
class GuardStats:
    """Counters of claim outcomes, for metrics. Read them; the guard increments them."""

    claimed: int = 0  # CLAIMED, re-entrant claims included (renew() is not counted)
    duplicates_skipped: int = 0  # DONE: a redelivery or duplicate publish of a handled message
    in_progress_deferred: int = 0  # IN_PROGRESS: a copy is being handled elsewhere
    cancelled_dropped: int = 0  # CANCELLED: a tombstone stopped the handler
    superseded_dropped: int = 0  # SUPERSEDED: a newer generation of its key replaced it

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_COUNTER = {
    ClaimResult.CLAIMED: "claimed",
    ClaimResult.DONE: "duplicates_skipped",
    ClaimResult.IN_PROGRESS: "in_progress_deferred",
    ClaimResult.CANCELLED: "cancelled_dropped",
    ClaimResult.SUPERSEDED: "superseded_dropped",
}


def _check_durations(lease_ms: int, retention_ms: int) -> None:
    if lease_ms <= 0:
        raise ConfigError(f"idempotency lease must be positive, got {lease_ms} ms")
    if retention_ms <= 0:
        raise ConfigError(f"idempotency retention must be positive, got {retention_ms} ms")


_EMPTY_KEY = "an idempotency key must be a non-empty string (is message_id missing?)"


def _check_key(key: str) -> None:
    if not key:
        raise ValueError(_EMPTY_KEY)


class _Slots(Generic[_Item]):
    """A batch's items with an empty key answered at once by a ValueError in its slot;
    the rest (`valid`) go to the store, and `fill` puts their outcomes back in order."""

    def __init__(self, items: Sequence[_Item]) -> None:
        self.results: list[Any] = [None] * len(items)
        self.index: list[int] = []
        self.valid: list[_Item] = []
        for i, item in enumerate(items):
            if item[0]:
                self.index.append(i)
                self.valid.append(item)
            else:
                self.results[i] = ValueError(_EMPTY_KEY)

    def fill(self, outcomes: Sequence[Any]) -> list[Any]:
        for i, outcome in zip(self.index, outcomes, strict=True):
            self.results[i] = outcome
        return self.results


class _GuardBase(Generic[_Store]):
    def __init__(
        self, store: _Store, *, lease_ms: int, retention_ms: int, clock: Clock = wall_clock_ms
    ) -> None:
        _check_durations(lease_ms, retention_ms)
        self.store = store
        self.lease_ms = lease_ms
        self.retention_ms = retention_ms
        self.clock = clock
        self.stats = GuardStats()
        # Counters are bumped from worker threads; `+=` on an attribute is not atomic.
        self._stats_lock = threading.Lock()

    def _tombstone_ms(self, retention_ms: int | None) -> int:
        if retention_ms is None:
            return self.retention_ms
        if retention_ms <= 0:
            raise ValueError(f"a tombstone's retention must be positive, got {retention_ms} ms")
        return retention_ms

    def _count(self, result: ClaimResult) -> None:
        name = _COUNTER[result]
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _count_all(self, results: Sequence[ClaimResult | Exception]) -> None:
        with self._stats_lock:
            for result in results:
                if isinstance(result, ClaimResult):
                    name = _COUNTER[result]
                    setattr(self.stats, name, getattr(self.stats, name) + 1)


class Guard(_GuardBase[IdempotencyStore]):
    """A store bound to a lease, a retention and a clock; counts claim outcomes.

    `owner` must identify one handling attempt (a fresh token per delivery, not per
    process): a claim by the same owner is re-entrant and would let two deliveries with
    one owner run together. A long handler keeps its lease with `renew`.

    Raises ConfigError for a lease or retention that is not positive.
    """

    def claim(self, key: str, owner: str) -> ClaimResult:
        """Claim `key` for `owner` before the handler runs.

        Raises ValueError for an empty key; store errors propagate.
        """
        _check_key(key)
        result = self.store.claim(key, owner, now_ms=self.clock(), lease_ms=self.lease_ms)
        self._count(result)
        return result

    def renew(self, key: str, owner: str) -> bool:
        """Extend `owner`'s lease on `key` to a full lease from now, while the handler runs.

        False means the lease is lost (released, done, cancelled, taken over by another
        owner, or gone): another copy may be running. Never creates a claim, except
        through a store without `renew`, where a re-entrant `claim` stands in for it.
        Not counted in `stats`. Raises ValueError for an empty key; store errors
        propagate.
        """
        _check_key(key)
        return run(renew_with(self.store, key, owner, now_ms=self.clock(), lease_ms=self.lease_ms))

    def claim_many(self, items: Sequence[ClaimItem]) -> list[ClaimResult | Exception]:
        """`claim` each (key, owner) of a prefetched batch in one store transaction or
        round trip; one result per item, in order, counted in `stats` like `claim`.

        Never raises: an item with an empty key gets a ValueError in its slot, a store
        error goes to the slots it concerns (every slot when the whole batch failed).
        """
        slots = _Slots(items)
        results = run(
            claim_many_with(self.store, slots.valid, now_ms=self.clock(), lease_ms=self.lease_ms)
        )
        self._count_all(results)
        return slots.fill(results)

    def finish_many(self, items: Sequence[FinishItem]) -> list[Exception | None]:
        """For each (key, owner, succeeded): `done` when succeeded, else `failed`, in one
        store transaction or round trip. None per item that went through, else its
        exception (an empty key: ValueError), like `claim_many`. Never raises.
        """
        slots = _Slots(items)
        results = run(
            finish_many_with(
                self.store, slots.valid, now_ms=self.clock(), retention_ms=self.retention_ms
            )
        )
        return slots.fill(results)

    def finish_and_claim_many(
        self, finishes: Sequence[FinishItem], claims: Sequence[ClaimItem]
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """`finish_many(finishes)` then `claim_many(claims)`, in one store transaction
        where the store can (`SQLiteStore.finish_and_claim_many`: one commit for a
        worker's whole batch), else one after the other. Never raises."""
        combined = getattr(self.store, "finish_and_claim_many", None)
        if combined is None or not finishes or not claims:
            return self.finish_many(finishes), self.claim_many(claims)
        done_slots, claim_slots = _Slots(finishes), _Slots(claims)
        try:
            finished, claimed = combined(
                done_slots.valid,
                claim_slots.valid,
                now_ms=self.clock(),
                lease_ms=self.lease_ms,
                retention_ms=self.retention_ms,
            )
        except Exception as exc:  # a store that breaks the batch contract
            finished = [exc] * len(done_slots.valid)
            claimed = [exc] * len(claim_slots.valid)
        self._count_all(claimed)
        return done_slots.fill(finished), claim_slots.fill(claimed)

    def scheduled_batch(
        self, finishes: Sequence[ScheduledFinish], claims: Sequence[ScheduledClaim]
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """Finishes and claims with their schedule updates and checks, in one store
        transaction or round trip (`SchedulingStore.scheduled_batch`); counted like
        `claim_many`. Never raises."""
        done_slots, claim_slots = _Slots(finishes), _Slots(claims)
        try:
            finished, claimed = self.store.scheduled_batch(  # type: ignore[attr-defined]
                done_slots.valid,
                claim_slots.valid,
                now_ms=self.clock(),
                lease_ms=self.lease_ms,
                retention_ms=self.retention_ms,
            )
        except Exception as exc:
            finished = [exc] * len(done_slots.valid)
            claimed = [exc] * len(claim_slots.valid)
        self._count_all(claimed)
        return done_slots.fill(finished), claim_slots.fill(claimed)

    def batch(
        self, finishes: Sequence[ScheduledFinish], claims: Sequence[ScheduledClaim]
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """A worker's batch: `scheduled_batch` when an item carries a schedule Ref or
        Update, else `finish_and_claim_many`. Never raises."""
        if any(f[3] is not None for f in finishes) or any(c[2] is not None for c in claims):
            return self.scheduled_batch(finishes, claims)
        return self.finish_and_claim_many(
            [(k, o, ok) for k, o, ok, _ in finishes], [(k, o) for k, o, _ in claims]
        )

    def done(self, key: str, owner: str) -> None:
        """The handler succeeded: keep `key` as done for the retention period."""
        self.store.complete(key, owner, now_ms=self.clock(), retention_ms=self.retention_ms)

    def failed(self, key: str, owner: str) -> None:
        """The handler failed: drop the claim so the retry can claim it."""
        self.store.release(key, owner)

    def cancel(self, key: str, *, retention_ms: int | None = None) -> None:
        """Tombstone `key`: when a message with this key arrives, it is dropped unhandled.

        The tombstone must outlive the message's due time (and its retries): pass
        `retention_ms` for a delay longer than the configured retention.
        Raises ValueError for an empty key or a retention that is not positive.
        """
        _check_key(key)
        keep = self._tombstone_ms(retention_ms)
        self.store.cancel(key, now_ms=self.clock(), retention_ms=keep)

    def purge(self) -> int:
        """Delete expired records now; returns how many."""
        return self.store.purge(now_ms=self.clock())


class AsyncGuard(_GuardBase[AsyncIdempotencyStore]):
    """`Guard` over an `AsyncIdempotencyStore`. Raises ConfigError like `Guard`."""

    async def claim(self, key: str, owner: str) -> ClaimResult:
        """See `Guard.claim`. Raises ValueError for an empty key."""
        _check_key(key)
        result = await self.store.claim(key, owner, now_ms=self.clock(), lease_ms=self.lease_ms)
        self._count(result)
        return result

    async def renew(self, key: str, owner: str) -> bool:
        """See `Guard.renew`. Raises ValueError for an empty key."""
        _check_key(key)
        return await run_async(
            renew_with(self.store, key, owner, now_ms=self.clock(), lease_ms=self.lease_ms)
        )

    async def claim_many(self, items: Sequence[ClaimItem]) -> list[ClaimResult | Exception]:
        """See `Guard.claim_many`. Never raises."""
        slots = _Slots(items)
        results = await run_async(
            claim_many_with(self.store, slots.valid, now_ms=self.clock(), lease_ms=self.lease_ms)
        )
        self._count_all(results)
        return slots.fill(results)

    async def finish_many(self, items: Sequence[FinishItem]) -> list[Exception | None]:
        """See `Guard.finish_many`. Never raises."""
        slots = _Slots(items)
        results = await run_async(
            finish_many_with(
                self.store, slots.valid, now_ms=self.clock(), retention_ms=self.retention_ms
            )
        )
        return slots.fill(results)

    async def scheduled_batch(
        self, finishes: Sequence[ScheduledFinish], claims: Sequence[ScheduledClaim]
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `Guard.scheduled_batch`. Never raises."""
        done_slots, claim_slots = _Slots(finishes), _Slots(claims)
        try:
            finished, claimed = await self.store.scheduled_batch(  # type: ignore[attr-defined]
                done_slots.valid,
                claim_slots.valid,
                now_ms=self.clock(),
                lease_ms=self.lease_ms,
                retention_ms=self.retention_ms,
            )
        except Exception as exc:
            finished = [exc] * len(done_slots.valid)
            claimed = [exc] * len(claim_slots.valid)
        self._count_all(claimed)
        return done_slots.fill(finished), claim_slots.fill(claimed)

    async def batch(
        self, finishes: Sequence[ScheduledFinish], claims: Sequence[ScheduledClaim]
    ) -> tuple[list[Exception | None], list[ClaimResult | Exception]]:
        """See `Guard.batch` (without a schedule item: `finish_many`, then `claim_many`).
        Never raises."""
        if any(f[3] is not None for f in finishes) or any(c[2] is not None for c in claims):
            return await self.scheduled_batch(finishes, claims)
        finished = (
            await self.finish_many([(k, o, ok) for k, o, ok, _ in finishes]) if finishes else []
        )
        claimed = await self.claim_many([(k, o) for k, o, _ in claims]) if claims else []
        return finished, claimed

    async def done(self, key: str, owner: str) -> None:
        await self.store.complete(key, owner, now_ms=self.clock(), retention_ms=self.retention_ms)

    async def failed(self, key: str, owner: str) -> None:
        await self.store.release(key, owner)

    async def cancel(self, key: str, *, retention_ms: int | None = None) -> None:
        """See `Guard.cancel`. Raises ValueError for an empty key or a bad retention."""
        _check_key(key)
        keep = self._tombstone_ms(retention_ms)
        await self.store.cancel(key, now_ms=self.clock(), retention_ms=keep)

    async def purge(self) -> int:
        return await self.store.purge(now_ms=self.clock())
