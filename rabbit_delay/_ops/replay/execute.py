"""Operations on pika: replay parked and unroutable messages, count queues, peek.

The core (`rabbit_delay._ops.replay.rules`) decides what each copy looks like; this module moves
one message at a time: basic.get, publish the copy (confirmed, mandatory), and only
then ack the original. A failed publish nacks the original back into its queue and
stops the run. A crash between the confirm and the ack leaves the message in both
places: at-least-once, and the message_id is kept, so the idempotency guard drops the
second copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay._envelope import Outgoing, now_ms
from rabbit_delay._errors import MissingObjectError, RabbitDelayError
from rabbit_delay._ops.replay.rules import Leave, ParkedReplay, Stored, UnroutableReplay
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact
from rabbit_delay.sync._errors import CLIENT_ERRORS, mapped, translate
from rabbit_delay.sync._publisher import Publisher

# A dry run lists at most this many messages (it reads them all: see `peek`).
PREVIEW_MAX = 1000
# How a dry run reads: over AMQP (`peek`), nothing lost or reordered. Not through the
# management API: its get with requeue puts more than 32 messages back out of order,
# and any number behind messages requeued before (see REQUEUE_BATCH).
VIA_AMQP = "basic.get (or a consumer), then requeue in order"
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

    def as_json(self) -> dict[str, Any]:
        """What `replay --json` prints (and the dashboard answers)."""
        return {
            "dry_run": False,
            "ok": self.ok,
            "source": self.source,
            "destination": self.destination,
            "moved": len(self.moved),
            "message_ids": [m.message_id for m in self.moved],
            "left": [{"message_id": mid, "reason": why} for mid, why in self.left],
            "error": self.error,
        }


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
    method: pika.spec.Basic.GetOk | pika.spec.Basic.Deliver,
    props: pika.spec.BasicProperties | None,
    body: bytes | str | None,
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


# How a quorum queue puts back what a client requeues (nack, reject, a closed channel),
# measured on 3.10.8 and 4.3.6 (tests/integration/test_parked.py):
#   - requeued messages go to the END of a FIFO of requeued messages, which the queue
#     serves before all others: requeue the head alone while others requeued earlier are
#     still there, and it ends up behind them. So a peek that keeps the order holds EVERY
#     message of the queue and puts them all back (only a queue nobody requeues into, a
#     tier buffer, can have its head alone peeked: `peek_head`);
#   - one requeue of many messages comes back in the order of an Erlang map: sorted up to
#     32 of them, in hash order beyond (after one multiple nack of 300, all after the
#     33rd were shuffled; requeues sent back to back are merged into one by the broker's
#     queue client). So they go back REQUEUE_BATCH at a time, each batch once the previous
#     one is back in the queue (its ready count has grown by it), at most REQUEUE_WAIT_S.
# Classic queues put a requeued message back where it was. Two readers of one queue at
# the same time can still interleave: each puts back what it got, in its order.
REQUEUE_BATCH = 32
REQUEUE_WAIT_S = 2.0
# basic.qos takes a 16-bit prefetch count: a deeper peek takes several consumers in turn.
_PREFETCH_MAX = 65_535
# A peek by consumer stops waiting for deliveries after this long without one (someone
# else took the rest).
_IDLE_S = 1.0

Delivery = tuple[
    pika.spec.Basic.GetOk | pika.spec.Basic.Deliver, pika.spec.BasicProperties | None, bytes
]


def requeue_in_order(
    connection: pika.BlockingConnection, channel: BlockingChannel, queue: str, tags: list[int]
) -> None:
    """Put the messages held unacked on `channel` (delivery `tags`, in the order they
    came from `queue`) back where they were: see REQUEUE_BATCH. Multiple nacks: RabbitMQ
    4.3 does not count them towards a delivery limit. Run it inside `mapped(...)`."""
    for start in range(0, len(tags), REQUEUE_BATCH):
        batch = tags[start : start + REQUEUE_BATCH]
        before = _ready(channel, queue)
        channel.basic_nack(batch[-1], multiple=True, requeue=True)
        # The last batch too: a peek that follows at once would otherwise get the messages
        # after it first, and put them back in that order.
        deadline = time.monotonic() + REQUEUE_WAIT_S
        while _ready(channel, queue) < before + len(batch) and time.monotonic() < deadline:
            connection.sleep(0.002)


def _ready(channel: BlockingChannel, queue: str) -> int:
    return int(channel.queue_declare(queue, passive=True).method.message_count or 0)


def _hold_by_get(channel: BlockingChannel, queue: str, wanted: int) -> list[Delivery]:
    held: list[Delivery] = []
    for _ in range(wanted):
        method, props, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            break
        held.append((method, props, body))
    return held


def _hold_by_consumer(
    connection: pika.BlockingConnection, channel: BlockingChannel, queue: str, wanted: int
) -> list[Delivery]:
    """Up to `wanted` messages from the head, held unacked: consumers whose prefetch is
    exactly what is still wanted, so the broker never sends one more (one more, cancelled
    in flight, would be rejected back ahead of the others)."""
    held: list[Delivery] = []

    def on_message(
        _ch: BlockingChannel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        held.append((method, props, body))

    while len(held) < wanted:
        goal = min(len(held) + _PREFETCH_MAX, wanted)
        channel.basic_qos(prefetch_count=goal - len(held))
        tag = channel.basic_consume(queue, on_message, auto_ack=False)
        idle_since, seen = time.monotonic(), len(held)
        while len(held) < goal and time.monotonic() - idle_since < _IDLE_S:
            connection.process_data_events(time_limit=0.05)
            if len(held) > seen:
                idle_since, seen = time.monotonic(), len(held)
        channel.basic_cancel(tag)
        if len(held) < goal:
            break
    return held


def hold_all(
    connection: pika.BlockingConnection, channel: BlockingChannel, queue: str, ready: int
) -> list[Delivery]:
    """Every message of `queue` (`ready` of them when counted), held unacked on
    `channel`, in queue order: by basic.get up to REQUEUE_BATCH (no consumer shows on
    the queue), else by a consumer with an exact prefetch (much faster). Put them back
    with `requeue_in_order`. Run it inside `mapped(...)`: pika's exceptions leave it."""
    if ready <= 0:
        return []
    if ready <= REQUEUE_BATCH:
        return _hold_by_get(channel, queue, ready)
    return _hold_by_consumer(connection, channel, queue, ready)


