"""A test kit for rabbit-delay users: an in-memory RabbitMQ on a virtual clock.

    from rabbit_delay.testing import TestBroker

    def test_an_unpaid_order_is_cancelled_after_30_minutes():
        with TestBroker(app) as broker:  # app: your rabbit_delay._consumer.app.App
            broker.publisher.publish_delayed(
                CancelOrder(order_id=1), "30m", queue="orders.cancel-unpaid"
            )
            broker.advance("29m")
            assert broker.outcomes("orders.cancel-unpaid") == []
            broker.advance("1m")
            assert broker.outcomes("orders.cancel-unpaid") == ["acked"]

No RabbitMQ, no sleeping: 30 minutes pass in microseconds. Nothing is re-implemented:
the topology is declared by the real declare program, messages are built by the real
publisher core, and every delivery goes through the real delivery program (claim, run,
retry or park, ack) that `rabbit_delay.sync.Worker` and `rabbit_delay.aio.AsyncWorker`
drive; only the broker is emulated (`MemoryBroker`, RabbitMQ 4.3 by default). The
behaviour suite of the real workers runs against it too (tests/worker_behaviour.py).
See docs/testing.md.

Importing this package imports neither pika nor aio-pika.
"""

from __future__ import annotations

from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay.testing._broker import (
    DEFAULT_VERSION,
    Channel,
    Delivered,
    KitError,
    MemoryBroker,
    Message,
    topic_matches,
)
from rabbit_delay.testing._kit import TestBroker
from rabbit_delay.testing._publisher import AsyncMemoryPublisher, MemoryPublisher
from rabbit_delay.testing._worker import Handled, MemoryWorker

__all__ = [
    "DEFAULT_VERSION",
    "AsyncMemoryPublisher",
    "Channel",
    "Delivered",
    "Handled",
    "KitError",
    "MemoryBroker",
    "MemoryPublisher",
    "MemoryWorker",
    "Message",
    "Outcome",
    "TestBroker",
    "topic_matches",
]
