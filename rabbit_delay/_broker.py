"""What the broker at the other end is, what its version really does, and what it
reports about a queue. Pure.

Both transports read the AMQP `connection.start` server properties once per connection
and build a `BrokerInfo`; every rule that differs between RabbitMQ versions is a property
here, so no driver compares version numbers itself.

Facts (checked on 3.10.8, 4.0.5 and 4.3.6; see shared/RABBITMQ_NOTES.md):

    rule                                        3.10   4.0-4.2   4.3+
    basic.nack(requeue) counts towards the      yes    yes       no
      quorum delivery limit
    a quorum queue declared without             none   20        20
      x-delivery-limit has a limit of
    4.x adds x-queue-type=classic to a          no     yes       yes
      classic queue declared without it
    delayed-message plugin can run              yes    yes       no (Mnesia removed)
    quorum delayed retry (x-delayed-retry-*)    no     no        yes
    AMQP 1.0 `modified` + x-opt-delivery-time   no     no        yes
      holds a quorum message until then
    unknown exchange type closes the            conn.  channel   channel
    quorum consumer over consumer_timeout       channel closed   basic.cancel (4.3)
    peeking a quorum tier buffer's head         late   early     free
      (basic.get + nack requeue)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")

Version = tuple[int, int, int]


def parse_version(text: str) -> Version | None:
    """'4.3.6' -> (4, 3, 6); '3.13.0-rc.1' -> (3, 13, 0); None when unreadable."""
    m = _VERSION.match(text.strip())
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def _text(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return "" if value is None else str(value)


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """The broker of one connection. `version` is None when it did not say (another
    AMQP 0-9-1 server): then every rule takes the conservative side."""

    product: str = "RabbitMQ"
    version_text: str = ""
    cluster_name: str = ""
    platform: str = ""

    @classmethod
    def from_server_properties(cls, props: Mapping[str, object] | None) -> BrokerInfo:
        props = props or {}
        return cls(
            product=_text(props.get("product")) or "unknown",
            version_text=_text(props.get("version")),
            cluster_name=_text(props.get("cluster_name")),
            platform=_text(props.get("platform")),
        )

    @property
    def version(self) -> Version | None:
        return parse_version(self.version_text)

    def at_least(self, major: int, minor: int = 0) -> bool:
        v = self.version
        return v is not None and v[:2] >= (major, minor)

    def describe(self) -> str:
        """'RabbitMQ 4.3.6 (cluster rd-43-main@vm, Erlang/OTP 29.1.2)'."""
        extra = ", ".join(
            p
            for p in (
                f"cluster {self.cluster_name}" if self.cluster_name else "",
                self.platform,
            )
            if p
        )
        text = f"{self.product} {self.version_text or '(version unknown)'}"
        return f"{text} ({extra})" if extra else text

    # -- the rules -------------------------------------------------------------------

    @property
    def nack_requeue_counts(self) -> bool:
        """Does `basic.nack(requeue=True)` count towards a quorum queue's delivery limit?

        Only 4.3 stopped counting it (reject and a lost connection still count). When
        unknown, assume it counts: the safe side is never to rely on a free requeue.
        """
        return not self.at_least(4, 3)

    @property
    def default_delivery_limit(self) -> int | None:
        """The `x-delivery-limit` of a quorum queue declared without one: 20 from 4.0
        (past it the broker dead-letters the message, reason delivery_limit), none
        before. When unknown, assume the limit: the safe side."""
        return None if self.version is not None and not self.at_least(4) else 20

    @property
    def quorum_buffer_peek_risk(self) -> str | None:
        """What peeking the head of a quorum tier buffer or cascade level (basic.get, then
        basic.nack with requeue) would cost on this broker; None when nothing.

        Measured: 3.10.8 puts the requeued head of a queue with a TTL behind the others
        (it is then dead-lettered late, when it reaches the head again); 4.0 made 20 the
        default delivery limit, which those queues (no consumers) do not override, and
        counts every requeue (past it, the message is dead-lettered to its destination
        EARLY); 4.3.6 keeps the head in place and does not count a nack.
        """
        if self.at_least(4, 3):
            return None
        if self.at_least(4, 0):
            return (
                "a peek counts towards the buffer's default delivery limit (20) and could "
                "deliver its oldest message early"
            )
        if self.version is not None:
            return "a peek puts the buffer's oldest message back behind the others (late)"
        return "the broker did not say its version"

    @property
    def peeks_quorum_buffers_freely(self) -> bool:
        """Whether the head of a quorum buffer may be peeked (`quorum_buffer_peek_risk`)."""
        return self.quorum_buffer_peek_risk is None

    @property
    def supports_plugin(self) -> bool:
        """Can rabbitmq_delayed_message_exchange run at all? It needs Mnesia, which 4.3
        removed; the plugin was archived in January 2026 and works up to 4.2."""
        return not self.at_least(4, 3)

    @property
    def supports_delayed_retry(self) -> bool:
        """Quorum queue delayed retry (`x-delayed-retry-*` queue arguments), 4.3+."""
        return self.at_least(4, 3)

    @property
    def supports_held(self) -> bool:
        """Does a quorum queue hold a message until the `x-opt-delivery-time` of an AMQP
        1.0 `modified` settle (the [held] backend)? Measured on 4.3.6; not before 4.3."""
        return self.at_least(4, 3)

    @property
    def cancels_timed_out_quorum_consumers(self) -> bool:
        """4.3 cancels (basic.cancel) a quorum consumer over consumer_timeout instead of
        closing its channel; both must be handled, this says which to expect."""
        return self.at_least(4, 3)


UNKNOWN = BrokerInfo(product="unknown")


# Before 4.3, a delivery left unacked past `consumer_timeout` makes the broker close the
# whole channel (checked on the channel tick, about once a minute): "406
# PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value
# used: 1800000 ms ...". 4.3 quorum queues send basic.cancel for that one consumer instead.
_CONSUMER_TIMEOUT = re.compile(r"delivery acknowledgement .*timed out", re.I)


def is_consumer_timeout(reply_text: str) -> bool:
    """Does a channel-close reply say the broker's consumer_timeout expired?"""
    return _CONSUMER_TIMEOUT.search(reply_text) is not None


