"""A message that crashes every worker ends in ITS parking lot, reason delivery_limit.

Quorum business queues carry an explicit `x-delivery-limit` and dead-letter with their
own key (`x-dead-letter-routing-key`), so even a message that arrived through a shared
binding key reaches the parking lot of the queue it crashed in, not the catch-all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pika
import pytest
from conftest import message_count, wait_for

from rabbit_delay import Topology
from rabbit_delay.sync import Publisher, connect, declare

pytestmark = pytest.mark.integration

LIMIT = 2


def crash_once(url: str, queue: str) -> bool:
    """Take one delivery without acking it, then lose the connection, as a killed worker
    does. Returns whether there was a message."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        method, _props, _body = conn.channel().basic_get(queue, auto_ack=False)
        return method is not None
    finally:
        conn.close()  # unacked: the broker takes it back and counts a delivery


@pytest.mark.parametrize("target", ["queue", "binding key"])
def test_a_message_crashing_every_worker_is_parked_with_reason_delivery_limit(
    broker_url: str, make_topology: Callable[..., Topology], target: str
) -> None:
    topology = make_topology(
        queues={"orders.cancel": {}, "push": {"bindings": ["push.any"], "delivery_limit": LIMIT}}
    )
    n = topology.names
    conn = connect(broker_url)
    declare(conn, topology)
    conn.close()
    with Publisher(topology, broker_url) as publisher:
        if target == "queue":
            message_id = publisher.publish_delayed({"k": 1}, "1s", queue="push")
        else:
            message_id = publisher.publish_delayed({"k": 1}, "1s", routing_key="push.any")
    business = n.business_queue("push")
    wait_for(lambda: message_count(broker_url, business) == 1, timeout=5)

    crashes = 0
    deadline = time.monotonic() + 20
    while message_count(broker_url, n.parking_queue("push")) == 0 and time.monotonic() < deadline:
        crashes += crash_once(broker_url, business)
    assert message_count(broker_url, n.parking_queue("push")) == 1
    assert crashes == LIMIT + 1  # delivered LIMIT + 1 times, then dead-lettered
    assert message_count(broker_url, business) == 0
    assert message_count(broker_url, n.unroutable_queue()) == 0

    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        method, props, _body = conn.channel().basic_get(n.parking_queue("push"), auto_ack=True)
    finally:
        conn.close()
    assert method is not None
    assert props.message_id == message_id
    deaths = {(d["queue"], d["reason"]) for d in (props.headers or {})["x-death"]}
    # First it expired from its tier buffer; then the business queue gave up on it.
    assert deaths == {(n.tier_queue("1s"), "expired"), (business, "delivery_limit")}