def peek(
    connection: pika.BlockingConnection, queue: str, count: int, *, skip: int = 0
) -> list[Stored]:
    """Up to `count` messages of `queue` from position `skip` (0: the head), nothing
    lost or reordered: every message of the queue is held (see the comment on
    REQUEUE_BATCH), then all are put back with `requeue_in_order`. 10,000 messages take
    about 2.5-5 s on this project's 2-core machine.

    Raises MissingObjectError when the queue does not exist, ConnectionLost or
    AccessRefused.
    """
    ready = require_queue(connection, queue, "queue", unchanged="nothing was read").ready
    if count <= 0 or skip >= ready:
        return []
    held: list[Delivery] = []
    # Whatever was held unacked goes back to the queue with the channel, if it is lost.
    with mapped(f"peeking at queue {queue!r}", permission="read"):
        channel = connection.channel()
        try:
            held = hold_all(connection, channel, queue, ready)
            if held:
                tags = [method.delivery_tag or 0 for method, _props, _body in held]
                requeue_in_order(connection, channel, queue, tags)
        finally:
            if channel.is_open:
                channel.close()
    return [_stored(*delivery) for delivery in held[skip : skip + count]]


def peek_head(connection: pika.BlockingConnection, queue: str) -> Stored | None:
    """The message at the head of `queue`, put back at once (basic.get, then nack), or
    None when the queue is empty or gone.

    Back at the head only if no other requeued message waits in the queue: for tier
    buffers and cascade levels (no consumer ever requeues into them), not parking lots
    (use `peek`). Raises ConnectionLost or AccessRefused.
    """
    with mapped(f"peeking at the head of queue {queue!r}", permission="read"):
        channel = connection.channel()
        try:
            method, props, body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                return None
            # A nack: RabbitMQ 4.3 does not count it towards a delivery limit.
            channel.basic_nack(method.delivery_tag or 0, multiple=False, requeue=True)
            return _stored(method, props, body)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return None
            raise
        finally:
            if channel.is_open:
                channel.close()


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


