"""What `Schedule` and `AsyncSchedule` do, written once: argument checks, queries, and
the programs of cancel, reschedule and the sweep. Pure.

The programs yield store calls (and the publish of a reschedule) the way the guard's
store programs do (`rabbit_delay._idempotency.guard.run` / `run_async`): the sync
facade makes the calls, the async one awaits them. A store's error comes back as
StoreError; a publish's error as it is (PublishError, BrokerError).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from rabbit_delay._durations import DurationLike, format_ms, iso, parse_ms
from rabbit_delay._envelope import Outgoing, new_message_id
from rabbit_delay._errors import (
    ConfigError,
    DelayError,
    DurationError,
    RabbitDelayError,
    StoreError,
)
from rabbit_delay._schedule import rules
from rabbit_delay._schedule.messages import check_key, republished
from rabbit_delay._schedule.records import (
    MAX_PAGE,
    RECORD_STATES,
    Query,
    ScheduleRecord,
    ScheduleState,
)
from rabbit_delay._topology.delays import Router
from rabbit_delay._topology.model import DEFAULT_LEASE_MS, Topology

if TYPE_CHECKING:
    from rabbit_delay._idempotency.guard import StoreProgram

# The lateness of the records handled in this window sets the sweeper's grace.
LATENESS_WINDOW_MS = 600_000
LATENESS_SAMPLE = 1_000
MAX_TIMELINE_BUCKETS = 500


def _ok(outcome: Any, doing: str) -> Any:
    """A store call's outcome, or StoreError naming what failed."""
    if isinstance(outcome, RabbitDelayError):
        raise outcome
    if isinstance(outcome, Exception):
        raise StoreError(
            f"the schedule's store failed {doing}: {type(outcome).__name__}: {outcome}"
        ) from outcome
    return outcome


def _ms_of(value: datetime | int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigError(f"{name}={value.isoformat()} has no timezone: pass an aware datetime")
        return int(value.timestamp() * 1000)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be an aware datetime (or epoch ms), got {value!r}")


@dataclass
class SweepResult:
    """One sweep: how far past their due time records had to be (`grace_ms`: the
    configured grace, or more while the workers run late), the workers' recent
    lateness it was chosen from, and the records republished."""

    grace_ms: int
    lateness_ms: int | None
    republished: list[str] = field(default_factory=list)  # keys
    message_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "grace_ms": self.grace_ms,
            "lateness_ms": self.lateness_ms,
            "republished": list(self.republished),
        }


