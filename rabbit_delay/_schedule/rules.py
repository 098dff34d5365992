"""The schedule's rules: what a keyed publish, a delivery, a worker's result, a cancel,
a reschedule and a sweep do to a key's record. Pure.

The memory store applies these functions as they are; the SQL and Redis stores write
the same rules as statements and scripts, and the store contract tests hold every store
to the memory store's answers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rabbit_delay._schedule.records import (
    Entry,
    Finished,
    Keeping,
    OnConflict,
    Placed,
    Placement,
    Ref,
    ScheduleRecord,
    ScheduleState,
    Update,
    Verdict,
)

if TYPE_CHECKING:
    from rabbit_delay._topology.model import Topology

SCHEDULED = ScheduleState.SCHEDULED


def keeping(topology: Topology) -> Keeping | None:
    """What the workers of `topology` need of its [schedule] (None: it has none)."""
    if topology.schedule is None:
        return None
    return Keeping(topology.names.prefix, topology.schedule_retention_ms(), topology.schedule.grace)


def place(
    existing: ScheduleRecord | None, entry: Entry, now_ms: int
) -> tuple[Placed, ScheduleRecord | None]:
    """A keyed publish: its answer, and the record to write (None: nothing changes).

    A key that is not scheduled (absent, or finished) gets the next generation; one that
    is scheduled is replaced (REPLACE) or kept (KEEP: nothing is published)."""
    if existing is not None and existing.state is SCHEDULED:
        if entry.on_conflict is OnConflict.KEEP:
            kept = Placed(Placement.KEPT, existing.generation, existing.message_id, existing.due_ms)
            return kept, None
        generation = existing.generation + 1
        record = dataclasses.replace(
            existing,
            generation=generation,
            queue=entry.queue,
            due_ms=entry.due_ms,
            message_id=entry.message_id,
            updated_ms=now_ms,
            attempts=0,
            last_error=None,
            sweep_ms=entry.sweep_ms,
            replaced=existing.replaced + 1,
            republished=0,
            payload=entry.payload,
        )
        return Placed(Placement.REPLACED, generation, entry.message_id, entry.due_ms), record
    generation = existing.generation + 1 if existing is not None else 1
    record = ScheduleRecord(
        scope=entry.scope,
        key=entry.key,
        generation=generation,
        state=SCHEDULED,
        queue=entry.queue,
        due_ms=entry.due_ms,
        message_id=entry.message_id,
        created_ms=now_ms,
        updated_ms=now_ms,
        sweep_ms=entry.sweep_ms,
        replaced=existing.replaced if existing is not None else 0,
        dropped=existing.dropped if existing is not None else 0,
        payload=entry.payload,
    )
    return Placed(Placement.CREATED, generation, entry.message_id, entry.due_ms), record


def check(record: ScheduleRecord | None, generation: int) -> Verdict | None:
    """A delivery of `generation` before its claim: drop it (SUPERSEDED, CANCELLED),
    skip it as handled (HANDLED), or None: claim and run it as usual. A key the schedule
    does not know (purged, or recorded elsewhere) runs as usual: the guard still holds."""
    if record is None:
        return None
    return check_state(record.generation, record.state, generation)


def check_state(
    record_generation: int, record_state: ScheduleState, generation: int
) -> Verdict | None:
    """`check` from the record's generation and state alone."""
    if generation > record_generation:
        return None
    if generation < record_generation:
        return Verdict.SUPERSEDED
    if record_state is ScheduleState.CANCELLED:
        return Verdict.CANCELLED
    if record_state is ScheduleState.HANDLED:
        return Verdict.HANDLED
    return None


RECORD_CLAIMED = "claimed"
RECORD_BUSY = "busy"


def claim_on_record(
    record_generation: int,
    record_state: ScheduleState,
    record_message_id: str,
    holder: str | None,
    lease_until_ms: int | None,
    *,
    ref: Ref,
    owner: str,
    now_ms: int,
) -> str | None:
    """Whether a delivery the schedule lets run (`check_state` said None) is claimed on
    its record instead of a guard row: the record as the claim (docs/schedule.md).

    Only the record's own generation, still scheduled, and only when the delivery's
    guard key is made of the record's message_id (`ref.message_id`; a consumer's `key`
    function makes another key: then the guard row decides, as it may deduplicate
    across messages). RECORD_CLAIMED when the
    record is free, its lease ran out, or `owner` holds it already (re-entrant);
    RECORD_BUSY when another owner holds a live lease; None: claim on a guard row."""
    if ref.generation != record_generation or record_state is not SCHEDULED:
        return None
    if ref.message_id is None or ref.message_id != record_message_id:
        return None
    if holder is None or holder == owner or lease_until_ms is None or lease_until_ms <= now_ms:
        return RECORD_CLAIMED
    return RECORD_BUSY


def dropped(record: ScheduleRecord, now_ms: int) -> ScheduleRecord:
    """A stale or cancelled copy was dropped: counted on the record."""
    return dataclasses.replace(record, dropped=record.dropped + 1, updated_ms=now_ms)


