"""The queue primitives every operation shares, on pika: count a queue (passive
declare), read a message back (`Stored`), hold every message of a queue and put them
back in order, peek at a queue or at its head.

status, parked, replay, transfer and the dashboard read queues through these only;
what each operation makes of what they read is decided in its own `rules.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay._broker import QueueCounts
from rabbit_delay._errors import MissingObjectError
from rabbit_delay._ops.stored import Stored
from rabbit_delay._sync.errors import mapped

# -- counting -------------------------------------------------------------------------------


def _declare_passive(connection: pika.BlockingConnection, queue: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of `queue`, or None when it does not exist. A 404
    closes the channel, so each probe gets its own."""
    with mapped(f"checking queue {queue!r} (passive declare)"):
        try:
            channel = connection.channel()
            ok = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return None
            raise
        method = ok.method
        counts = method.message_count or 0, method.consumer_count or 0
        channel.close()
    return counts


def queue_counts(connection: pika.BlockingConnection, queue: str) -> QueueCounts | None:
    """Live ready-message and consumer counts of `queue` (None: it does not exist).

    Raises ConnectionLost when the connection goes away, AccessRefused / BrokerError
    when the broker refuses the probe for another reason.
    """
    found = _declare_passive(connection, queue)
    return None if found is None else QueueCounts(ready=found[0], consumers=found[1])


def passive_counts(
    connection: pika.BlockingConnection, queues: Iterable[str]
) -> dict[str, QueueCounts | None]:
    """`queue_counts` of each queue (None: the queue does not exist). Raises what
    `queue_counts` raises."""
    return {queue: queue_counts(connection, queue) for queue in queues}


def ready_messages(
    connection: pika.BlockingConnection,
    queue: str,
    what: str,
    *,
    unchanged: str = "nothing was replayed",
) -> int:
    """Live count of the ready messages in `queue`; MissingObjectError naming it
    (`what`) and saying that `unchanged` when it does not exist. Raises ConnectionLost
    or AccessRefused."""
    found = _declare_passive(connection, queue)
    if found is None:
        raise MissingObjectError(
            f"{what} {queue!r} does not exist; run `rabbit-delay declare` ({unchanged})"
        )
    return found[0]


def ready_now(channel: BlockingChannel, queue: str) -> int:
    """Ready messages in `queue`, asked on `channel` (which a 404 would close). Run it
    inside `mapped(...)`."""
    return int(channel.queue_declare(queue, passive=True).method.message_count or 0)


# -- reading messages back ----------------------------------------------------------------

Delivery = tuple[
    pika.spec.Basic.GetOk | pika.spec.Basic.Deliver, pika.spec.BasicProperties | None, bytes
]


def stored(
    method: pika.spec.Basic.GetOk | pika.spec.Basic.Deliver,
    props: pika.spec.BasicProperties | None,
    body: bytes | str | None,
) -> Stored:
    """The message of one pika delivery (basic.get or a consumer's)."""
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


def requeue_in_order(
    connection: pika.BlockingConnection, channel: BlockingChannel, queue: str, tags: list[int]
) -> None:
    """Put the messages held unacked on `channel` (delivery `tags`, in the order they
    came from `queue`) back where they were: see REQUEUE_BATCH. Multiple nacks: RabbitMQ
    4.3 does not count them towards a delivery limit. Run it inside `mapped(...)`."""
    for start in range(0, len(tags), REQUEUE_BATCH):
        batch = tags[start : start + REQUEUE_BATCH]
        before = ready_now(channel, queue)
        channel.basic_nack(batch[-1], multiple=True, requeue=True)
        # The last batch too: a peek that follows at once would otherwise get the messages
        # after it first, and put them back in that order.
        deadline = time.monotonic() + REQUEUE_WAIT_S
        while ready_now(channel, queue) < before + len(batch) and time.monotonic() < deadline:
            connection.sleep(0.002)


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


# -- peeking --------------------------------------------------------------------------------


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
    ready = ready_messages(connection, queue, "queue", unchanged="nothing was read")
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
    return [stored(*delivery) for delivery in held[skip : skip + count]]


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
            return stored(method, props, body)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return None
            raise
        finally:
            if channel.is_open:
                channel.close()


__all__ = [
    "REQUEUE_BATCH",
    "REQUEUE_WAIT_S",
    "Delivery",
    "hold_all",
    "passive_counts",
    "peek",
    "peek_head",
    "queue_counts",
    "ready_messages",
    "ready_now",
    "requeue_in_order",
    "stored",
]
