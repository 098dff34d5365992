"""One face for both transports, so each behaviour test is written once.

`SyncTransport` drives `rabbit_delay.sync` (pika); `AsyncTransport` drives
`rabbit_delay.aio` (aio-pika) on a private event loop, turning every coroutine into a
plain call. Both count the messages their publisher hands to the wire (`sends`), so a
test can prove a refused publish sent nothing.

Also here: reading the broker's state through the management API, and a consumer
thread that records when each message arrives.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import pika
import pika.exceptions
from conftest import wait_for

from rabbit_delay import Topology
from rabbit_delay._plan.diff import Observed, Plan
from rabbit_delay._plan.program import DeclareReport
from rabbit_delay._urls import ManagementEndpoint

T = TypeVar("T")
DEADLINE_S = 20.0


# -- the transport adapter ---------------------------------------------------------------


class PublisherHandle(Protocol):
    sends: int

    def publish_delayed(self, msg: Any, tier: str | None = None, **kwargs: Any) -> str: ...

    def publish_many(
        self, messages: Iterable[Any], tier: str | None = None, **kwargs: Any
    ) -> list[str]: ...

    def open_channels(self) -> int: ...

    def close(self) -> None: ...


class Transport(Protocol):
    kind: str

    def declare(self, topology: Topology, *, observed: Observed | None = None) -> DeclareReport: ...

    def plan(self, topology: Topology, *, observed: Observed | None = None) -> Plan: ...

    def publisher(self, topology: Topology) -> PublisherHandle: ...

    def open_channels(self) -> int: ...

    def close(self) -> None: ...


class _SyncPublisher:
    def __init__(self, topology: Topology, url: str) -> None:
        from rabbit_delay.sync import Publisher

        self.sends = 0
        self._publisher = Publisher.connect(topology, url)
        send = self._publisher._send

        def counting(out: Any) -> int:
            self.sends += 1
            return send(out)

        self._publisher._send = counting  # type: ignore[method-assign]

    def publish_delayed(self, msg: Any, tier: str | None = None, **kwargs: Any) -> str:
        return self._publisher.publish_delayed(msg, tier, **kwargs)

    def publish_many(
        self, messages: Iterable[Any], tier: str | None = None, **kwargs: Any
    ) -> list[str]:
        return self._publisher.publish_many(messages, tier, **kwargs)

    def open_channels(self) -> int:
        connection = self._publisher.connection
        connection.process_data_events(0)
        return sum(1 for ch in connection._impl._channels.values() if ch.is_open)

    def close(self) -> None:
        self._publisher.close()


class SyncTransport:
    kind = "sync"

    def __init__(self, url: str) -> None:
        from rabbit_delay.sync import connect

        self.url = url
        self.connection = connect(url, name=f"rd-test-sync-{uuid.uuid4().hex[:8]}")
        self._publishers: list[_SyncPublisher] = []

    def declare(self, topology: Topology, *, observed: Observed | None = None) -> DeclareReport:
        from rabbit_delay.sync import declare

        return declare(self.connection, topology, observed=observed)

    def plan(self, topology: Topology, *, observed: Observed | None = None) -> Plan:
        from rabbit_delay.sync import plan

        return plan(self.connection, topology, observed=observed)

    def publisher(self, topology: Topology) -> _SyncPublisher:
        publisher = _SyncPublisher(topology, self.url)
        self._publishers.append(publisher)
        return publisher

    def open_channels(self) -> int:
        """Channels open on the declare/plan connection (pika keeps them in `_impl`)."""
        self.connection.process_data_events(0)
        return sum(1 for ch in self.connection._impl._channels.values() if ch.is_open)

    def close(self) -> None:
        for publisher in self._publishers:
            publisher.close()
        if self.connection.is_open:
            self.connection.close()


class _AsyncPublisher:
    def __init__(self, transport: AsyncTransport, topology: Topology) -> None:
        from rabbit_delay.aio import AsyncPublisher

        self.sends = 0
        self._run = transport.run
        self._publisher = self._run(AsyncPublisher.connect(topology, transport.url))
        send = self._publisher._send

        async def counting(out: Any) -> None:
            self.sends += 1
            await send(out)

        self._publisher._send = counting  # type: ignore[method-assign]

    def publish_delayed(self, msg: Any, tier: str | None = None, **kwargs: Any) -> str:
        return self._run(self._publisher.publish_delayed(msg, tier, **kwargs))

    def publish_many(
        self, messages: Iterable[Any], tier: str | None = None, **kwargs: Any
    ) -> list[str]:
        return self._run(self._publisher.publish_many(messages, tier, **kwargs))

    def open_channels(self) -> int:
        self._run(asyncio.sleep(0.3))  # let a robust channel's reopening run, if any
        underlay = self._publisher.connection.transport.connection  # type: ignore[attr-defined]
        return sum(1 for ch in underlay.channels.values() if not ch.is_closed)

    def close(self) -> None:
        self._run(self._publisher.close())


class AsyncTransport:
    kind = "aio"

    def __init__(self, url: str) -> None:
        from rabbit_delay.aio import connect

        self.url = url
        self._runner = asyncio.Runner()
        self._publishers: list[_AsyncPublisher] = []
        self.connection = self.run(connect(url, name=f"rd-test-aio-{uuid.uuid4().hex[:8]}"))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(asyncio.wait_for(coro, DEADLINE_S))

    def declare(self, topology: Topology, *, observed: Observed | None = None) -> DeclareReport:
        from rabbit_delay.aio import declare

        return self.run(declare(self.connection, topology, observed=observed))

    def plan(self, topology: Topology, *, observed: Observed | None = None) -> Plan:
        from rabbit_delay.aio import plan

        return self.run(plan(self.connection, topology, observed=observed))

    def publisher(self, topology: Topology) -> _AsyncPublisher:
        publisher = _AsyncPublisher(self, topology)
        self._publishers.append(publisher)
        return publisher

    def open_channels(self) -> int:
        """Channels open on the declare/plan connection, after letting any pending
        reopen of a robust channel run."""
        self.run(asyncio.sleep(0.3))
        underlay = self.connection.transport.connection  # type: ignore[attr-defined]
        return sum(1 for ch in underlay.channels.values() if not ch.is_closed)

    def close(self) -> None:
        try:
            for publisher in self._publishers:
                publisher.close()
            self.run(self.connection.close())
        finally:
            self._runner.close()


TRANSPORTS: dict[str, Callable[[str], Transport]] = {"sync": SyncTransport, "aio": AsyncTransport}


@contextmanager
def open_transport(kind: str, url: str) -> Iterator[Transport]:
    transport = TRANSPORTS[kind](url)
    try:
        yield transport
    finally:
        transport.close()


# -- the broker as the management API shows it --------------------------------------------


def mgmt_get(endpoint: ManagementEndpoint, path: str) -> Any:
    request = urllib.request.Request(endpoint.url(path))
    token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


@dataclass(frozen=True)
class BrokerState:
    queues: dict[str, dict[str, Any]]  # name -> {"arguments", "durable", "type"}
    exchanges: dict[str, dict[str, Any]]  # name -> {"type", "arguments", "durable"}
    bindings: frozenset[tuple[str, str, str, str]]  # (source, destination, dest. type, key)

    @property
    def names(self) -> set[str]:
        return {*self.queues, *self.exchanges}


def broker_state(endpoint: ManagementEndpoint, prefix: str) -> BrokerState:
    """Every queue, exchange and binding whose name starts with `prefix`."""
    vhost = endpoint.vhost_quoted
    queues = {
        q["name"]: {"arguments": q["arguments"], "durable": q["durable"], "type": q.get("type")}
        for q in mgmt_get(endpoint, f"queues/{vhost}?columns=name,arguments,durable,type")
        if q["name"].startswith(prefix)
    }
    exchanges = {
        e["name"]: {"type": e["type"], "arguments": e["arguments"], "durable": e["durable"]}
        for e in mgmt_get(endpoint, f"exchanges/{vhost}")
        if e["name"].startswith(prefix)
    }
    bindings = frozenset(
        (b["source"], b["destination"], b["destination_type"], b["routing_key"])
        for b in mgmt_get(endpoint, f"bindings/{vhost}")
        if b["source"].startswith(prefix)  # not the default exchange's implicit ones
    )
    return BrokerState(queues, exchanges, bindings)


def queue_info(endpoint: ManagementEndpoint, name: str) -> dict[str, Any]:
    info: dict[str, Any] = mgmt_get(
        endpoint, f"queues/{endpoint.vhost_quoted}/{quote(name, safe='')}"
    )
    return info


def delete_queue(url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_delete(queue)
    finally:
        connection.close()


# -- a consumer that records arrivals -------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    queue: str
    arrived_ms: int
    body: bytes
    properties: pika.BasicProperties

    @property
    def message_id(self) -> str:
        return str(self.properties.message_id)

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})

    @property
    def lateness_ms(self) -> int:
        return self.arrived_ms - int(self.headers["rd-due-at"])


@dataclass
class Collector:
    """Consumes `queues` on its own connection and thread, stamping each arrival."""

    url: str
    queues: list[str]
    arrivals: list[Arrival] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _error: list[BaseException] = field(default_factory=list)

    def __enter__(self) -> Collector:
        self._thread = threading.Thread(target=self._consume, name="rd-test-collector", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError(f"collector did not start: {self._error}")
        if self._error:
            raise self._error[0]
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _consume(self) -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(self.url))
        except BaseException as exc:
            self._error.append(exc)
            self._ready.set()
            return
        try:
            channel = connection.channel()
            for queue in self.queues:
                channel.basic_consume(queue, self._callback(queue), auto_ack=True)
            self._ready.set()
            while not self._stop.is_set():
                connection.process_data_events(time_limit=0.02)
        except BaseException as exc:
            self._error.append(exc)
            self._ready.set()
        finally:
            if connection.is_open:
                connection.close()

    def _callback(self, queue: str) -> Callable[..., None]:
        def on_message(
            _ch: Any, _method: Any, properties: pika.BasicProperties, body: bytes
        ) -> None:
            self.arrivals.append(Arrival(queue, int(time.time() * 1000), body, properties))

        return on_message

    def of(self, message_id: str) -> list[Arrival]:
        return [a for a in self.arrivals if a.message_id == message_id]

    def wait_for(self, message_ids: Iterable[str], timeout: float) -> None:
        wanted = set(message_ids)

        def done() -> bool:
            if self._error:
                raise self._error[0]
            return wanted <= {a.message_id for a in list(self.arrivals)}

        wait_for(done, timeout, f"messages {sorted(wanted)} to arrive")


def toml_for(topology: Topology) -> str:
    """The conftest default topology (tiers 1s, 3s; orders.cancel and push) as TOML, for
    the CLI tests that read a topology file."""
    return (
        f'namespace = "{topology.namespace}"\n'
        f'queue_type = "{topology.queue_type.value}"\n'
        '[tiers]\n1s = "1s"\n3s = "3s"\n'
        '[queues."orders.cancel"]\n'
        '[queues.push]\nbindings = ["push.any"]\n'
    )
