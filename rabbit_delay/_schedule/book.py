"""The schedule's store protocol (`ScheduleBook`), and its store-backed program pieces.

A store that keeps a schedule (memory, SQLite, Redis, PostgreSQL) has a `schedule`
attribute implementing `ScheduleBook` (or `AsyncScheduleBook`), on the same database as
its idempotency records, and a `scheduled_batch` method: the guard's claims and finishes
of a worker's batch with their schedule checks and updates, in one transaction or round
trip (see `rabbit_delay._idempotency.guard`).

Every method is given the caller's clock where the record's times are written; errors of
the backend propagate (the public API maps them to StoreError).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from rabbit_delay._schedule.records import (
    Entry,
    Placed,
    Query,
    ScheduleRecord,
    ScheduleState,
)

T = TypeVar("T")

# (key, generation, next_sweep_ms): a record the sweeper republished.
SweptItem = tuple[str, int, int]


class ScheduleBook(Protocol):
    """The schedule of one store. Synchronous."""

    def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        """Record each delayed publish (`rules.place`), all in one transaction; raises
        when the store fails (then none is recorded)."""
        ...

    def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        """The key's record, payload included; None if unknown (or purged)."""
        ...

    def select(self, query: Query) -> list[ScheduleRecord]:
        """A page of records (no payload), ordered by (due_ms, key)."""
        ...

    def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        """`rules.cancel`, atomically: what was found, and the record as it now is."""
        ...

    def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        """`rules.reschedule`, atomically: what was found, and the new generation's
        record (payload included) when there is one to publish."""
        ...

    def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        """Scheduled records whose `sweep_ms` has passed, payload included, oldest
        sweep first."""
        ...

    def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        """`rules.swept` for each (key, generation, next_sweep_ms)."""
        ...

    def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        """The largest (updated - due) of the records handled since `since_ms`, among
        (at least) the `sample` records finished last; None when there is none. A
        sample, bounded in cost: the sweeper's hint of how late the workers run."""
        ...

    def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        """How many scheduled records (of `queue`, or all) are due in each interval
        [edges[i], edges[i+1]): len(edges) - 1 counts."""
        ...

    def purge(self, *, now_ms: int) -> int:
        """Delete records whose `expires_ms` has passed; how many."""
        ...


class AsyncScheduleBook(Protocol):
    """`ScheduleBook` with coroutine methods (same semantics)."""

    async def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]: ...

    async def lookup(self, scope: str, key: str) -> ScheduleRecord | None: ...

    async def select(self, query: Query) -> list[ScheduleRecord]: ...

    async def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]: ...

    async def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]: ...

    async def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]: ...

    async def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None: ...

    async def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None: ...

    async def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]: ...

    async def purge(self, *, now_ms: int) -> int: ...


class SyncBookAsAsync:
    """An `AsyncScheduleBook` calling a local book (memory) directly, on the loop; or,
    with `executor`, on that thread (SQLite: in turn with the store's group commits)."""

    def __init__(self, book: ScheduleBook, executor: Any = None) -> None:
        self.book = book
        self._executor = executor

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def place_many(self, entries: Sequence[Entry], *, now_ms: int) -> list[Placed]:
        return await self._call(self.book.place_many, entries, now_ms=now_ms)

    async def lookup(self, scope: str, key: str) -> ScheduleRecord | None:
        return await self._call(self.book.lookup, scope, key)

    async def select(self, query: Query) -> list[ScheduleRecord]:
        return await self._call(self.book.select, query)

    async def cancel(
        self, scope: str, key: str, *, now_ms: int, hold_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return await self._call(self.book.cancel, scope, key, now_ms=now_ms, hold_ms=hold_ms)

    async def reschedule(
        self, scope: str, key: str, *, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
    ) -> tuple[ScheduleState | None, ScheduleRecord | None]:
        return await self._call(
            self.book.reschedule,
            scope,
            key,
            due_ms=due_ms,
            message_id=message_id,
            now_ms=now_ms,
            sweep_ms=sweep_ms,
        )

    async def overdue(self, scope: str, *, now_ms: int, limit: int) -> list[ScheduleRecord]:
        return await self._call(self.book.overdue, scope, now_ms=now_ms, limit=limit)

    async def swept(self, scope: str, items: Sequence[SweptItem], *, now_ms: int) -> None:
        await self._call(self.book.swept, scope, items, now_ms=now_ms)

    async def lateness(self, scope: str, *, since_ms: int, sample: int) -> int | None:
        return await self._call(self.book.lateness, scope, since_ms=since_ms, sample=sample)

    async def count_due(self, scope: str, queue: str | None, edges: Sequence[int]) -> list[int]:
        return await self._call(self.book.count_due, scope, queue, edges)

    async def purge(self, *, now_ms: int) -> int:
        return await self._call(self.book.purge, now_ms=now_ms)