def preview_parked(
    connection: pika.BlockingConnection,
    topology: Topology,
    queue: str,
    *,
    tier: str | None = None,
    limit: int | None = None,
) -> Preview:
    """What `replay_parked` would move, changing nothing (every message is put back).

    Raises what `replay_parked` raises before moving anything, so a dry run fails where
    the real run would.
    """
    plan = ParkedReplay(topology, queue, tier)
    held = require_queue(connection, plan.parking_queue, "parking lot")
    require_queue(connection, plan.business_queue, "business queue")
    count = min(held.ready if limit is None else min(limit, held.ready), PREVIEW_MAX)
    found, via = peek(connection, plan.parking_queue, count), VIA_AMQP
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
) -> Preview:
    """What `replay_unroutable` would do with the head of the catch-all, changing nothing."""
    plan = UnroutableReplay(topology, queue)
    held = require_queue(connection, plan.catch_all, "catch-all queue")
    found, via = peek(connection, plan.catch_all, min(held.ready, PREVIEW_MAX)), VIA_AMQP
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
    message_id: str | None = None,
) -> ReplayReport:
    """Move messages from `queue`'s parking lot back to the business queue, as first
    attempts: at once (tier None) or after `tier`.

    Replays at most `limit` messages, and never more than the parking lot held at the
    start (a message parked again during the run waits for the next one). With
    `message_id`, only the oldest message with that id (the others stay, in their
    order; none moved when no message has it).

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

    def build(msg: Stored) -> Outgoing | str | None:
        if message_id is not None and msg.message_id != message_id:
            return None  # not the one asked for: stays, unreported
        return plan.outgoing(msg, now_ms())

    if message_id is None:
        gets, moved_max = budget, budget
    else:
        gets, moved_max = held.ready, 1
    _move(connection, topology, plan.parking_queue, gets, moved_max, build, report, progress)
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
    """Re-route catch-all messages to their original target (see rabbit_delay._ops.replay.rules).

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
    build: Callable[[Stored], Outgoing | str | None],
    report: ReplayReport,
    progress: Progress | None,
) -> None:
    """basic.get up to `gets` messages from `source`; publish what `build` makes of each
    (a str: leave it, for that reason; None: leave it, not reported) until `moved_max`
    were moved."""
    channel: BlockingChannel | None = None
    publisher: Publisher | None = None
    held: list[int] = []  # delivery tags got and not acked on `channel`, in queue order
    try:
        channel = connection.channel()
        publisher = Publisher(topology, connection=connection, window=1)
        for _ in range(gets):
            if len(report.moved) >= moved_max:
                break
            method, props, body = channel.basic_get(source, auto_ack=False)
            if method is None:
                break
            tag: int = method.delivery_tag or 0
            held.append(tag)
            msg = _stored(method, props, body)
            out = build(msg)
            if out is None:
                continue  # held unacked like a left message, put back in order below
            if isinstance(out, str):
                # Held unacked, so the next get returns the next message; put back at the end.
                report.left.append((msg.message_id, out))
                continue
            try:
                publisher.publish_outgoing((out,))
            except RabbitDelayError as exc:
                report.error = (
                    f"message {msg.message_id} could not be re-published to {out.exchange!r} "
                    f"[{out.routing_key}]: {exc}. It is back in {source!r}; stopped after "
                    f"{len(report.moved)} message(s)"
                )
                break
            channel.basic_ack(tag)
            held.pop()
            moved = Moved(out.message_id, out.exchange, out.routing_key)
            report.moved.append(moved)
            if progress is not None:
                progress(moved)
    except _FAILURES as exc:
        # Unsettled messages go back to the queue (requeued below, or with the channel).
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
                    # Left in place (and a message whose copy failed): back in their
                    # order, with every message after them (see REQUEUE_BATCH: alone,
                    # they would go behind messages requeued earlier).
                    rest = hold_all(connection, channel, source, _ready(channel, source))
                    held += [method.delivery_tag or 0 for method, _props, _body in rest]
                    requeue_in_order(connection, channel, source, held)
                channel.close()


__all__ = [
    "Moved",
    "PassiveCounts",
    "Preview",
    "Previewed",
    "ReplayReport",
    "hold_all",
    "passive_counts",
    "peek",
    "peek_head",
    "preview_parked",
    "preview_unroutable",
    "replay_parked",
    "replay_unroutable",
    "requeue_in_order",
    "require_queue",
]
