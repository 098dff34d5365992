"""Messages on the wire: what every outgoing message is built by, and how a delivered one
is read back. Pure.

Built here and only here: `outgoing(route, ...)` is every message sent through a delay
(a publish, a retry or deferral, a replay, a transfer, a reconciliation, an outbox row):
its route, body, headers, due times and attempt; `forward(...)` is a stored copy sent on
as it is (to a parking lot, or a catch-all message rerouted). `with_trace_context` puts
a publish span's W3C trace context into the messages that carry none. `Envelope` is
what a consumer reads back (attempt, due time, crash and deferral counts)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

import rabbit_delay._headers as h
from rabbit_delay._errors import DecodeError, EncodeError

if TYPE_CHECKING:
    from rabbit_delay._topology.delays import Route

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
    # The schedule key to record it under before it is sent (a topology with [schedule]:
    # a publish's `key=`, else its message_id), and whether a scheduled key is kept
    # (on_conflict="keep") rather than replaced. None: not recorded (a worker's copy).
    key: str | None = None
    keep: bool = False


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
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def traceparent_of(headers: Mapping[str, object] | None) -> str | None:
    """The W3C traceparent a message carries, or None."""
    return text_header(headers.get(h.H_TRACEPARENT)) if headers else None


def outgoing(
    route: Route,
    body: bytes,
    content_type: str,
    now: int,
    message_id: str | None = None,
    headers: Mapping[str, object] | None = None,
    attempt: int = 1,
    due_at: int | None = None,
    requested_ms: int | None = None,
) -> Outgoing:
    """The message to send on `route`, at `now` (UTC epoch ms). `due_at` keeps a due time
    fixed earlier (a moved pending message, a relayed outbox row; default: now + the
    route's delay), `requested_ms` the delay first asked for (default: the route's).

    `rd-asked-due-at` is the due time asked for: now + the delay asked (before the
    cascade rounds it up); with a fixed `due_at`, the one its headers carry (the
    first publish's), else `due_at` itself. Raises EncodeError for a bad message_id."""
    all_headers: dict[str, object] = dict(headers) if headers else {}
    all_headers.update(route.headers)
    if due_at is None:
        all_headers[h.H_DUE_AT] = now + route.delay_ms
        all_headers[h.H_ASKED_DUE_AT] = now + route.asked_delay_ms
    else:
        all_headers[h.H_DUE_AT] = due_at
        carried = all_headers.get(h.H_ASKED_DUE_AT)
        if isinstance(carried, int) and not isinstance(carried, bool) and carried <= due_at:
            all_headers[h.H_ASKED_DUE_AT] = int(carried)  # pika's `long` subclass, as int
        else:
            all_headers[h.H_ASKED_DUE_AT] = due_at
    all_headers[h.H_DELAY_MS] = requested_ms if requested_ms is not None else route.delay_ms
    all_headers[h.H_TIER] = route.tier
    all_headers[h.H_ATTEMPT] = attempt
    all_headers[h.H_TARGET] = route.target
    message_id = check_message_id(message_id) if message_id is not None else new_message_id()
    return Outgoing(
        exchange=route.exchange_for(message_id),  # a sharded tier: the id's shard
        routing_key=route.routing_key,
        body=body,
        message_id=message_id,
        content_type=content_type,
        headers=all_headers,
        mandatory=route.mandatory,
        timestamp=now // 1000,
    )


def forward(
    exchange: str,
    routing_key: str,
    body: bytes,
    content_type: str | None,
    message_id: str | None,
    headers: dict[str, object],
    timestamp_s: int,
) -> Outgoing:
    """A stored copy sent on as it is, with `headers` (a parked message, a catch-all
    message rerouted): mandatory, because a parking lot or a queue that is not bound
    must fail loudly, not drop it."""
    return Outgoing(
        exchange=exchange,
        routing_key=routing_key,
        body=body,
        message_id=message_id or new_message_id(),
        content_type=content_type or BINARY,
        headers=headers,
        mandatory=True,
        timestamp=timestamp_s,
    )


def with_trace_context(outs: Sequence[Outgoing], carrier: Mapping[str, str]) -> list[Outgoing]:
    """`outs`, each one that carries no traceparent given the trace headers of `carrier`
    (a publish span's context); a message that carries one keeps its own (a retry, a
    forwarded message: every attempt stays in the publisher's trace)."""
    if h.H_TRACEPARENT not in carrier:
        return list(outs)
    return [
        o
        if h.H_TRACEPARENT in o.headers
        else dataclasses.replace(o, headers={**o.headers, **carrier})
        for o in outs
    ]


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
