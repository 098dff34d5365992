"""The schedule as `rabbit-delay scheduled` and the dashboard ask for it and show it. Pure.

Times given on the command line are ISO-8601 with a timezone or a duration from now
(`+10m`, `-1h`), read into epoch milliseconds here; times shown are ISO-8601 UTC with how
far away they are ("in 5m", "3m ago"). A key is checked before any store is opened or
any broker reached. What a cancel or a reschedule found becomes one line and whether it
did what was asked (the exit code's business: `rabbit_delay._cli.scheduled`).

The records, their states and `as_dict()` are `rabbit_delay._schedule.records`; the
store calls and the publishes are `rabbit_delay.sync.Schedule`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rabbit_delay._durations import format_ms, iso_ms, parse_ms
from rabbit_delay._errors import ConfigError, DurationError
from rabbit_delay._schedule.messages import MAX_KEY
from rabbit_delay._schedule.operations import ScheduleCore
from rabbit_delay._schedule.records import ScheduleRecord, ScheduleState
from rabbit_delay._topology.model import Topology

# What a time option accepts, named in every refusal.
TIME_FORMS = (
    "an ISO-8601 time with a timezone (2026-12-05T10:00:00Z, 2026-12-05T11:00:00+01:00), "
    "a duration from now (+10m, -1h, +1h30m; 10m is +10m) or now"
)
# `scheduled list` shows this many records unless --limit says otherwise.
DEFAULT_LIST_LIMIT = 50
# A last error in a table: this many characters, then an ellipsis.
ERROR_WIDTH = 60


# -- arguments --------------------------------------------------------------------------


def parse_instant(text: str, option: str, now_ms: int) -> int:
    """`text` as epoch ms: ISO-8601 with a timezone, or a duration from `now_ms`
    (`+10m`, `-1h`, a bare `10m` is `+10m`), or `now`. Raises ConfigError naming
    `option` and the accepted forms (a naive time is refused: which zone would it be?)."""
    value = text.strip()
    if value.lower() == "now":
        return now_ms
    if value[:1] in ("+", "-"):
        sign = -1 if value[0] == "-" else 1
        try:
            return now_ms + sign * parse_ms(value[1:])
        except DurationError:
            raise ConfigError(
                f"{option} {text!r} is not a duration from now; give {TIME_FORMS}"
            ) from None
    try:
        return now_ms + parse_ms(value)
    except DurationError:
        pass
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"{option} {text!r} is not a time; give {TIME_FORMS}") from None
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigError(
            f"{option} {text!r} has no timezone: add Z (UTC) or an offset such as +01:00 "
            "(2026-12-05T10:00:00Z), or give a duration from now (+10m, -1h)"
        )
    return math.floor(at.timestamp() * 1000)


def check_key(key: str, name: str = "KEY") -> str:
    """A schedule key as given (on the command line, in the dashboard's search box): a
    non-empty string of at most 255 bytes of UTF-8. Raises ConfigError saying which
    rule it breaks (never echoing more than the start of a long key)."""
    if not key:
        raise ConfigError(
            f"{name} is empty: a schedule key is a non-empty string of at most {MAX_KEY} bytes"
        )
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigError(f"{name} {key[:40]!r} is not valid UTF-8 text") from None
    if size > MAX_KEY:
        raise ConfigError(
            f"{name} is {size} bytes long ({key[:32]!r}...): a schedule key is at most "
            f"{MAX_KEY} bytes (UTF-8)"
        )
    return key


def check_store(topology: Topology) -> None:
    """Refuse a topology whose schedule cannot be read from outside the process that
    publishes: one without [schedule], or with the memory store. Raises ConfigError."""
    ScheduleCore(topology)  # no [schedule]: ConfigError, saying to add one
    if topology.idempotency.store == "memory":
        raise ConfigError(
            '[idempotency] store = "memory" keeps the schedule inside the process that '
            "publishes: nothing else (this command, the dashboard) can read it; use "
            'store = "sqlite", "redis" or "postgres"'
        )


def unknown_key(key: str) -> str:
    """The one wording of a key the schedule does not know."""
    return f"unknown key {key!r}: never scheduled, or purged after its retention"


# -- showing ----------------------------------------------------------------------------


def _coarse(ms: int) -> int:
    """`ms` rounded to what a person reads: hours past a day, minutes past an hour,
    else seconds."""
    step = 3_600_000 if ms >= 86_400_000 else 60_000 if ms >= 3_600_000 else 1_000
    return round(ms / step) * step


def relative(at_ms: int, now_ms: int) -> str:
    """How far `at_ms` is from `now_ms`: "in 5m", "3m ago", "now" (within a second)."""
    diff = at_ms - now_ms
    if abs(diff) < 1_000:
        return "now"
    text = format_ms(_coarse(abs(diff)))
    return f"in {text}" if diff > 0 else f"{text} ago"


def when(at_ms: int | None, now_ms: int) -> str:
    """An instant as ISO-8601 UTC and how far away it is; "" for None."""
    if at_ms is None:
        return ""
    return f"{iso_ms(at_ms)} ({relative(at_ms, now_ms)})"


def short(text: str | None, width: int = ERROR_WIDTH) -> str:
    """One line of at most `width` characters ("" for None)."""
    if not text:
        return ""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


LIST_COLUMNS = ("key", "state", "queue", "due", "gen", "attempts", "last error")


def list_row(record: ScheduleRecord, now_ms: int) -> tuple[str, ...]:
    """A record as a row of `scheduled list` (LIST_COLUMNS); its due time on two lines,
    ISO-8601 UTC then how far away, so that the table fits a terminal."""
    return (
        record.key,
        record.state.value,
        record.queue,
        f"{iso_ms(record.due_ms)}\n{relative(record.due_ms, now_ms)}",
        str(record.generation),
        str(record.attempts),
        short(record.last_error),
    )


def detail(record: ScheduleRecord, now_ms: int) -> list[tuple[str, str]]:
    """A record in full, as (label, value) lines: `scheduled show` and the dashboard's
    key page. Times that do not apply (a finished record's sweep) are left out."""
    lines = [
        ("state", record.state.value),
        ("queue", record.queue),
        ("due", when(record.due_ms, now_ms)),
        ("generation", str(record.generation)),
        ("attempts", str(record.attempts)),
    ]
    if record.last_error:
        lines.append(("last error", record.last_error))
    lines += [
        ("message id", record.message_id),
        ("created", when(record.created_ms, now_ms)),
        ("updated", when(record.updated_ms, now_ms)),
    ]
    if record.sweep_ms is not None:
        lines.append(("swept after", when(record.sweep_ms, now_ms)))
    if record.expires_ms is not None:
        lines.append(("purged after", when(record.expires_ms, now_ms)))
    lines.append(
        (
            "generations",
            f"{record.replaced} replaced, {record.dropped} copies dropped, "
            f"{record.republished} republished by the sweeper",
        )
    )
    if record.payload is not None:
        body = len(record.payload.body)
        lines.append(("body", f"{body} bytes ({record.payload.content_type})"))
    return lines


# -- what a change found ------------------------------------------------------------------


# The JSON field that says whether a cancel / a reschedule did what was asked.
CANCELLED_FIELD = "cancelled"
RESCHEDULED_FIELD = "rescheduled"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What `cancel` or `reschedule` found for a key that exists (`found`), whether it
    did what was asked (`done`, the JSON field `field`), and the line that says so."""

    key: str
    found: ScheduleState
    done: bool
    line: str
    field: str

    def as_json(self, record: ScheduleRecord | None) -> dict[str, Any]:
        """`{"key", "found", <field>: done, "note", "record"}` (the record as it is now)."""
        return {
            "key": self.key,
            "found": self.found.value,
            self.field: self.done,
            "note": self.line,
            "record": record.as_dict() if record is not None else None,
        }


def cancel_outcome(key: str, found: ScheduleState) -> Outcome:
    """What `cancel(key)` found: a scheduled or parked key is now cancelled (done); a
    handled or cancelled one is left as it was (not an error: it will not run again)."""
    if found is ScheduleState.SCHEDULED:
        line = f"cancelled {key}: it was scheduled; its message is dropped when it comes due"
        return Outcome(key, found, True, line, CANCELLED_FIELD)
    if found is ScheduleState.PARKED:
        line = (
            f"cancelled {key}: it was parked; a replay of it is dropped (the parked message "
            "stays in its parking lot until it is purged)"
        )
        return Outcome(key, found, True, line, CANCELLED_FIELD)
    if found is ScheduleState.HANDLED:
        line = f"{key} was already handled: nothing to cancel"
        return Outcome(key, found, False, line, CANCELLED_FIELD)
    line = f"{key} was already cancelled: nothing to do"
    return Outcome(key, found, False, line, CANCELLED_FIELD)


def reschedule_outcome(
    key: str, found: ScheduleState, record: ScheduleRecord | None, now_ms: int
) -> Outcome:
    """What `reschedule(key, ...)` found: a scheduled key moved (done: its next
    generation and due time from `record`); any other state is left as it was."""
    if found is ScheduleState.SCHEDULED:
        moved = (
            f"generation {record.generation}, due {when(record.due_ms, now_ms)}"
            if record is not None
            else "moved"
        )
        return Outcome(
            key,
            found,
            True,
            f"rescheduled {key}: {moved}; the copy already sent is dropped when it comes due",
            RESCHEDULED_FIELD,
        )
    return Outcome(
        key,
        found,
        False,
        f"{key} is {found.value}, not scheduled: nothing was moved (only a scheduled key "
        "can be rescheduled; publish it again under its key to schedule it anew)",
        RESCHEDULED_FIELD,
    )


__all__ = [
    "CANCELLED_FIELD",
    "DEFAULT_LIST_LIMIT",
    "ERROR_WIDTH",
    "LIST_COLUMNS",
    "RESCHEDULED_FIELD",
    "TIME_FORMS",
    "Outcome",
    "cancel_outcome",
    "check_key",
    "check_store",
    "detail",
    "list_row",
    "parse_instant",
    "relative",
    "reschedule_outcome",
    "short",
    "unknown_key",
    "when",
]
