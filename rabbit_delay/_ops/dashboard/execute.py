"""The dashboard's broker side, on pika: the same calls `status`, `parked` and `replay`
make, behind one object the HTTP layer (`rabbit_delay._ops.dashboard.server`) is given;
and, for a topology with [schedule], its schedule's store (`Schedule.timeline` and
`Schedule.lookup`, as `rabbit-delay scheduled` reads them).

Each operation opens its own connection (a WSGI server answers from several threads; a
pika connection belongs to one), and every operation on one parking lot holds that lot's
lock: two peeks of one queue at the same time could interleave what they put back (see
`rabbit_delay._ops.queues.REQUEUE_BATCH`), and a replay must not run under a peek. A lot is peeked
whole (which keeps its order) and kept for `every` seconds, so paging through it or
opening a message reads the broker once per refresh interval, not once per page.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass, field
from datetime import UTC, datetime, timedelta

import pika

import rabbit_delay._ops.parked.rules as parked
from rabbit_delay._envelope import now_ms
from rabbit_delay._ops.dashboard.rules import (
    PAST_DUE_CAP,
    TIMELINE_BUCKET_MS,
    TIMELINE_SPAN_MS,
    Poller,
    Timeline,
    timelines,
)
from rabbit_delay._ops.parked.execute import peek_lot, purge_parked
from rabbit_delay._ops.replay.execute import replay_parked
from rabbit_delay._ops.replay.rules import ReplayReport
from rabbit_delay._ops.scheduled.rules import check_store
from rabbit_delay._ops.status.execute import read_status
from rabbit_delay._ops.status.rules import Status
from rabbit_delay._ops.stored import Stored
from rabbit_delay._schedule.records import ScheduleRecord, ScheduleState
from rabbit_delay._schedule_api.sync import Schedule
from rabbit_delay._sync.connection import connected
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.dashboard")
NAME = "rabbit-delay dashboard"


@dataclass(frozen=True, slots=True)
class Lot:
    queue: str  # logical
    parking_queue: str
    messages: tuple[Stored, ...]


@dataclass(eq=False)
class BrokerBackend:
    """What the dashboard reads from and does to the broker: `topology` on the first of
    `urls` that answers; parking lots kept `every` seconds."""

    topology: Topology
    urls: Sequence[str]
    _: KW_ONLY
    every: float
    management_url: str | None = None
    no_management: bool = False
    _lots: dict[str, Poller[Lot]] = field(default_factory=dict, init=False, repr=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict, init=False, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _schedule: Schedule | None = field(default=None, init=False, repr=False)

    # -- status ---------------------------------------------------------------------------

    def read_status(self) -> Status:
        """`rabbit-delay status`, as it reads it. Raises what `read_status` raises."""
        return read_status(
            self.topology,
            self.urls,
            management_url=self.management_url,
            no_management=self.no_management,
            name=NAME,
            recheck_s=0,  # a page refresh does not wait; the next one shows it again
        )

    # -- parking lots -----------------------------------------------------------------------

    def _connection(self) -> AbstractContextManager[pika.BlockingConnection]:
        """A connection of this operation's own (the first of the URLs that answers)."""
        return connected(self.urls, name=NAME)

    def _lock(self, lot: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(lot, threading.Lock())

    def _poller(self, queue: str) -> Poller[Lot]:
        logical, lot = parked.parking_lot(self.topology, queue)  # UnknownTargetError first
        with self._guard:
            poller = self._lots.get(lot)
            if poller is None:

                def read() -> Lot:
                    with self._lock(lot), self._connection() as connection:
                        q, name, messages = peek_lot(connection, self.topology, logical)
                    return Lot(q, name, tuple(messages))

                # Errors are raised to the caller here, not kept: a page needs the lot.
                poller = Poller(read, self.every, errors=())
                self._lots[lot] = poller
        return poller

    def lot(self, queue: str) -> tuple[Lot, int | None]:
        """Every message of `queue`'s lot in order, and when it was read (epoch ms).
        Raises UnknownTargetError, MissingObjectError, BrokerUnavailable, AccessRefused."""
        state = self._poller(queue).get()
        assert state.value is not None
        return state.value, state.read_at_ms

    def parked_page(
        self, queue: str, offset: int, limit: int
    ) -> tuple[parked.ParkedPage, int | None]:
        parked.check_page(offset, limit)
        lot, read_at = self.lot(queue)
        chosen = lot.messages[offset : offset + limit]
        found = parked.page(lot.queue, lot.parking_queue, len(lot.messages), offset, limit, chosen)
        return found, read_at

    def parked_detail(
        self, queue: str, message_id: str
    ) -> tuple[str, int, list[parked.ParkedDetail]]:
        lot, _ = self.lot(queue)
        return lot.parking_queue, len(lot.messages), parked.find(lot.messages, message_id)

    def forget(self, queue: str) -> None:
        """The next look at `queue`'s lot reads it again (an action changed it)."""
        _, lot = parked.parking_lot(self.topology, queue)
        with self._guard:
            poller = self._lots.get(lot)
        if poller is not None:
            poller.invalidate()

    # -- the schedule -----------------------------------------------------------------------

    def _opened_schedule(self) -> Schedule:
        """The topology's schedule, its store opened on first use and kept (the store is
        thread-safe: SQLite serialises its one connection, the network stores pool).
        Raises ConfigError for a topology whose schedule cannot be read from here."""
        with self._guard:
            if self._schedule is None:
                check_store(self.topology)
                self._schedule = Schedule(self.topology)
            return self._schedule

    def read_schedule(self) -> tuple[Timeline, ...]:
        """Per queue, how many scheduled records come due in each bucket of the next
        hours (`Schedule.timeline`), and how many are still scheduled past their due
        time (one page of the list, at most PAST_DUE_CAP). Raises StoreError, ConfigError."""
        schedule = self._opened_schedule()
        start = now_ms()
        at = datetime.fromtimestamp(start / 1000, UTC)
        span, bucket = (
            timedelta(milliseconds=TIMELINE_SPAN_MS),
            timedelta(milliseconds=TIMELINE_BUCKET_MS),
        )
        counts = {
            queue: [
                n for _, n in schedule.timeline(queue=queue, start=at, span=span, bucket=bucket)
            ]
            for queue in self.topology.queues
        }
        late = schedule.list(state=ScheduleState.SCHEDULED, due_before=at, limit=PAST_DUE_CAP)
        return timelines(
            self.topology.queues, counts, late, start_ms=start, bucket_ms=TIMELINE_BUCKET_MS
        )

    def schedule_record(self, key: str) -> ScheduleRecord | None:
        """A key's record (`Schedule.lookup`), None when the key is unknown. Raises
        StoreError, ConfigError."""
        return self._opened_schedule().lookup(key)

    def close(self) -> None:
        """Close the schedule's store, if it was opened."""
        with self._guard:
            schedule, self._schedule = self._schedule, None
        if schedule is not None:
            schedule.close()

    # -- actions --------------------------------------------------------------------------

    def replay(self, queue: str, *, message_id: str | None, tier: str | None) -> ReplayReport:
        """`rabbit-delay replay QUEUE [--tier T]`, or of one message. Raises what
        `replay_parked` raises before moving anything; a failure while moving is in the
        report's `error`."""
        _, lot = parked.parking_lot(self.topology, queue)
        try:
            with self._lock(lot), self._connection() as connection:
                report = replay_parked(
                    connection, self.topology, queue, tier=tier, message_id=message_id
                )
        finally:
            self.forget(queue)
        log.info(
            "replay from %s %s%s: %d moved to %s%s",
            lot,
            f"of message {message_id}" if message_id is not None else "of the whole lot",
            f" through tier {tier}" if tier is not None else " now",
            len(report.moved),
            report.destination,
            f"; stopped: {redact(report.error)}" if report.error else "",
        )
        return report

    def purge(self, queue: str) -> tuple[str, int]:
        """(parking-lot name, messages purged). Raises what `purge_parked` raises."""
        _, lot = parked.parking_lot(self.topology, queue)
        try:
            with self._lock(lot), self._connection() as connection:
                purged = purge_parked(connection, self.topology, queue)
        finally:
            self.forget(queue)
        log.info("purged %d message(s) from %s", purged, lot)
        return lot, purged


__all__ = ["NAME", "BrokerBackend", "Lot"]
