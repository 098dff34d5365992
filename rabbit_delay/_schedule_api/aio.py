"""The schedule of a topology, for asyncio: `Schedule` with coroutine methods
(docs/schedule.md).

    async with await AsyncPublisher.connect(topology, url) as publisher:
        await publisher.publish_delayed({"order": 42}, "30m", queue="orders", key="order-42")
        await publisher.schedule.cancel("order-42")

What it decides is in `rabbit_delay._schedule.operations`, shared with Schedule.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Self

from rabbit_delay._durations import DurationLike
from rabbit_delay._errors import ConfigError
from rabbit_delay._idempotency.guard import run_async
from rabbit_delay._schedule.operations import SweepResult, cursor_of, superseded_or
from rabbit_delay._schedule.records import ScheduleRecord, ScheduleState
from rabbit_delay._schedule_api.base import ScheduleBase
from rabbit_delay._stores.factory import async_store_from_config
from rabbit_delay._topology.model import Topology

if TYPE_CHECKING:
    from rabbit_delay._aio.publisher import AsyncPublisher


class AsyncSchedule(ScheduleBase):
    """`Schedule` for asyncio: the same calls, awaited; `store` an async store, and
    the publisher an AsyncPublisher (`AsyncPublisher.schedule`)."""

    open_store = staticmethod(async_store_from_config)
    publisher: AsyncPublisher | None

    def __init__(
        self,
        topology: Topology,
        *,
        store: Any = None,
        publisher: AsyncPublisher | None = None,
    ) -> None:
        super().__init__(topology, store=store, publisher=publisher)

    # -- the store -----------------------------------------------------------------------

    async def _call(self, doing: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            raise self._failed(doing, exc) from exc

    async def close(self) -> None:
        """Close the store this schedule opened (none is opened through a publisher)."""
        store, self._own_store = self._own_store, None
        if store is not None:
            self._store = None
            await store.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- reading ----------------------------------------------------------------------------

    async def lookup(self, key: str, *, generation: int | None = None) -> ScheduleRecord | None:
        """The key's record (state, queue, due time, generation, attempts, last error);
        None when the key is unknown (never scheduled, or purged after its retention).
        With `generation`: as that generation sees it (SUPERSEDED for an older one)."""
        key = self.core.key(key)
        record = await self._call(f"looking up {key!r}", self._book().lookup, self.core.scope, key)
        return superseded_or(record, generation)

    async def list(
        self,
        *,
        queue: str | None = None,
        state: ScheduleState | str | None = None,
        due_before: datetime | None = None,
        due_after: datetime | None = None,
        limit: int = 100,
        after: tuple[int, str] | str | None = None,
    ) -> builtins.list[ScheduleRecord]:
        """One page of records in due order (at most `limit`, 1..1000): of one `queue`,
        in one `state`, due before / at or after a time. `after` is the cursor of the
        next page (`next_cursor(page, limit)`): a list never loads the whole table."""
        query = self.core.query(
            queue=queue,
            state=state,
            due_before=due_before,
            due_after=due_after,
            limit=limit,
            after=after,
        )
        return builtins.list(await self._call("listing records", self._book().select, query))

    @staticmethod
    def next_cursor(page: Sequence[ScheduleRecord], limit: int) -> str | None:
        """The `after=` of the page that follows `page` (None: `page` was the last)."""
        return cursor_of(page, limit)

    async def timeline(
        self,
        *,
        queue: str | None = None,
        start: datetime | None = None,
        span: DurationLike = "6h",
        bucket: DurationLike = "15m",
    ) -> builtins.list[tuple[datetime, int]]:
        """How many scheduled messages come due in each `bucket` of the next `span` (from
        `start`, default now): [(bucket start, count)], of one queue or all."""
        self.core.query(queue=queue)  # an unknown queue is refused
        begin = int(start.timestamp() * 1000) if start is not None else self._now()
        edges = self.core.timeline_edges(begin, span, bucket)
        counts = await self._call(
            "counting records", self._book().count_due, self.core.scope, queue, edges
        )
        return [
            (datetime.fromtimestamp(e / 1000, UTC), n) for e, n in zip(edges, counts, strict=False)
        ]

    # -- changing ---------------------------------------------------------------------------

    async def cancel(self, key: str) -> ScheduleState | None:
        """Cancel a scheduled key: its message (and any retry of it) is dropped when it
        comes due, however far away that is. Returns what was found: SCHEDULED (now
        cancelled), HANDLED, PARKED (now cancelled: a replay is dropped too), CANCELLED,
        or None for an unknown key."""
        return await run_async(self.core.cancel(self._book(), key, self._now()))

    async def reschedule(
        self,
        key: str,
        delay: DurationLike | timedelta | None = None,
        *,
        at: datetime | None = None,
    ) -> ScheduleState | None:
        """Move a scheduled key to `delay` from now (or `at`): its next generation is
        recorded and published, and the copy already sent is dropped when it comes due
        (counted and logged, never run). Needs a publisher (`Publisher.schedule`).

        Returns what was found: SCHEDULED (moved), else HANDLED / CANCELLED / PARKED
        or None (unknown), and nothing is published. Raises DelayError for a time in
        the past or one the topology cannot reach; what a publish raises."""
        publisher = self._require_publisher("reschedule")
        now = self._now()
        due = self.core.due_ms(delay, at, now)
        return await run_async(
            self.core.reschedule(self._book(), publisher.publish_outgoing, key, due, now)
        )

    async def sweep(self) -> SweepResult:
        """Republish, now, every record still scheduled past its due time plus the grace
        (more while the workers run late), under its key and generation: what a lost
        buffer, a purged queue or a publish that failed after its record lost. The
        workers run this every `sweep_every` (one at a time); `rabbit-delay reconcile`
        and `rabbit-delay scheduled sweep` run it now."""
        publisher = self._require_publisher("sweep")
        outs, result = await run_async(self.core.sweep(self._book(), self._now()))
        if outs:
            await publisher.publish_outgoing(outs)
        return result

    def _require_publisher(self, doing: str) -> AsyncPublisher:
        if self.publisher is None:
            raise ConfigError(
                f"{doing} publishes: use the schedule of a publisher (AsyncPublisher.schedule)"
            )
        return self.publisher


__all__ = ["AsyncSchedule"]