# -- what the broker reports about a queue -------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """The messages and consumers of one queue, as the broker reports them.

    Two sources fill it: a passive `queue.declare` (live and exact: `ready` and
    `consumers` only; the operations' `_ops.queues`), and the management API (sampled,
    every 5 s by default, so it lags behind the broker: every field it has a figure
    for; `_io.management`). None where the source has no figure (the API for a queue
    just declared, or a field the source never tells).

    From the API only: `unacked`; for a quorum queue its Raft `leader` node, its
    `members` (the nodes holding a replica) and those of them `online`, and
    `dead_lettering`, the messages it dead-lettered (at-least-once) that the target has
    not confirmed yet, in neither ready nor unacked; and `head_timestamp`, the AMQP
    `timestamp` (seconds) of the message at the head, which a classic queue reports
    (`head_message_timestamp`) when that message has one (quorum queues do not, 3.10 to
    4.3); for a 4.3+ quorum queue, `delayed`, its messages held until a given time (the
    [held] backend's holds; not in `ready`, nor in a passive declare's count), and
    `next_delayed_at`, the earliest of those times.
    """

    ready: int | None
    unacked: int | None = None
    consumers: int | None = None
    leader: str | None = None
    members: tuple[str, ...] | None = None
    online: tuple[str, ...] | None = None
    dead_lettering: int | None = None
    head_timestamp: int | None = None
    # A 4.3+ quorum queue's messages held until a given time (the [held] backend, or
    # delayed retry) and the earliest of those times (UTC ms): API only.
    delayed: int | None = None
    next_delayed_at: int | None = None

    @property
    def held(self) -> int:
        """Messages the queue holds: ready, unacked and being dead-lettered (a figure
        the source did not give counts as none)."""
        return (self.ready or 0) + (self.unacked or 0) + (self.dead_lettering or 0)


# -- arguments the broker adds by itself ----------------------------------------------

# RabbitMQ 4.x records `x-queue-type: classic` on a classic queue declared without any
# x-queue-type (and reports it through the management API); 3.x records nothing. Both
# mean the same queue: compare with these defaults filled in on both sides.
QUEUE_ARGUMENT_DEFAULTS: Mapping[str, object] = {"x-queue-type": "classic"}


def normalise_queue_arguments(arguments: Mapping[str, object]) -> dict[str, object]:
    """Queue arguments with the broker's implicit defaults made explicit."""
    return {**QUEUE_ARGUMENT_DEFAULTS, **arguments}


__all__ = [
    "QUEUE_ARGUMENT_DEFAULTS",
    "UNKNOWN",
    "BrokerInfo",
    "QueueCounts",
    "Version",
    "is_consumer_timeout",
    "normalise_queue_arguments",
    "parse_version",
]
