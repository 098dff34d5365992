"""Operations on pika: replay parked and unroutable messages, count queues, peek.

The core (`rabbit_delay.replay`) decides what each copy looks like; this module moves
one message at a time: basic.get, publish the copy (confirmed, mandatory), and only
then ack the original. A failed publish nacks the original back into its queue and
stops the run. A crash between the confirm and the ack leaves the message in both
places: at-least-once, and the message_id is kept, so the idempotency guard drops the
second copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay.errors import ManagementUnavailable, MissingObjectError, RabbitDelayError
from rabbit_delay.management import peek_messages
from rabbit_delay.message import Outgoing, now_ms
from rabbit_delay.replay import Leave, ParkedReplay, Stored, UnroutableReplay
from rabbit_delay.sync._errors import CLIENT_ERRORS, mapped, translate
from rabbit_delay.sync.publisher import Publisher
from rabbit_delay.topology import Topology
from rabbit_delay.urls import ManagementEndpoint, redact

# A dry run lists at most this many messages (the management API returns them in one
# answer; basic.get holds them all unacked until the end).
PREVIEW_MAX = 1000
VIA_API = "management API (get, requeue)"
VIA_AMQP = "basic.get, then requeue"
# What stops a replay run (reported in ReplayReport.error, never raised).
_FAILURES: tuple[type[BaseException], ...] = (*CLIENT_ERRORS, RabbitDelayError)


@dataclass(frozen=True, slots=True)
class PassiveCounts:
    """What a passive queue.declare tells, live: ready messages and consumers."""

    ready: int
    consumers: int


@dataclass(frozen=True, slots=True)
class Moved:
    message_id: str
    exchange: str
    routing_key: str


@dataclass
class ReplayReport:
    """What a replay did. `error` is set when it stopped on a failure (the message that
    failed is back in `source`); everything in `moved` was confirmed, then acked."""

    source: str
    destination: str
    moved: list[Moved] = field(default_factory=list)
    left: list[tuple[str | None, str]] = field(default_factory=list)  # (message_id, why)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _passive(connection: pika.BlockingConnection, queue: str) -> PassiveCounts | None:
    """Counts of `queue`, or None when it does not exist. A 404 closes the channel, so
    each probe gets its own."""
    with mapped(f"checking queue {queue!r} (passive declare)"):
        try:
            channel = connection.channel()
            ok = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return None
            raise
        method = ok.method
        counts = PassiveCounts(method.message_count or 0, method.consumer_count or 0)
        channel.close()
    return counts


def passive_counts(
    connection: pika.BlockingConnection, queues: Iterable[str]
) -> dict[str, PassiveCounts | None]:
    """Live ready-message and consumer counts per queue (None: the queue does not exist).

    Raises ConnectionLost when the connection goes away, AccessRefused / BrokerError
    when the broker refuses a probe for another reason.
    """
    return {queue: _passive(connection, queue) for queue in queues}


def require_queue(
    connection: pika.BlockingConnection,
    queue: str,
    what: str,
    *,
    unchanged: str = "nothing was replayed",
) -> PassiveCounts:
    """Live counts of `queue`; MissingObjectError naming it (`what`) and saying that
    `unchanged` when it does not exist. Raises ConnectionLost or AccessRefused."""
    counts = _passive(connection, queue)
    if counts is None:
        raise MissingObjectError(
            f"{what} {queue!r} does not exist; run `rabbit-delay declare` ({unchanged})"
        )
    return counts


def _stored(
    method: pika.spec.Basic.GetOk, props: pika.spec.BasicProperties | None, body: bytes | str | None
) -> Stored:
    if props is None:
        props = pika.spec.BasicProperties()
    return Stored(
        body=body.encode() if isinstance(body, str) else (body or b""),
        message_id=props.message_id,
        content_type=props.content_type,
        headers=dict(props.headers or {}),
        exchange=method.exchange or "",
        routing_key=method.routing_key or "",
        timestamp=props.timestamp,
    )


def peek(
    connection: pika.BlockingConnection, queue: str, count: int, *, skip: int = 0
) -> list[Stored]:
    """Up to `count` messages of `queue` from position `skip` (0: the head), all put
    back when done, in their order.

    basic.get holding each message unacked (so the next get returns the next one; the
    `skip` first are read and held too), then one multiple nack with requeue: the
    broker puts them back as they were (checked on 3.10 and 4.3:
    tests/integration/test_parked.py). Raises MissingObjectError when the queue does not
    exist, ConnectionLost or AccessRefused.
    """
    require_queue(connection, queue, "queue", unchanged="nothing was read")
    found: list[Stored] = []
    held = 0
    # Whatever was held unacked goes back to the queue with the channel, if it is lost.
    with mapped(f"peeking at queue {queue!r}", permission="read"):
        channel = connection.channel()
        try:
            for _ in range(skip + count):
                method, props, body = channel.basic_get(queue, auto_ack=False)
                if method is None:
                    break
                held += 1
                if held > skip:
                    found.append(_stored(method, props, body))
        finally:
            if channel.is_open:
                if held:
                    # A multiple nack: RabbitMQ 4.3 does not count it towards a delivery limit.
                    channel.basic_nack(0, multiple=True, requeue=True)
                channel.close()
    return found


@dataclass(frozen=True, slots=True)
class Previewed:
    message: Stored
    action: str  # "exchange [routing key]", or why it would be left in place
    moves: bool


@dataclass(frozen=True, slots=True)
class Preview:
    """What a replay would do, read without consuming anything."""

    source: str
    destination: str
    held: int  # ready messages in `source` at the start
    via: str
    messages: tuple[Previewed, ...]


def _peek_any(
    connection: pika.BlockingConnection,
    endpoint: ManagementEndpoint | None,
    queue: str,
    count: int,
) -> tuple[list[Stored], str]:
    """Peek through the management API when it answers (nothing held on a channel),
    else through basic.get."""
    if count <= 0:
        return [], VIA_API if endpoint is not None else VIA_AMQP
    if endpoint is not None:
        try:
            items = peek_messages(endpoint, queue, count)
            return [Stored.from_management(item) for item in items], VIA_API
        except ManagementUnavailable:
            pass
    return peek(connection, queue, count), VIA_AMQP


def preview_parked(
    connection: pika.BlockingConnection,
    topology: Topology,
    queue: str,
    *,
    tier: str | None = None,
    limit: int | None = None,
    endpoint: ManagementEndpoint | None = None,
) -> Preview:
    """What `replay_parked` would move, changing nothing (every message is put back).

    Raises what `replay_parked` raises before moving anything, so a dry run fails where
    the real run would.
    """
    plan = ParkedReplay(topology, queue, tier)
    held = require_queue(connection, plan.parking_queue, "parking lot")
    require_queue(connection, plan.business_queue, "business queue")
    count = min(held.ready if limit is None else min(limit, held.ready), PREVIEW_MAX)
    found, via = _peek_any(connection, endpoint, plan.parking_queue, count)
    now = now_ms()
    rows = []
    for msg in found:
        out = plan.outgoing(msg, now)
        rows.append(Previewed(msg, f"{out.exchange} [{out.routing_key}]", True))
    return Preview(plan.parking_queue, plan.destination, held.ready, via, tuple(rows))


def preview_unroutable(
    connection: pika.BlockingConnection,
    topology: Topology,
    *,
    queue: str | None = None,
    limit: int | None = None,
    endpoint: ManagementEndpoint | None = None,
) -> Preview:
    """What `replay_unroutable` would do with the head of the catch-all, changing nothing."""
    plan = UnroutableReplay(topology, queue)
    held = require_queue(connection, plan.catch_all, "catch-all queue")
    found, via = _peek_any(connection, endpoint, plan.catch_all, min(held.ready, PREVIEW_MAX))
    reroute = _Rerouter(connection, plan)
    rows = []
    moving = 0
    for msg in found:
        out = reroute(msg)
        if isinstance(out, str):
            rows.append(Previewed(msg, f"left: {out}", False))
        elif limit is not None and moving >= limit:
            rows.append(Previewed(msg, "left: beyond --limit", False))
        else:
            moving += 1
            rows.append(Previewed(msg, f"{out.exchange} [{out.routing_key}]", True))
    return Preview(plan.catch_all, "original targets", held.ready, via, tuple(rows))


Progress = Callable[[Moved], None]


def replay_parked(
    connection: pika.BlockingConnection,
    topology: Topology,
    queue: str,
    *,
    tier: str | None = None,
    limit: int | None = None,
    progress: Progress | None = None,
) -> ReplayReport:
    """Move messages from `queue`'s parking lot back to the business queue, as first
    attempts: at once (tier None) or after `tier`.

    Replays at most `limit` messages, and never more than the parking lot held at the
    start (a message parked again during the run waits for the next one).

    Raises UnknownTargetError / DelayError for a bad queue or tier, MissingObjectError
    when the parking lot or the business queue does not exist (nothing is moved: a
    due message for a missing queue would only land in the catch-all). A failure while
    moving is reported in `ReplayReport.error`.
    """
    plan = ParkedReplay(topology, queue, tier)
    held = require_queue(connection, plan.parking_queue, "parking lot")
    require_queue(connection, plan.business_queue, "business queue")
    budget = held.ready if limit is None else min(limit, held.ready)
    report = ReplayReport(plan.parking_queue, plan.destination)
    if budget <= 0:
        return report

    def build(msg: Stored) -> Outgoing | str:
        return plan.outgoing(msg, now_ms())

    _move(connection, topology, plan.parking_queue, budget, budget, build, report, progress)
    return report


class _Rerouter:
    """The copy of one catch-all message, or why it stays (its queue is checked too)."""

    def __init__(self, connection: pika.BlockingConnection, plan: UnroutableReplay) -> None:
        self.connection = connection
        self.plan = plan
        self.exists: dict[str, bool] = {}

    def __call__(self, msg: Stored) -> Outgoing | str:
        decision = self.plan.decide(msg, now_ms())
        if isinstance(decision, Leave):
            return decision.reason
        names = self.plan.topology.names
        wanted = [
            names.parking_queue(q) if decision.to_parking else names.business_queue(q)
            for q in decision.queues
        ]
        for name in wanted:
            if name not in self.exists:
                self.exists[name] = _passive(self.connection, name) is not None
        missing = [name for name in wanted if not self.exists[name]]
        if missing:
            # The due exchange's alternate exchange is the catch-all: a copy for a missing
            # queue would be "confirmed" straight back into it.
            return f"queue {', '.join(missing)} does not exist"
        return decision.outgoing


def replay_unroutable(
    connection: pika.BlockingConnection,
    topology: Topology,
    *,
    queue: str | None = None,
    limit: int | None = None,
    progress: Progress | None = None,
) -> ReplayReport:
    """Re-route catch-all messages to their original target (see rabbit_delay.replay).

    Messages whose target is not in the topology, or whose queue does not exist on
    the broker, are left in the catch-all (listed in `ReplayReport.left`). With
    `queue`, only messages headed for that queue are moved.
    """
    plan = UnroutableReplay(topology, queue)
    held = require_queue(connection, plan.catch_all, "catch-all queue")
    report = ReplayReport(plan.catch_all, "original targets")
    moved_max = held.ready if limit is None else min(limit, held.ready)
    if moved_max <= 0:
        return report
    reroute = _Rerouter(connection, plan)
    _move(connection, topology, plan.catch_all, held.ready, moved_max, reroute, report, progress)
    return report


def _move(
    connection: pika.BlockingConnection,
    topology: Topology,
    source: str,
    gets: int,
    moved_max: int,
    build: Callable[[Stored], Outgoing | str],
    report: ReplayReport,
    progress: Progress | None,
) -> None:
    """basic.get up to `gets` messages from `source`; publish what `build` makes of each
    (a str: leave it, for that reason) until `moved_max` were moved."""
    channel: BlockingChannel | None = None
    publisher: Publisher | None = None
    held = 0  # messages got and not yet settled on `channel`
    try:
        channel = connection.channel()
        publisher = Publisher(topology, connection=connection, window=1)
        for _ in range(gets):
            if len(report.moved) >= moved_max:
                break
            method, props, body = channel.basic_get(source, auto_ack=False)
            if method is None:
                break
            held += 1
            tag: int = method.delivery_tag or 0
            msg = _stored(method, props, body)
            out = build(msg)
            if isinstance(out, str):
                # Held unacked, so the next get returns the next message; put back at the end.
                report.left.append((msg.message_id, out))
                continue
            try:
                publisher.publish_outgoing((out,))
            except RabbitDelayError as exc:
                channel.basic_nack(tag, multiple=False, requeue=True)
                held -= 1
                report.error = (
                    f"message {msg.message_id} could not be re-published to {out.exchange!r} "
                    f"[{out.routing_key}]: {exc}. It is back in {source!r}; stopped after "
                    f"{len(report.moved)} message(s)"
                )
                break
            channel.basic_ack(tag)
            held -= 1
            moved = Moved(out.message_id, out.exchange, out.routing_key)
            report.moved.append(moved)
            if progress is not None:
                progress(moved)
    except _FAILURES as exc:
        # Unsettled messages go back to the queue (nacked below, or with the channel).
        error = translate(exc, doing=f"moving messages from {source!r}", permission="read")
        report.error = (
            f"stopped after {len(report.moved)} message(s): {redact(str(error))}; "
            f"the message in flight is back in {source!r}"
        )
    finally:
        if publisher is not None:
            with contextlib.suppress(*CLIENT_ERRORS, RabbitDelayError):
                publisher.close()
        if channel is not None and channel.is_open:
            with contextlib.suppress(*CLIENT_ERRORS):
                if held:
                    # One multiple nack: RabbitMQ 4.3 does not count it towards a delivery
                    # limit (a message left in place is not a failed delivery).
                    channel.basic_nack(0, multiple=True, requeue=True)
                channel.close()


__all__ = [
    "Moved",
    "PassiveCounts",
    "Preview",
    "Previewed",
    "ReplayReport",
    "passive_counts",
    "peek",
    "preview_parked",
    "preview_unroutable",
    "replay_parked",
    "replay_unroutable",
    "require_queue",
]
