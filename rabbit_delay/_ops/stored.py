"""A message read back from a queue, and what its headers tell an operator. Pure.

Every operation that reads messages (parked, replay, transfer, status, the dashboard)
gets them as `Stored`: from AMQP (`rabbit_delay._ops.queues` builds them from pika's
deliveries). `summary()` is the
one reading of the parking headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rabbit_delay import _headers as h
from rabbit_delay._durations import iso_ms
from rabbit_delay._envelope import text_header


def int_header(value: object) -> int | None:
    """A header read back as a whole number (also given as text), None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = text_header(value)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _epoch_ms(value: object) -> int | None:
    """x-death `time`: a datetime from pika, epoch seconds from the management API."""
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return int(aware.timestamp() * 1000)
    seconds = int_header(value)
    return None if seconds is None else seconds * 1000


@dataclass(frozen=True, slots=True)
class Stored:
    """A message read from a parking lot or the catch-all (basic.get or management API)."""

    body: bytes
    message_id: str | None
    content_type: str | None
    headers: Mapping[str, object] = field(default_factory=dict)
    exchange: str = ""  # the exchange it was last published (or dead-lettered) to
    routing_key: str = ""
    timestamp: int | None = None  # the AMQP `timestamp` property, seconds

    def header(self, name: str) -> str | None:
        return text_header(self.headers.get(name))

    @property
    def first_death(self) -> Mapping[str, object] | None:
        """The most recent x-death entry (the broker puts it first), if dead-lettered."""
        deaths = self.headers.get("x-death")
        if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
            return deaths[0]
        return None

    @property
    def attempt(self) -> int | None:
        return int_header(self.headers.get(h.H_ATTEMPT))

    @property
    def target(self) -> str | None:
        return self.header(h.H_TARGET)

    @property
    def parked_at_ms(self) -> int | None:
        """When the worker parked it, else when the broker dead-lettered it."""
        parked = self.last_failure_ms
        if parked is not None:
            return parked
        death = self.first_death
        return None if death is None else _epoch_ms(death.get("time"))

    @property
    def first_failure_ms(self) -> int | None:
        """When its first attempt failed (the worker's rd-first-failure-at)."""
        return int_header(self.headers.get(h.H_FIRST_FAILURE))

    @property
    def last_failure_ms(self) -> int | None:
        """When its last attempt failed (the worker's rd-last-failure-at)."""
        return int_header(self.headers.get(h.H_LAST_FAILURE))

    @property
    def queued_at_ms(self) -> int | None:
        """When it entered the queue it was read from, as far as the message tells: the
        broker's most recent dead-lettering (a cascade level receives a message from the
        level above), else its AMQP `timestamp` (set by every rabbit-delay publish, in
        whole seconds, so up to 1 s early). None when neither says."""
        death = self.first_death
        dead_lettered = None if death is None else _epoch_ms(death.get("time"))
        if dead_lettered is not None:
            return dead_lettered
        return None if self.timestamp is None else self.timestamp * 1000

    @property
    def park_reason(self) -> str | None:
        """rd-park-reason, or the broker's dead-letter reason (e.g. delivery_limit)."""
        reason = self.header(h.H_PARK_REASON)
        if reason is not None:
            return reason
        death = self.first_death
        return None if death is None else text_header(death.get("reason"))

    def summary(self) -> dict[str, object]:
        """What an operator needs to decide about this message (no body, no traceback)."""
        return {
            "message_id": self.message_id,
            "error_type": self.header(h.H_ERROR_TYPE),
            "error_message": self.header(h.H_ERROR_MESSAGE),
            "attempts": self.attempt,
            "park_reason": self.park_reason,
            "parked_at": iso_ms(self.parked_at_ms),
            "first_failure": iso_ms(self.first_failure_ms),
            "last_failure": iso_ms(self.last_failure_ms),
            "original_queue": self.header(h.H_ORIGINAL_QUEUE),
            "target": self.target or self.routing_key or None,
        }


__all__ = ["Stored", "int_header"]