def finish(record: ScheduleRecord | None, update: Update, now_ms: int) -> ScheduleRecord | None:
    """A worker's result for its generation (None: nothing changes: another generation
    replaced it, it was cancelled, or the record is gone).

    HANDLED and PARKED finish the record (kept `update.retention_ms`, then purged); RETRY
    counts the failure and moves the due time to the next attempt's. A parked record
    comes back to life when a replayed copy is handled."""
    if record is None or record.generation != update.ref.generation:
        return None
    if record.state not in (SCHEDULED, ScheduleState.PARKED):
        return None
    if update.finished is Finished.HANDLED:
        return dataclasses.replace(
            record,
            state=ScheduleState.HANDLED,
            updated_ms=now_ms,
            expires_ms=now_ms + update.retention_ms,
            sweep_ms=None,
        )
    attempts = record.attempts + 1
    if update.finished is Finished.PARKED:
        return dataclasses.replace(
            record,
            state=ScheduleState.PARKED,
            attempts=attempts,
            last_error=update.error,
            updated_ms=now_ms,
            expires_ms=now_ms + update.retention_ms,
            sweep_ms=None,
        )
    assert update.due_ms is not None
    assert update.sweep_ms is not None
    return dataclasses.replace(
        record,
        state=SCHEDULED,
        attempts=attempts,
        last_error=update.error,
        due_ms=update.due_ms,
        updated_ms=now_ms,
        expires_ms=None,
        sweep_ms=update.sweep_ms,
    )


def cancel(
    record: ScheduleRecord | None, now_ms: int, hold_ms: int
) -> tuple[ScheduleState | None, ScheduleRecord | None]:
    """`cancel(key)`: what was found (None: unknown), and the record to write.

    A scheduled or parked record becomes CANCELLED and is kept until `hold_ms` past its
    due time (or now, if overdue): long enough for the copy and its retries to arrive
    and be dropped. A finished one is left as it is."""
    if record is None:
        return None, None
    found = record.state
    if found not in (SCHEDULED, ScheduleState.PARKED):
        return found, None
    cancelled = dataclasses.replace(
        record,
        state=ScheduleState.CANCELLED,
        updated_ms=now_ms,
        expires_ms=max(record.due_ms, now_ms) + hold_ms,
        sweep_ms=None,
    )
    return found, cancelled


def reschedule(
    record: ScheduleRecord | None, due_ms: int, message_id: str, now_ms: int, sweep_ms: int
) -> tuple[ScheduleState | None, ScheduleRecord | None]:
    """`reschedule(key, ...)`: what was found, and the next generation to write and
    publish (only for a scheduled key; the copy already sent is dropped when it comes)."""
    if record is None:
        return None, None
    if record.state is not SCHEDULED:
        return record.state, None
    moved = dataclasses.replace(
        record,
        generation=record.generation + 1,
        due_ms=due_ms,
        message_id=message_id,
        updated_ms=now_ms,
        attempts=0,
        last_error=None,
        sweep_ms=sweep_ms,
        replaced=record.replaced + 1,
        republished=0,
    )
    return SCHEDULED, moved


def swept(
    record: ScheduleRecord | None, generation: int, next_sweep_ms: int, now_ms: int
) -> ScheduleRecord | None:
    """The sweeper republished `generation`: counted, and not looked at again before
    `next_sweep_ms` (None: the record moved on meanwhile)."""
    if record is None or record.generation != generation or record.state is not SCHEDULED:
        return None
    return dataclasses.replace(
        record, republished=record.republished + 1, sweep_ms=next_sweep_ms, updated_ms=now_ms
    )


# -- the sweeper's timing ----------------------------------------------------------------

# Republishing a record again waits twice as long each time (grace x 2^n), up to this.
MAX_SWEEP_BACKOFF = 6


def effective_grace_ms(grace_ms: int, lateness_ms: int | None) -> int:
    """How far past its due time a record must be before it is republished: the
    configured grace, or three times the lateness the workers show right now (the
    latest handled records'), whichever is longer. A buffer that is merely busy delivers
    late but delivers: its lateness shows in what is handled, and the sweeper waits."""
    if lateness_ms is None or lateness_ms <= 0:
        return grace_ms
    return max(grace_ms, 3 * lateness_ms)


def next_sweep_ms(now_ms: int, grace_ms: int, republished: int) -> int:
    """When a record republished `republished` times (this one included) is looked at
    again, if still scheduled: the grace doubling per republish."""
    return now_ms + grace_ms * (1 << min(max(republished - 1, 0), MAX_SWEEP_BACKOFF))


def hold_ms(topology_retry_span_ms: int, grace_ms: int, lease_ms: int) -> int:
    """How long past its due time a cancelled record is kept: every retry's delay, a
    lease (a copy in a handler), and the grace (lateness, a sweep)."""
    return topology_retry_span_ms + grace_ms + lease_ms


def ref_of(
    scope: str, key: object, generation: object, message_id: str | None = None
) -> Ref | None:
    """The Ref of a delivery's rd-key / rd-generation headers (None: absent or not
    readable: the delivery is handled as an unscheduled one), with the `message_id` its
    guard key is made of, if it is (`Ref.message_id`)."""
    if key is None or generation is None:
        return None
    if isinstance(key, bytes | bytearray):
        key = bytes(key).decode("utf-8", errors="replace")
    if not isinstance(key, str) or not key:
        return None
    try:
        gen = int(generation)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
    if gen < 1:
        return None
    return Ref(scope, key, gen, message_id or None)