class ScheduleCore:
    """The schedule of one topology: what both facades decide.

    Raises ConfigError for a topology without a [schedule] table."""

    def __init__(self, topology: Topology, *, lease_ms: int | None = None) -> None:
        if topology.schedule is None:
            raise ConfigError(
                f"the topology {topology.names.prefix!r} has no schedule: add a [schedule] "
                "table (docs/schedule.md)"
            )
        self.topology = topology
        self.config = topology.schedule
        self.router = Router(topology)
        self.scope = topology.names.prefix
        self.lease_ms = lease_ms if lease_ms is not None else topology.idempotency.lease

    # -- arguments ----------------------------------------------------------------------

    def key(self, key: object) -> str:
        return check_key(key)

    def hold_ms(self) -> int:
        """How long past its due time a cancelled record is kept: the longest retry span
        of the topology's queues, a lease and the grace (`rules.hold_ms`)."""
        span = max(self.topology.retry_span_ms(q) for q in self.topology.queues)
        return rules.hold_ms(span, self.config.grace, self.lease_ms)

    def query(
        self,
        *,
        queue: str | None = None,
        state: ScheduleState | str | None = None,
        due_before: datetime | int | None = None,
        due_after: datetime | int | None = None,
        limit: int = 100,
        after: tuple[int, str] | str | None = None,
    ) -> Query:
        """A page's query. Raises ConfigError for an unknown queue or state, a limit
        outside 1..1000, a naive datetime or a malformed cursor."""
        if queue is not None and queue not in self.topology.queues:
            known = ", ".join(sorted(self.topology.queues))
            raise ConfigError(f"unknown queue {queue!r}; the topology has: {known}")
        chosen: ScheduleState | None = None
        if state is not None:
            try:
                chosen = ScheduleState(state)
            except ValueError:
                names = ", ".join(s.value for s in RECORD_STATES)
                raise ConfigError(f"unknown state {state!r}; states are: {names}") from None
            if chosen is ScheduleState.SUPERSEDED:
                raise ConfigError(
                    "no record is superseded: a record is its key's newest generation"
                )
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise ConfigError(f"limit must be a whole number from 1 to {MAX_PAGE}, got {limit!r}")
        return Query(
            self.scope,
            queue,
            chosen,
            _ms_of(due_before, "due_before"),
            _ms_of(due_after, "due_after"),
            parse_cursor(after),
            limit,
        )

    def due_ms(self, delay: DurationLike | timedelta | None, at: datetime | None, now: int) -> int:
        """The due time of `delay` from `now`, or `at`. Raises DelayError."""
        if (delay is None) == (at is None):
            raise DelayError("give either a delay (e.g. '10m') or at= (an aware datetime)")
        if at is not None:
            due = _ms_of(at, "at")
            assert due is not None
            if due <= now:
                raise DelayError(f"at={iso(at)} is {format_ms(now - due)} in the past")
            return due
        try:
            ms = parse_ms(delay)  # type: ignore[arg-type]
        except DurationError as exc:
            raise DelayError(str(exc)) from None
        if ms <= 0:
            raise DelayError(f"a reschedule needs a delay above 0, got {format_ms(ms)}")
        return now + ms

    def timeline_edges(self, start_ms: int, span: DurationLike, bucket: DurationLike) -> list[int]:
        """The edges of a timeline from `start_ms`: `span` in buckets of `bucket`."""
        try:
            span_ms, bucket_ms = parse_ms(span), parse_ms(bucket)
        except DurationError as exc:
            raise ConfigError(str(exc)) from None
        if span_ms <= 0 or bucket_ms <= 0:
            raise ConfigError("a timeline's span and bucket must be positive")
        count = -(-span_ms // bucket_ms)
        if count > MAX_TIMELINE_BUCKETS:
            raise ConfigError(
                f"{count} buckets: at most {MAX_TIMELINE_BUCKETS} "
                "(a longer bucket, or a shorter span)"
            )
        return [start_ms + i * bucket_ms for i in range(count + 1)]

    # -- programs -------------------------------------------------------------------------

    def cancel(self, book: Any, key: str, now: int) -> StoreProgram[ScheduleState | None]:
        found, _record = _ok(
            (
                yield partial(
                    book.cancel, self.scope, check_key(key), now_ms=now, hold_ms=self.hold_ms()
                )
            ),
            f"cancelling {key!r}",
        )
        return found  # type: ignore[no-any-return]

    def reschedule(
        self, book: Any, publish: Callable[[list[Outgoing]], Any], key: str, due: int, now: int
    ) -> StoreProgram[ScheduleState | None]:
        """Write the next generation of a scheduled `key`, due at `due`, then publish it
        (the copy already sent is dropped when it comes due). What was found."""
        key = check_key(key)
        record = _ok((yield partial(book.lookup, self.scope, key)), f"looking up {key!r}")
        if record is None or record.state is not ScheduleState.SCHEDULED:
            return None if record is None else record.state
        queue_key = self._queue_key(record)
        self.router.resolve_remaining(queue_key, due - now)  # DelayError before any write
        found, moved = _ok(
            (
                yield partial(
                    book.reschedule,
                    self.scope,
                    key,
                    due_ms=due,
                    message_id=new_message_id(),
                    now_ms=now,
                    sweep_ms=due + self.config.grace,
                )
            ),
            f"rescheduling {key!r}",
        )
        if found is ScheduleState.SCHEDULED and moved is not None:
            out = republished(moved, self.router, queue_key, now, due_ms=due)
            sent = yield partial(publish, [out])
            if isinstance(sent, Exception):
                raise sent  # recorded: the sweeper publishes it if this publish was lost
        return found  # type: ignore[no-any-return]

    def sweep(self, book: Any, now: int) -> StoreProgram[tuple[list[Outgoing], SweepResult]]:
        """The overdue records (past due + grace, more while the workers run late),
        marked swept (the next look waits twice as long), and their messages to publish
        to their queues now (under their message_id, key and generation: the guard
        absorbs a copy that was only late)."""
        since = now - max(LATENESS_WINDOW_MS, 10 * self.config.sweep_every)
        late = _ok(
            (yield partial(book.lateness, self.scope, since_ms=since, sample=LATENESS_SAMPLE)),
            "sampling lateness",
        )
        grace = rules.effective_grace_ms(self.config.grace, late)
        # a record's sweep_ms is due + the configured grace; wait the rest of `grace`
        cutoff = now - (grace - self.config.grace)
        records: Sequence[ScheduleRecord] = _ok(
            (yield partial(book.overdue, self.scope, now_ms=cutoff, limit=self.config.sweep_batch)),
            "listing overdue records",
        )
        result = SweepResult(grace, late)
        outs: list[Outgoing] = []
        swept: list[tuple[str, int, int]] = []
        for record in records:
            if record.payload is None or record.queue not in self.topology.queues:
                continue  # a queue no longer in the topology: nothing to publish it to
            out = republished(record, self.router, self._queue_key(record), now)
            outs.append(out)
            swept.append(
                (
                    record.key,
                    record.generation,
                    rules.next_sweep_ms(now, grace, record.republished + 1),
                )
            )
            result.republished.append(record.key)
            result.message_ids.append(out.message_id)
        if swept:
            _ok((yield partial(book.swept, self.scope, swept, now_ms=now)), "marking records swept")
        return outs, result

    def _queue_key(self, record: ScheduleRecord) -> str:
        if record.queue not in self.topology.queues:
            raise ConfigError(
                f"schedule key {record.key!r} is for queue {record.queue!r}, which the topology "
                f"{self.scope!r} no longer has"
            )
        return self.topology.names.queue_key(record.queue)


def parse_cursor(after: tuple[int, str] | str | None) -> tuple[int, str] | None:
    """A page cursor: (due_ms, key), or its text form "due_ms:key" (the CLI's)."""
    if after is None or isinstance(after, tuple):
        return after
    due, sep, key = str(after).partition(":")
    if not sep or not due.lstrip("-").isdigit() or not key:
        raise ConfigError(f"malformed cursor {after!r}: give the `next` value of the previous page")
    return int(due), key


def cursor_of(records: Sequence[ScheduleRecord], limit: int) -> str | None:
    """The cursor of the page after `records` (None: it was the last)."""
    if len(records) < limit or not records:
        return None
    last = records[-1]
    return f"{last.due_ms}:{last.key}"


def superseded_or(record: ScheduleRecord | None, generation: int | None) -> ScheduleRecord | None:
    """`record` as seen by one generation: SUPERSEDED for an older one."""
    if record is None or generation is None or generation == record.generation:
        return record
    if generation < record.generation:
        return dataclasses.replace(record, state=ScheduleState.SUPERSEDED)
    return None


__all__ = ["DEFAULT_LEASE_MS", "ScheduleCore", "SweepResult", "cursor_of", "parse_cursor"]
