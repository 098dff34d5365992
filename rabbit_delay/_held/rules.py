"""What a holder does with each delivery of the holding queue, and where it connects. Pure.

A holder is an AMQP 1.0 consumer of the holding queue (the [held] backend, RabbitMQ
4.3+). For every delivery it decides, from the message's `rd-due-at` and its own clock:

- not due yet: `Hold(until)`: settle `modified` with the message annotation
  `x-opt-delivery-time = until` (a SYMBOL key: a string key makes 4.3 close the session
  with amqp:internal-error). The quorum queue keeps the message aside, out of the ready
  list, and delivers it again at that time (measured on 4.3.6: 7 s asked, 7.001-7.003 s).
- due: `Release`: settle `modified` with undeliverable-here, which makes the queue
  dead-letter it (at-least-once, routing key kept) to the due exchange, hence to its
  business queue. Nothing is re-published by the client, so nothing is lost between.
- no readable `rd-due-at` (a message published without the contract): released at once,
  never held forever nor dropped.

A redelivery that comes back a little before `rd-due-at` by this clock (the broker's clock
runs ahead of the holder's) is held again until `rd-due-at`: never early by the holder's
clock; the broker, for whom that time has passed, delivers it again at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote, unquote, urlsplit

from rabbit_delay._errors import ConfigError
from rabbit_delay._headers import H_DUE_AT
from rabbit_delay._names import Names

# The message annotation of the `modified` outcome that makes a 4.3 quorum queue hold a
# message until then (absolute, UTC epoch ms). Sent as an AMQP symbol.
DELIVERY_TIME = "x-opt-delivery-time"
# Deliveries a holder takes at once (AMQP link credit): holds are quick settles, so a wide
# window keeps the broker busy without holding messages in the client for long.
DEFAULT_CREDIT = 500


class ReleaseReason(StrEnum):
    DUE = "due"
    NO_DUE_TIME = "no-due-time"


@dataclass(frozen=True, slots=True)
class Hold:
    """Settle `modified` + `x-opt-delivery-time = until_ms`: the queue holds it until then."""

    until_ms: int


@dataclass(frozen=True, slots=True)
class Release:
    """Settle `modified` undeliverable-here: the queue dead-letters it to the due exchange.
    `late_ms` is how far past its due time it is (None without a due time)."""

    reason: ReleaseReason
    late_ms: int | None = None


Decision = Hold | Release


def due_at_of(properties: Mapping[str, object] | None) -> int | None:
    """The message's `rd-due-at` (AMQP 0-9-1 headers arrive as AMQP 1.0
    application-properties), or None when absent or not an integer."""
    value = (properties or {}).get(H_DUE_AT)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return int(value)


def decide(properties: Mapping[str, object] | None, now_ms: int) -> Decision:
    """Hold a delivery until its `rd-due-at`, or release it when that time has come."""
    due = due_at_of(properties)
    if due is None:
        return Release(ReleaseReason.NO_DUE_TIME)
    if due > now_ms:
        return Hold(due)
    return Release(ReleaseReason.DUE, now_ms - due)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an AMQP 1.0 holder connects, read from an `amqp://` / `amqps://` URL (the
    same URLs as the workers': RabbitMQ 4.x serves AMQP 1.0 on the AMQP port)."""

    host: str
    port: int
    user: str
    password: str
    vhost: str
    tls: bool

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def open_hostname(self) -> str:
        """The AMQP 1.0 `open` frame's hostname: RabbitMQ reads the vhost from it."""
        return f"vhost:{self.vhost}"


def endpoint_of(url: str) -> Endpoint:
    """Raises ConfigError for a URL that is not amqp:// or amqps://."""
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        raise ConfigError(f"a holder needs an amqp:// or amqps:// URL, not {parts.scheme!r}")
    tls = parts.scheme == "amqps"
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    return Endpoint(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or (5671 if tls else 5672),
        user=unquote(parts.username) if parts.username is not None else "guest",
        password=unquote(parts.password) if parts.password is not None else "guest",
        vhost=unquote(path) if path else "/",
        tls=tls,
    )


def holding_address(names: Names) -> str:
    """The AMQP 1.0 address of the holding queue (RabbitMQ's v2 address format)."""
    return "/queues/" + quote(names.held_queue(), safe="")
