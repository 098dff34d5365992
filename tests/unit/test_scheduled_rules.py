"""`rabbit-delay scheduled`'s pure decisions (rabbit_delay._ops.scheduled.rules): the time
options, keys, which schedules can be read from outside, how records and times are shown,
and what a cancel or a reschedule found. The commands themselves, on a real store and
broker: tests/integration/test_cli_scheduled.py."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rabbit_delay import ConfigError, topology_from_dict
from rabbit_delay._ops.scheduled.rules import (
    TIME_FORMS,
    cancel_outcome,
    check_key,
    check_store,
    detail,
    list_row,
    parse_instant,
    relative,
    reschedule_outcome,
    short,
    unknown_key,
    when,
)
from rabbit_delay._schedule.records import Payload, ScheduleRecord, ScheduleState

NOW = 1_796_150_495_995  # 2026-12-01T18:41:35.995Z
MINUTE = 60_000


def record(**changes: object) -> ScheduleRecord:
    fields: dict[str, object] = {
        "scope": "shop.v1",
        "key": "order-42",
        "generation": 2,
        "state": ScheduleState.SCHEDULED,
        "queue": "orders",
        "due_ms": NOW + 5 * MINUTE,
        "message_id": "m-1",
        "created_ms": NOW - MINUTE,
        "updated_ms": NOW,
        "sweep_ms": NOW + 6 * MINUTE,
        "replaced": 1,
    }
    fields.update(changes)
    return ScheduleRecord(**fields)  # type: ignore[arg-type]


# -- times --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-01T18:41:35.995Z", NOW),
        ("2026-12-01T19:41:35.995+01:00", NOW),
        ("2026-12-01T18:41:35Z", NOW - 995),
        ("+10m", NOW + 10 * MINUTE),
        ("-1h", NOW - 60 * MINUTE),
        ("+1h30m", NOW + 90 * MINUTE),
        ("10m", NOW + 10 * MINUTE),
        ("now", NOW),
        (" NOW ", NOW),
    ],
)
def test_a_time_is_iso_with_a_zone_or_a_duration_from_now(text: str, expected: int) -> None:
    assert parse_instant(text, "--due-before", NOW) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("2026-12-05T10:00:00", "has no timezone: add Z (UTC) or an offset such as +01:00"),
        ("2026-12-05", "has no timezone"),
        ("yesterday", "is not a time; give " + TIME_FORMS),
        ("", "is not a time"),
        ("+soon", "is not a duration from now; give " + TIME_FORMS),
        ("-", "is not a duration from now"),
        ("10", "is not a time"),  # a number without a unit
        ("1700000000000", "is not a time"),
    ],
)
def test_a_bad_time_names_the_option_and_the_forms(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_instant(text, "--due-after", NOW)
    message = str(caught.value)
    assert message.startswith(f"--due-after {text!r} ")
    assert words in message


def test_times_are_shown_in_utc_and_how_far_away() -> None:
    assert relative(NOW + 5 * MINUTE, NOW) == "in 5m"
    assert relative(NOW + 5 * MINUTE - 400, NOW) == "in 5m"  # rounded to the second
    assert relative(NOW - 3 * MINUTE, NOW) == "3m ago"
    assert relative(NOW + 999, NOW) == relative(NOW - 999, NOW) == "now"
    assert relative(NOW + 90 * MINUTE + 20_000, NOW) == "in 1h30m"  # minutes past an hour
    assert relative(NOW + 26 * 60 * MINUTE + 1_000, NOW) == "in 1d2h"  # hours past a day
    assert when(NOW + 5 * MINUTE, NOW) == "2026-12-01T18:46:35.995Z (in 5m)"
    assert when(None, NOW) == ""


# -- keys and stores ----------------------------------------------------------------------


def test_a_key_is_non_empty_and_at_most_255_bytes() -> None:
    assert check_key("order-42") == "order-42"
    assert check_key("k" * 255) == "k" * 255
    with pytest.raises(ConfigError, match="KEY is empty"):
        check_key("")
    with pytest.raises(ConfigError, match=r"KEY is 256 bytes long \('kkkk"):
        check_key("k" * 256)
    with pytest.raises(ConfigError, match="key is 256 bytes long"):
        check_key("é" * 128, "key")  # bytes, not characters
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        check_key("bad\udcffkey")
    with pytest.raises(ConfigError) as long:
        check_key("x" * 10_000)
    assert len(str(long.value)) < 200  # the start of the key, not all of it


def test_a_schedule_must_be_readable_from_outside_the_publisher() -> None:
    base = {"namespace": "shop", "tiers": {"1m": "1m"}, "queues": {"orders": {}}}
    with pytest.raises(ConfigError, match=r"has no schedule: add a \[schedule\] table"):
        check_store(topology_from_dict(base))
    memory = topology_from_dict(base | {"schedule": {}, "idempotency": {"store": "memory"}})
    with pytest.raises(ConfigError, match='store = "memory" keeps the schedule inside'):
        check_store(memory)
    check_store(topology_from_dict(base | {"schedule": {}}))  # sqlite: fine


def test_unknown_key_wording() -> None:
    assert unknown_key("k") == "unknown key 'k': never scheduled, or purged after its retention"


# -- records ------------------------------------------------------------------------------


def test_a_record_as_a_row_and_in_full() -> None:
    error = "ValueError: " + "boom " * 30
    r = record(attempts=3, last_error=error)
    row = list_row(r, NOW)
    assert row[:3] == ("order-42", "scheduled", "orders")
    assert row[3] == "2026-12-01T18:46:35.995Z\nin 5m"
    assert row[4:6] == ("2", "3")
    assert len(row[6]) == 60
    assert row[6].endswith("…")
    lines = dict(detail(r, NOW))
    assert lines["state"] == "scheduled"
    assert lines["due"] == "2026-12-01T18:46:35.995Z (in 5m)"
    assert lines["last error"] == error  # in full
    assert lines["swept after"] == "2026-12-01T18:47:35.995Z (in 6m)"
    assert "purged after" not in lines  # a scheduled record is not purged
    assert lines["generations"].startswith("1 replaced, 0 copies dropped")
    assert "body" not in lines  # a listing's record has no payload
    full = record(
        state=ScheduleState.HANDLED,
        sweep_ms=None,
        expires_ms=NOW + 60 * MINUTE,
        payload=Payload(b'{"order": 42}', "application/json"),
    )
    lines = dict(detail(full, NOW))
    assert "swept after" not in lines
    assert lines["purged after"].endswith("(in 1h)")
    assert lines["body"] == "13 bytes (application/json)"
    assert "last error" not in lines


def test_short_keeps_one_line() -> None:
    assert short(None) == ""
    assert short("a\n  b") == "a b"
    assert short("x" * 61, 60) == "x" * 59 + "…"


# -- outcomes -----------------------------------------------------------------------------


def test_what_a_cancel_found() -> None:
    done = cancel_outcome("k", ScheduleState.SCHEDULED)
    assert done.done
    assert done.line.startswith("cancelled k: it was scheduled")
    parked = cancel_outcome("k", ScheduleState.PARKED)
    assert parked.done
    assert "a replay of it is dropped" in parked.line
    handled = cancel_outcome("k", ScheduleState.HANDLED)
    assert not handled.done
    assert handled.line == "k was already handled: nothing to cancel"
    again = cancel_outcome("k", ScheduleState.CANCELLED)
    assert (again.done, again.line) == (False, "k was already cancelled: nothing to do")
    r = record(state=ScheduleState.CANCELLED)
    assert again.as_json(r) == {
        "key": "k",
        "found": "cancelled",
        "cancelled": False,
        "note": "k was already cancelled: nothing to do",
        "record": r.as_dict(),
    }
    assert again.as_json(None)["record"] is None


def test_what_a_reschedule_found() -> None:
    moved = reschedule_outcome("order-42", ScheduleState.SCHEDULED, record(generation=3), NOW)
    assert moved.done
    assert moved.line.startswith(
        "rescheduled order-42: generation 3, due 2026-12-01T18:46:35.995Z (in 5m)"
    )
    for state in (ScheduleState.HANDLED, ScheduleState.CANCELLED, ScheduleState.PARKED):
        refused = reschedule_outcome("order-42", state, record(state=state), NOW)
        assert not refused.done
        assert refused.line.startswith(f"order-42 is {state.value}, not scheduled")
    data = moved.as_json(record(generation=3))
    assert (data["rescheduled"], data["found"], data["record"]["generation"]) == (
        True,
        "scheduled",
        3,
    )


def test_the_times_shown_are_the_instants_given() -> None:
    at = datetime(2026, 12, 1, 18, 46, 35, 995000, tzinfo=UTC)
    assert parse_instant(at.isoformat(), "--at", NOW) == NOW + 5 * MINUTE
