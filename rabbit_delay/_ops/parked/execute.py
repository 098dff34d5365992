"""Parking lots on pika: list, show and purge parked messages (what they mean:
`rabbit_delay._ops.parked.rules`; moving them back: `rabbit_delay._ops.replay.execute`).

Listing and showing only peek (`rabbit_delay._ops.queues.peek`: every message held
unacked, then put back in order), so every message stays where it was, in order. A
parking lot is declared with an explicit, huge `x-delivery-limit`, so looking at it
never costs a message on RabbitMQ 4.x either.
"""

from __future__ import annotations

import pika

from rabbit_delay._ops.parked.rules import (
    ParkedDetail,
    ParkedPage,
    check_page,
    find,
    page,
    parking_lot,
)
from rabbit_delay._ops.queues import peek, ready_messages
from rabbit_delay._ops.stored import Stored
from rabbit_delay._sync.errors import mapped
from rabbit_delay._topology.model import Topology


def parked_count(connection: pika.BlockingConnection, topology: Topology, queue: str) -> int:
    """Messages ready in `queue`'s parking lot, live.

    Raises UnknownTargetError, MissingObjectError (the lot does not exist: run
    `rabbit-delay declare`), ConnectionLost or AccessRefused.
    """
    _, lot = parking_lot(topology, queue)
    return ready_messages(connection, lot, "parking lot", unchanged="nothing was read")


def list_parked(
    connection: pika.BlockingConnection,
    topology: Topology,
    queue: str,
    *,
    offset: int = 0,
    limit: int,
) -> ParkedPage:
    """`limit` parked messages of `queue` from position `offset` (0: the oldest),
    nothing moved. Reading a page holds the `offset` messages before it too, so a page
    far into a long lot costs as many gets.

    Raises ConfigError for a bad page, plus what `parked_count` raises.
    """
    check_page(offset, limit)
    logical, lot = parking_lot(topology, queue)
    total = ready_messages(connection, lot, "parking lot", unchanged="nothing was read")
    found = peek(connection, lot, min(limit, max(total - offset, 0)), skip=offset) if total else []
    return page(logical, lot, total, offset, limit, found)


def peek_lot(
    connection: pika.BlockingConnection, topology: Topology, queue: str
) -> tuple[str, str, list[Stored]]:
    """(logical queue, parking-lot name, every message of the lot in order), nothing
    moved: what a dashboard pages through without reading the lot again for each page.
    Raises what `parked_count` raises."""
    logical, lot = parking_lot(topology, queue)
    total = ready_messages(connection, lot, "parking lot", unchanged="nothing was read")
    return logical, lot, peek(connection, lot, total) if total else []


def show_parked(
    connection: pika.BlockingConnection, topology: Topology, queue: str, message_id: str
) -> tuple[int, list[ParkedDetail]]:
    """(messages in the lot, every parked message of `queue` with this id, in full),
    read from the whole lot, nothing moved. Raises what `parked_count` raises."""
    _, _, messages = peek_lot(connection, topology, queue)
    return len(messages), find(messages, message_id)


def purge_parked(connection: pika.BlockingConnection, topology: Topology, queue: str) -> int:
    """Delete every message in `queue`'s parking lot (queue.purge); how many went.

    They cannot be recovered. Raises what `parked_count` raises.
    """
    _, lot = parking_lot(topology, queue)
    ready_messages(connection, lot, "parking lot", unchanged="nothing was purged")
    with mapped(f"purging parking lot {lot!r}", permission="read"):
        channel = connection.channel()
        try:
            ok = channel.queue_purge(lot)
        finally:
            if channel.is_open:
                channel.close()
    return int(ok.method.message_count or 0)


__all__ = [
    "list_parked",
    "parked_count",
    "peek_lot",
    "purge_parked",
    "show_parked",
]
