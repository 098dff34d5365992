"""Parked messages as `rabbit-delay parked` (and a dashboard) shows them. Pure.

The transport (`rabbit_delay._ops.parked.execute`) peeks the parking lot in queue order
(every message held unacked, then put back in order: nothing is lost or reordered) and
hands the messages here as `rabbit_delay._ops.stored.Stored`, whose `summary()` is the
one reading of the parking headers. Position 0 is the head of the lot, the message parked
first; a page is `limit` messages from position `offset`, so a long lot is read in pages.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from rabbit_delay import _headers as h
from rabbit_delay._durations import iso, iso_ms
from rabbit_delay._errors import ConfigError
from rabbit_delay._ops.replay.rules import resolve_queue
from rabbit_delay._ops.stored import Stored
from rabbit_delay._record import fields_json
from rabbit_delay._topology.model import Topology

# `parked list` shows this many messages unless --limit says otherwise.
DEFAULT_LIMIT = 50


def parking_lot(topology: Topology, queue: str) -> tuple[str, str]:
    """(logical queue, parking-lot name) for `queue`, given by its logical, business or
    parking-lot name. Raises UnknownTargetError for a queue outside the topology."""
    logical = resolve_queue(topology, queue)
    return logical, topology.names.parking_queue(logical)


@dataclass(frozen=True, slots=True)
class ParkedItem:
    """One parked message in a listing: what an operator decides on (no body)."""

    position: int  # 0 = the head of the parking lot
    message_id: str | None
    reason: str | None  # rd-park-reason, or the broker's dead-letter reason
    error_type: str | None
    error_message: str | None
    attempts: int | None
    first_failure: str | None  # ISO-8601 UTC
    last_failure: str | None
    parked_at: str | None  # the last failure, else when the broker dead-lettered it
    original_queue: str | None
    target: str | None

    @classmethod
    def of(cls, position: int, msg: Stored) -> ParkedItem:
        s = msg.summary()
        attempts = s["attempts"]
        return cls(
            position=position,
            message_id=msg.message_id,
            reason=_str(s["park_reason"]),
            error_type=_str(s["error_type"]),
            error_message=_str(s["error_message"]),
            attempts=attempts if isinstance(attempts, int) else None,
            first_failure=_str(s["first_failure"]),
            last_failure=_str(s["last_failure"]),
            parked_at=_str(s["parked_at"]),
            original_queue=_str(s["original_queue"]),
            target=_str(s["target"]),
        )

    def as_json(self) -> dict[str, Any]:
        return asdict(self)  # every field, in order


def _str(value: object) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class ParkedPage:
    """`limit` parked messages from position `offset` of a lot that held `total`."""

    queue: str  # the business queue (logical name)
    parking_queue: str
    total: int  # ready messages in the lot when it was read
    offset: int
    limit: int
    items: tuple[ParkedItem, ...]

    @property
    def next_offset(self) -> int | None:
        """Where the next page starts, None after the last one."""
        end = self.offset + len(self.items)
        return end if self.items and end < self.total else None

    def as_json(self) -> dict[str, Any]:
        return {
            **fields_json(
                self, "queue", "parking_queue", "total", "offset", "limit", "next_offset"
            ),
            "messages": [item.as_json() for item in self.items],
        }


def page(
    queue: str, parking_queue: str, total: int, offset: int, limit: int, messages: Sequence[Stored]
) -> ParkedPage:
    """The page of `messages`, peeked from position `offset` of the lot (in order)."""
    items = tuple(ParkedItem.of(offset + i, msg) for i, msg in enumerate(messages[:limit]))
    return ParkedPage(queue, parking_queue, total, offset, limit, items)


def check_page(offset: int, limit: int) -> None:
    """Raise ConfigError for a page that cannot be read."""
    if offset < 0:
        raise ConfigError(f"offset {offset} is negative: positions count from 0 (the oldest)")
    if limit < 1:
        raise ConfigError(f"limit {limit}: a page holds at least 1 message")


# -- one message in full ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Body:
    """A body as it can be shown: `json` (pretty-printed), `text` (UTF-8, printable) or
    `base64` (anything else: binary, or text with control characters)."""

    encoding: str
    text: str
    size: int  # bytes

    def as_json(self) -> dict[str, Any]:
        return {"encoding": self.encoding, "text": self.text, "size": self.size}


_PRINTABLE_SPACE = frozenset("\n\r\t")


def render_body(body: bytes) -> Body:
    """How a body is shown: pretty JSON if it parses, else its text if it is printable
    UTF-8, else base64 (never raw bytes on a terminal)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return Body("base64", base64.b64encode(body).decode("ascii"), len(body))
    try:
        value = json.loads(text)
    except ValueError:
        pass
    else:
        return Body("json", json.dumps(value, indent=2, ensure_ascii=False), len(body))
    if all(c.isprintable() or c in _PRINTABLE_SPACE for c in text):
        return Body("text", text, len(body))
    return Body("base64", base64.b64encode(body).decode("ascii"), len(body))


def json_safe(value: object) -> Any:
    """A header value as JSON: bytes as text (UTF-8) or {"base64": ...}, times as
    ISO-8601, decimals as strings, tables and arrays recursively."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, datetime):
        return iso(value if value.tzinfo is not None else value.replace(tzinfo=UTC))
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


@dataclass(frozen=True, slots=True)
class ParkedDetail:
    """One parked message in full: its listing, every header, traceback and body."""

    item: ParkedItem
    content_type: str | None
    exchange: str
    routing_key: str
    timestamp: str | None  # the AMQP timestamp property, ISO-8601 UTC
    headers: Mapping[str, Any]  # JSON-safe (json_safe)
    traceback: str | None
    body: Body

    def as_json(self) -> dict[str, Any]:
        return {
            **self.item.as_json(),
            **fields_json(self, "content_type", "exchange", "routing_key", "timestamp"),
            "headers": dict(self.headers),
            "traceback": self.traceback,
            "body": self.body.as_json(),
        }


def detail(position: int, msg: Stored) -> ParkedDetail:
    return ParkedDetail(
        item=ParkedItem.of(position, msg),
        content_type=msg.content_type,
        exchange=msg.exchange,
        routing_key=msg.routing_key,
        timestamp=iso_ms(msg.timestamp * 1000) if msg.timestamp is not None else None,
        headers={str(k): json_safe(v) for k, v in msg.headers.items()},
        traceback=msg.header(h.H_ERROR_TRACEBACK),
        body=render_body(msg.body),
    )


def find(messages: Sequence[Stored], message_id: str) -> list[ParkedDetail]:
    """Every message of the lot (peeked from its head, in order) with this id: usually
    one; a message parked twice (at-least-once) is there twice."""
    return [detail(i, msg) for i, msg in enumerate(messages) if msg.message_id == message_id]


__all__ = [
    "DEFAULT_LIMIT",
    "Body",
    "ParkedDetail",
    "ParkedItem",
    "ParkedPage",
    "check_page",
    "detail",
    "find",
    "json_safe",
    "page",
    "parking_lot",
    "render_body",
]
