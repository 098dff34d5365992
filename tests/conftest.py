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

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._io.management import checked, get_json
from rabbit_delay._ops.delete.execute import delete_topology as sync_delete_topology
from rabbit_delay._urls import DEFAULT_URL, ManagementEndpoint, management_endpoints
from rabbit_delay.sync import connected

TEST_URL_ENV = "RABBIT_DELAY_TEST_URL"
TEST_MANAGEMENT_URL_ENV = "RABBIT_DELAY_TEST_MANAGEMENT_URL"
# Set only when other processes use the broker under test at the same time: their objects
# would look like ours in the leftover check below.
SHARED_BROKER_ENV = "RABBIT_DELAY_TEST_SHARED_BROKER"


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
        container = RabbitMqContainer("rabbitmq:4.3-management")
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


def server_info(url: str) -> BrokerInfo:
    """What the broker at `url` says it is (version, cluster name)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return BrokerInfo.from_server_properties(conn._impl.server_properties)
    finally:
        conn.close()


@pytest.fixture(scope="session")
def broker_info(broker_url: str) -> BrokerInfo:
    """The broker under test: its version decides which behaviour a test expects."""
    return server_info(broker_url)


def verified_management(url: str) -> tuple[ManagementEndpoint | None, str]:
    """The management API of the broker at `url`, proven to be the same broker."""
    info = server_info(url)
    access = checked(management_endpoints(url, os.environ.get(TEST_MANAGEMENT_URL_ENV)), info)
    return access.endpoint, access.note


@pytest.fixture(scope="session")
def management(broker_url: str) -> ManagementEndpoint:
    """The management API of the broker under test (derived from its URL, or
    RABBIT_DELAY_TEST_MANAGEMENT_URL), checked to serve that very broker."""
    endpoint, note = verified_management(broker_url)
    if endpoint is None:
        reason = f"no management API for the broker under test: {note}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return endpoint


# -- nothing left behind ----------------------------------------------------------------
# Every test deletes what it made. The controlling process (not each xdist worker) takes
# a snapshot of the broker under test before the first test and compares after the last:
# a queue, exchange, vhost, user or policy that was not there before fails the run.

_SNAPSHOT_KINDS = ("queues", "exchanges", "vhosts", "users", "policies")


def _broker_objects(endpoint: ManagementEndpoint) -> set[tuple[str, str, str]]:
    found: set[tuple[str, str, str]] = set()
    for kind in _SNAPSHOT_KINDS:
        for item in get_json(endpoint, kind):
            if kind in ("queues", "exchanges") and str(item.get("name", "")).startswith("amq.gen-"):
                continue  # server-named exclusive queues of connections still closing
            found.add((kind, str(item.get("vhost", "")), str(item.get("name", ""))))
    return found


def _leftover_check_url(config: pytest.Config) -> str | None:
    if hasattr(config, "workerinput") or os.environ.get(SHARED_BROKER_ENV):
        return None  # an xdist worker: the controller checks once for all
    url = os.environ.get(TEST_URL_ENV) or (DEFAULT_URL if _reachable(DEFAULT_URL) else None)
    return url if url and _reachable(url) else None


def pytest_sessionstart(session: pytest.Session) -> None:
    url = _leftover_check_url(session.config)
    if url is None:
        return
    endpoint, _note = verified_management(url)
    if endpoint is not None:
        session.config.stash[_BEFORE] = (endpoint, _broker_objects(endpoint))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    endpoint, objects = before
    deadline = time.monotonic() + 10  # queues of closing connections go away by themselves
    while True:
        left = sorted(_broker_objects(endpoint) - objects)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left:
        lines = "\n".join(f"  {kind[:-1]} {name!r} (vhost {vhost!r})" for kind, vhost, name in left)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the tests left {len(left)} object(s) on the broker under test:\n{lines}"
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[tuple[ManagementEndpoint, set[tuple[str, str, str]]]]()


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


# -- OpenTelemetry spans (tests of rabbit_delay/_observe/tracing.py) -------------------------------


class Spans:
    """rabbit-delay's finished spans, from the SDK's in-memory exporter; `tracer` makes
    the application's own spans on the same provider."""

    def __init__(self, exporter: Any, trace: Any, provider: Any) -> None:
        self.exporter = exporter
        self.trace = trace  # the opentelemetry.trace module
        self.tracer = provider.get_tracer("the application")

    def all(self) -> list[Any]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[Any]:
        return [s for s in self.all() if s.name.startswith(prefix)]

    def one(self, prefix: str) -> Any:
        found = self.named(prefix)
        assert len(found) == 1, [s.name for s in self.all()]
        return found[0]


@pytest.fixture
def spans() -> Iterator[Spans]:
    """rabbit-delay's spans recorded on a provider of its own. OpenTelemetry is imported
    here only, and the spans are turned off again afterwards, so the other tests of the
    process keep running the untraced path."""
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra (dev installs it)")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rabbit_delay._observe import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(tracer_provider=provider)
    yield Spans(exporter, trace, provider)
    tracing.configure(enabled=False)
    provider.shutdown()


# Fixtures that start a scratch node (tests/integration/_scratch_node.py): a test using
# one is marked `scratch` (the modules built on scratch nodes carry the mark themselves),
# so a run can leave the node-starting tests out, e.g. CI on RabbitMQ 4.0:
# `-m "not cluster and not scratch"`.
SCRATCH_FIXTURES = frozenset({"scratch_node", "second_broker", "timeout_node"})


# The stores' own tests (Redis, PostgreSQL) talk to no broker: marked `stores`, so a run
# against another broker can leave them out, e.g. CI on RabbitMQ 4.3 and 4.0 (they run
# on 3.10): all the tests of these modules but one that asks for the broker under test.
STORE_MODULES = frozenset(
    {
        "test_idempotency_postgres.py",
        "test_idempotency_redis.py",
        "test_schedule_postgres.py",
        "test_schedule_redis.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if SCRATCH_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.scratch)
        if item.path.name in STORE_MODULES and "broker_url" not in fixtures:
            item.add_marker(pytest.mark.stores)
