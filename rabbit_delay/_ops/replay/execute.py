"""Replay on pika: move parked and unroutable messages back, or preview what would move.

The core (`rabbit_delay._ops.replay.rules`) decides what each copy looks like; this module
reads through the shared queue primitives (`rabbit_delay._ops.queues`) and moves one
message at a time: basic.get, publish the copy (confirmed, mandatory), and only
then ack the original. A failed publish nacks the original back into its queue and
stops the run. A crash between the confirm and the ack leaves the message in both
places: at-least-once, and the message_id is kept, so the idempotency guard drops the
second copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pika
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay._envelope import Outgoing, now_ms
from rabbit_delay._errors import RabbitDelayError
from rabbit_delay._ops.queues import (
    hold_all,
    peek,
    queue_counts,
    ready_messages,
    ready_now,
    requeue_in_order,
    stored,
)
from rabbit_delay._ops.replay.rules import (
    Leave,
    Moved,
    ParkedReplay,
    Preview,
    Previewed,
    ReplayReport,
    UnroutableReplay,
)
from rabbit_delay._ops.stored import Stored
from rabbit_delay._sync.errors import CLIENT_ERRORS, translate
from rabbit_delay._sync.publisher import Publisher
from rabbit_delay._topology.model import Topology
from rabbit_delay._urls import redact

# A dry run lists at most this many messages (it reads them all: see `peek`).
PREVIEW_MAX = 1000
# How a dry run reads: over AMQP (`peek`), nothing lost or reordered. Not through the
# management API: its get with requeue puts more than 32 messages back out of order,
# and any number behind messages requeued before (see `rabbit_delay._ops.queues`).
VIA_AMQP = "basic.get (or a consumer), then requeue in order"
# What stops a replay run (reported in ReplayReport.error, never raised).
_FAILURES: tuple[type[BaseException], ...] = (*CLIENT_ERRORS, RabbitDelayError)


def _parked_replay(
    connection: pika.BlockingConnection, topology: Topology, queue: str, tier: str | None
) -> tuple[ParkedReplay, int]:
    """The replay of `queue`'s parking lot, once the lot and the business queue are
    known to exist, and how many messages the lot holds. Raises UnknownTargetError /
    DelayError for a bad queue or tier, MissingObjectError for a missing queue."""
    plan = ParkedReplay(topology, queue, tier)
    held = ready_messages(connection, plan.parking_queue, "parking lot")
    ready_messages(connection, plan.business_queue, "business queue")
    return plan, held


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
    plan, held = _parked_replay(connection, topology, queue, tier)
    count = min(held if limit is None else min(limit, held), PREVIEW_MAX)
    found, via = peek(connection, plan.parking_queue, count), VIA_AMQP
    now = now_ms()
    rows = []
    for msg in found:
        out = plan.outgoing(msg, now)
        rows.append(Previewed(msg, f"{out.exchange} [{out.routing_key}]", True))
    return Preview(plan.parking_queue, plan.destination, held, via, tuple(rows))


def preview_unroutable(
    connection: pika.BlockingConnection,
    topology: Topology,
    *,
    queue: str | None = None,
    limit: int | None = None,
) -> Preview:
    """What `replay_unroutable` would do with the head of the catch-all, changing nothing."""
    plan = UnroutableReplay(topology, queue)
    held = ready_messages(connection, plan.catch_all, "catch-all queue")
    found, via = peek(connection, plan.catch_all, min(held, PREVIEW_MAX)), VIA_AMQP
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
    return Preview(plan.catch_all, "original targets", held, via, tuple(rows))


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
    plan, held = _parked_replay(connection, topology, queue, tier)
    budget = held if limit is None else min(limit, held)
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
        gets, moved_max = held, 1
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
                self.exists[name] = queue_counts(self.connection, name) is not None
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
    held = ready_messages(connection, plan.catch_all, "catch-all queue")
    report = ReplayReport(plan.catch_all, "original targets")
    moved_max = held if limit is None else min(limit, held)
    if moved_max <= 0:
        return report
    reroute = _Rerouter(connection, plan)
    _move(connection, topology, plan.catch_all, held, moved_max, reroute, report, progress)
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
            msg = stored(method, props, body)
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
                    # order, with every message after them (see REQUEUE_BATCH in
                    # `_ops.queues`: alone, they would go behind messages requeued earlier).
                    rest = hold_all(connection, channel, source, ready_now(channel, source))
                    held += [method.delivery_tag or 0 for method, _props, _body in rest]
                    requeue_in_order(connection, channel, source, held)
                channel.close()


__all__ = [
    "PREVIEW_MAX",
    "VIA_AMQP",
    "Progress",
    "preview_parked",
    "preview_unroutable",
    "replay_parked",
    "replay_unroutable",
]
