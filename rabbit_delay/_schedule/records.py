"""What the schedule keeps and is asked: records, their states, and the store's items.

One record per (scope, key): the key's *current* generation. A publish under a key that
is still scheduled either replaces it (the next generation; the older copy is dropped
when it comes due) or keeps it (nothing is published). Older generations are not kept
as rows: a copy whose generation is below the record's is superseded, whatever became
of it, so one comparison decides (`rules.check`), and a debounced key costs one row.

Times are UTC epoch milliseconds. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class ScheduleState(StrEnum):
    """Where a scheduled message is.

    SCHEDULED: waiting to come due, or being tried (its retries included).
    CANCELLED: `cancel(key)` stopped it; a copy that still arrives is dropped.
    HANDLED: its handler succeeded.
    PARKED: it was parked (its reason in `last_error`); a replay may still run it.
    SUPERSEDED: the answer of `lookup(key, generation=g)` for a generation older than
    the key's current one (never the state of a record itself).
    """

    SCHEDULED = "scheduled"
    CANCELLED = "cancelled"
    HANDLED = "handled"
    PARKED = "parked"
    SUPERSEDED = "superseded"


# States a record itself can be in (SUPERSEDED is a generation's, not a record's).
RECORD_STATES = (
    ScheduleState.SCHEDULED,
    ScheduleState.CANCELLED,
    ScheduleState.HANDLED,
    ScheduleState.PARKED,
)


class OnConflict(StrEnum):
    """What a publish does when its key is already scheduled.

    REPLACE (the default): publish the next generation (reschedule, debounce: the last
    publish wins; the older copy is dropped when it comes due). KEEP: publish nothing
    and answer with the scheduled generation (deduplicate).
    """

    REPLACE = "replace"
    KEEP = "keep"


class Placement(StrEnum):
    """What a keyed publish did."""

    CREATED = (
        "created"  # the key was not scheduled: generation 1 (or the next after a finished one)
    )
    REPLACED = "replaced"  # the key was scheduled: the next generation replaces it
    KEPT = "kept"  # the key was scheduled and on_conflict="keep": nothing was published


def _utc(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


@dataclass(frozen=True, slots=True)
class Payload:
    """What is published again for a record (a sweep, a reschedule): the body, its
    content type and the sender's own headers (JSON values: trace context, yours)."""

    body: bytes
    content_type: str
    headers: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScheduleRecord:
    """A key's current generation, as the store keeps it.

    `due_ms` is when its next attempt is due (its first due time, then each retry's);
    `attempts` the attempts that failed so far; `last_error` the last failure ("Type:
    message") or, once parked, the park reason and error. `expires_ms` is when a
    finished record is purged (None while scheduled); `sweep_ms` when the sweeper
    republishes it if it is still scheduled (None once finished). `replaced` counts the
    generations it superseded, `dropped` the stale or cancelled copies workers dropped,
    `republished` the sweeper's copies. `payload` is None in listings.
    """

    scope: str
    key: str
    generation: int
    state: ScheduleState
    queue: str
    due_ms: int
    message_id: str
    created_ms: int
    updated_ms: int
    attempts: int = 0
    last_error: str | None = None
    expires_ms: int | None = None
    sweep_ms: int | None = None
    replaced: int = 0
    dropped: int = 0
    republished: int = 0
    payload: Payload | None = None

    @property
    def due_at(self) -> datetime:
        due = _utc(self.due_ms)
        assert due is not None
        return due

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the CLI's --json, the dashboard): times as ISO-8601 UTC and ms."""
        out: dict[str, Any] = {
            "key": self.key,
            "generation": self.generation,
            "state": self.state.value,
            "queue": self.queue,
            "due_at": _iso(self.due_ms),
            "due_ms": self.due_ms,
            "message_id": self.message_id,
            "attempts": self.attempts,
            "last_error": self.last_error,
            "created_at": _iso(self.created_ms),
            "updated_at": _iso(self.updated_ms),
            "expires_at": _iso(self.expires_ms),
            "sweep_at": _iso(self.sweep_ms),
            "replaced": self.replaced,
            "dropped": self.dropped,
            "republished": self.republished,
        }
        if self.payload is not None:
            out["content_type"] = self.payload.content_type
            out["body_bytes"] = len(self.payload.body)
        return out


def _iso(ms: int | None) -> str | None:
    at = _utc(ms)
    return None if at is None else at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- what the publisher, the workers and the sweeper hand the store --------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """A delayed publish to record before it is sent."""

    scope: str
    key: str
    queue: str
    due_ms: int
    message_id: str
    payload: Payload
    on_conflict: OnConflict
    sweep_ms: int  # due + grace: when the sweeper may republish it


@dataclass(frozen=True, slots=True)
class Placed:
    """The store's answer to an `Entry`: the generation to publish (or kept), under
    which message_id, due when."""

    placement: Placement
    generation: int
    message_id: str
    due_ms: int


@dataclass(frozen=True, slots=True)
class Ref:
    """The schedule key and generation a delivery carries (rd-key, rd-generation)."""

    scope: str
    key: str
    generation: int
    # The delivery's message_id when its guard key is made of it (the consumer has no
    # `key` function): then the record, which knows its generation's message_id, may
    # hold the delivery's claim instead of a guard row (`rules.claim_on_record`).
    message_id: str | None = None


class Verdict(StrEnum):
    """The schedule's word on a delivery before it is claimed (None: claim as usual)."""

    SUPERSEDED = "superseded"  # a newer generation replaced it: drop it
    CANCELLED = "cancelled"  # its generation was cancelled: drop it
    HANDLED = "handled"  # its generation was handled: a duplicate


class Finished(StrEnum):
    """What a worker records of a scheduled delivery with the guard's finish."""

    HANDLED = "handled"
    PARKED = "parked"
    RETRY = "retry"  # it failed and will be tried again at `due_ms`


@dataclass(frozen=True, slots=True)
class Update:
    """A worker's result for a scheduled delivery, written with the guard's finish."""

    ref: Ref
    finished: Finished
    retention_ms: int  # HANDLED / PARKED: how long the finished record is kept
    error: str | None = None
    due_ms: int | None = None  # RETRY: when the next attempt is due
    sweep_ms: int | None = None  # RETRY: due + grace


@dataclass(frozen=True, slots=True)
class Query:
    """A page of the schedule: ordered by (due_ms, key), after the `after` cursor."""

    scope: str
    queue: str | None = None
    state: ScheduleState | None = None
    due_before_ms: int | None = None
    due_after_ms: int | None = None
    after: tuple[int, str] | None = None  # (due_ms, key) of the last record of the page before
    limit: int = 100


MAX_PAGE = 1_000


@dataclass(frozen=True, slots=True)
class Keeping:
    """What a worker needs of a topology's [schedule]: the scope of its keys, how long
    finished records are kept, and the grace a retry's record is swept after."""

    scope: str
    retention_ms: int
    grace_ms: int
