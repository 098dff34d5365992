"""Message envelope: body encoding and the project's headers, for publish and consume. Pure."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from rabbit_delay import _names as h
from rabbit_delay._errors import DecodeError, EncodeError

JSON = "application/json"
BINARY = "application/octet-stream"
MAX_MESSAGE_ID = 255  # AMQP short string

Body = BaseModel | Mapping[str, Any] | list[Any] | bytes


def encode_body(msg: Body) -> tuple[bytes, str]:
    """(bytes, content type). Models and dicts become JSON; bytes pass unchanged.

    Raises EncodeError for anything else, or a dict that is not JSON-serialisable.
    """
    if isinstance(msg, BaseModel):
        return msg.model_dump_json().encode(), JSON
    if isinstance(msg, bytes | bytearray | memoryview):
        return bytes(msg), BINARY
    if isinstance(msg, Mapping | list):
        try:
            return json.dumps(msg, separators=(",", ":"), allow_nan=False).encode(), JSON
        except (TypeError, ValueError) as exc:
            raise EncodeError(
                f"message is not JSON-serialisable: {exc}; pass a pydantic model or bytes"
            ) from None
    raise EncodeError(
        f"cannot publish a {type(msg).__name__}: pass a pydantic model, a dict or list "
        "(sent as JSON), or bytes"
    )


def new_message_id() -> str:
    return uuid.uuid4().hex


def check_message_id(message_id: str) -> str:
    if (
        not isinstance(message_id, str)
        or not message_id
        or len(message_id.encode()) > MAX_MESSAGE_ID
    ):
        raise EncodeError(
            f"message_id must be a non-empty string of at most {MAX_MESSAGE_ID} bytes, "
            f"got {message_id!r}"
        )
    return message_id


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message ready for the wire; transports only copy these fields."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    content_type: str
    headers: dict[str, object]
    mandatory: bool
    timestamp: int  # seconds, the AMQP `timestamp` property


def strip_broker_headers(headers: Mapping[str, object]) -> dict[str, object]:
    """Drop x-death and x-first/last-death-*: the broker owns them (4.x ignores
    re-published ones)."""
    return {k: v for k, v in headers.items() if not k.startswith(h.BROKER_HEADER_PREFIXES)}


def now_ms() -> int:
    return int(datetime.now(UTC).timestamp() * 1000)


def text_header(value: object) -> str | None:
    """A header read back as text: pika hands strings over as bytes, aiormq as str."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the consumer side reads back from a delivered message."""

    message_id: str | None
    attempt: int
    tier: str | None
    due_at_ms: int | None
    target: str | None
    headers: Mapping[str, object]
    # The quorum queue's count of failed deliveries of this copy (x-delivery-count: on 4.3
    # rejects and lost channels, before 4.3 every requeue); 0 when absent.
    delivery_count: int = 0
    # Earlier deliveries of this message lost while its handler may have run (rd-crashes),
    # and how often this copy was put off behind a running copy (rd-deferrals).
    crashes: int = 0
    deferrals: int = 0

    @classmethod
    def from_headers(cls, message_id: str | None, headers: Mapping[str, object] | None) -> Envelope:
        headers = headers or {}
        try:
            attempt = int(headers.get(h.H_ATTEMPT, 1))  # type: ignore[call-overload]
            due = headers.get(h.H_DUE_AT)
            due_at_ms = int(due) if due is not None else None  # type: ignore[call-overload]
            delivery_count = int(headers.get(h.DELIVERY_COUNT_HEADER, 0))  # type: ignore[call-overload]
            crashes = headers.get(h.H_CRASHES)
            crashes = int(crashes) if crashes is not None else 0  # type: ignore[call-overload]
            deferrals = headers.get(h.H_DEFERRALS)
            deferrals = int(deferrals) if deferrals is not None else 0  # type: ignore[call-overload]
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"malformed rabbit-delay headers: {exc}") from None
        return cls(
            message_id=message_id,
            attempt=max(attempt, 1),
            tier=text_header(headers.get(h.H_TIER)),
            due_at_ms=due_at_ms,
            target=text_header(headers.get(h.H_TARGET)),
            headers=headers,
            delivery_count=max(delivery_count, 0),
            crashes=max(crashes, 0),
            deferrals=max(deferrals, 0),
        )

    def lateness_ms(self, received_ms: int) -> int | None:
        return None if self.due_at_ms is None else received_ms - self.due_at_ms

    @property
    def due_at(self) -> datetime | None:
        return (
            None if self.due_at_ms is None else datetime.fromtimestamp(self.due_at_ms / 1000, UTC)
        )
