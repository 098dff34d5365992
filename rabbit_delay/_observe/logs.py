"""How rabbit-delay's log records read: the fields of a record about one delivery, and
the two formats `rabbit-delay worker --log-format text|json` writes. Pure (logging
only).

A record about one delivery carries, as `extra=` attributes, `message_id`, `queue`
(the logical name), `attempt` (1 = first) and `tier` (the tier the message came
through; `next_tier` too when it is sent on through another one): `delivery_fields`
builds them, so every call site names them alike. The JSON format writes them as
fields of their own; the text format leaves them in the message, as it always read.

Both formats are redacted (a password in a URL never reaches a log line, whatever
logged it) and stamp records with ISO-8601 UTC times, like everything the CLI prints.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from rabbit_delay._durations import iso_ms
from rabbit_delay._urls import redact

MESSAGE_ID = "message_id"
QUEUE = "queue"
ATTEMPT = "attempt"
TIER = "tier"
NEXT_TIER = "next_tier"
# The extra fields of a record about a delivery, in the order JSON lines show them.
DELIVERY_FIELDS = (MESSAGE_ID, QUEUE, ATTEMPT, TIER, NEXT_TIER)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def delivery_fields(
    queue: str,
    message_id: str | None,
    attempt: int,
    tier: str | None,
    next_tier: str | None = None,
) -> dict[str, Any]:
    """The `extra=` of a log record about one delivery (None fields are left out)."""
    fields: dict[str, Any] = {QUEUE: queue, MESSAGE_ID: message_id, ATTEMPT: attempt}
    if tier is not None:
        fields[TIER] = tier
    if next_tier is not None:
        fields[NEXT_TIER] = next_tier
    return fields


def _utc(record: logging.LogRecord) -> str:
    return iso_ms(int(record.created * 1000))


class TextFormatter(logging.Formatter):
    """`2026-12-02T10:00:00.123Z INFO rabbit_delay.worker: ...`, redacted."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc(record)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: `ts` (ISO-8601 UTC), `level`, `logger`,
    `message`, the delivery fields when the record is about one, and `exc_info` (the
    formatted traceback) when it carries an exception. Every string redacted."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key in DELIVERY_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                data[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            data["exc_info"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            data["exc_info"] = redact(record.exc_text)
        if record.stack_info:
            data["stack_info"] = redact(self.formatStack(record.stack_info))
        # one line per record: json.dumps escapes the newlines of a traceback
        return json.dumps(data, default=lambda v: redact(str(v)), ensure_ascii=False)


__all__ = [
    "ATTEMPT",
    "DELIVERY_FIELDS",
    "MESSAGE_ID",
    "NEXT_TIER",
    "QUEUE",
    "TEXT_FORMAT",
    "TIER",
    "JsonFormatter",
    "TextFormatter",
    "delivery_fields",
]
