"""Shared fixtures: a real broker, unique topologies per test, cleanup.

Broker chain (dramatiq's check_rabbitmq): RABBIT_DELAY_TEST_URL if set; else the local
broker on 127.0.0.1:5672; else a testcontainers RabbitMQ when Docker is available; else
skip locally and FAIL when CI is set.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest

from rabbit_delay.sync import connected
from rabbit_delay.sync import delete_topology as sync_delete_topology
from rabbit_delay.topology import Topology, topology_from_dict
from rabbit_delay.urls import DEFAULT_URL, ManagementEndpoint, management_endpoint

TEST_URL_ENV = "RABBIT_DELAY_TEST_URL"


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        address = (parts.hostname or "127.0.0.1", parts.port or 5672)
        with socket.create_connection(address, timeout=1):
            return True
    except OSError:
        return False


def _testcontainers_url() -> tuple[str, Any] | None:
    try:
        from testcontainers.rabbitmq import RabbitMqContainer
    except ImportError:
        return None
    try:
        container = RabbitMqContainer("rabbitmq:3.13-management")
        container.start()
    except Exception:  # no Docker engine: the caller decides between skip and fail
        return None
    host = container.get_container_host_ip()
    port = container.get_exposed_port(5672)
    return f"amqp://guest:guest@{host}:{port}/%2F", container


@pytest.fixture(scope="session")
def broker_url() -> Iterator[str]:
    explicit = os.environ.get(TEST_URL_ENV)
    if explicit:
        yield explicit
        return
    if _reachable(DEFAULT_URL):
        yield DEFAULT_URL
        return
    started = _testcontainers_url()
    if started is not None:
        url, container = started
        yield url
        container.stop()
        return
    reason = f"no RabbitMQ: set {TEST_URL_ENV}, start one on 127.0.0.1:5672, or install Docker"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def management(broker_url: str) -> ManagementEndpoint:
    return management_endpoint(broker_url)


@pytest.fixture
def connection(broker_url: str) -> Iterator[pika.BlockingConnection]:
    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    yield conn
    if conn.is_open:
        conn.close()


def unique_namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


def delete_topology(url: str, topology: Topology) -> None:
    """Remove every object the topology declares (best effort, for test cleanup)."""
    with connected(url, name="rabbit-delay cleanup") as connection:
        sync_delete_topology(connection, topology)


MakeTopology = Callable[..., Topology]


@pytest.fixture
def make_topology(broker_url: str) -> Iterator[MakeTopology]:
    """Factory for a topology in a unique namespace; its objects are deleted afterwards.

    Defaults: tiers 1s and 3s, quorum queues, business queues `orders.cancel` and
    `push` (with an extra binding `push.any`). Keyword arguments override top-level keys.
    """
    made: list[Topology] = []

    def make(**overrides: Any) -> Topology:
        data: dict[str, Any] = {
            "namespace": unique_namespace(),
            "tiers": {"1s": "1s", "3s": "3s"},
            "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}},
        }
        data.update(overrides)
        topology = topology_from_dict(data)
        made.append(topology)
        return topology

    yield make
    for topology in made:
        delete_topology(broker_url, topology)


def message_count(url: str, queue: str) -> int:
    """Ready messages in `queue`, read live with a passive declare (the management API's
    figures lag by seconds)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.05
) -> Any:
    """Poll until `predicate()` is truthy and return its value; fail the test, naming
    `what`, at the deadline. The one polling helper of the suite."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
