"""Publishers count what the broker confirmed, and what it did not, in the metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pika
import pytest
from prometheus_client import CollectorRegistry

from rabbit_delay import Topology, UnroutableError, aio
from rabbit_delay.metrics import Metrics
from rabbit_delay.sync import Publisher, connect, declare

pytestmark = pytest.mark.integration


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def declared(broker_url: str, make_topology: Callable[..., Topology]) -> Topology:
    topology = make_topology()
    conn = connect(broker_url)
    declare(conn, topology)
    conn.close()
    return topology


def delete_buffer(broker_url: str, topology: Topology, tier: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        conn.channel().queue_delete(topology.names.tier_queue(tier))
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_publishers_count_confirmed_and_failed_publishes(
    broker_url: str, make_topology: Callable[..., Topology], kind: str
) -> None:
    topology = declared(broker_url, make_topology)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    push = topology.names.queue_key("push")

    def publish_all() -> None:
        if kind == "sync":
            with Publisher(topology, broker_url, metrics=metrics) as publisher:
                publisher.publish_delayed({"a": 1}, "1s", queue="push")
                publisher.publish_many([{"i": i} for i in range(5)], "3s", queue="push")
                delete_buffer(broker_url, topology, "1s")
                with pytest.raises(UnroutableError):
                    publisher.publish_delayed({"b": 2}, "1s", queue="push")
            return

        async def run() -> None:
            publisher = await aio.AsyncPublisher.connect(topology, broker_url, metrics=metrics)
            try:
                await publisher.publish_delayed({"a": 1}, "1s", queue="push")
                await publisher.publish_many([{"i": i} for i in range(5)], "3s", queue="push")
                delete_buffer(broker_url, topology, "1s")
                with pytest.raises(UnroutableError):
                    await publisher.publish_delayed({"b": 2}, "1s", queue="push")
            finally:
                await publisher.close()

        asyncio.run(run())

    publish_all()
    total = "rabbit_delay_published_total"
    assert sample(registry, total, queue=push, tier="1s") == 1
    assert sample(registry, total, queue=push, tier="3s") == 5
    errors = "rabbit_delay_publish_errors_total"
    assert sample(registry, errors, queue=push, reason="unroutable") == 1
