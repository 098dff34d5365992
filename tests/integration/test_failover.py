"""Several broker URLs, failover, and faults that must end as the project's errors.

- A URL list whose first entry is a dead port: declare, status, plan and both workers
  use the live one (the broker under test).
- Failover: two separate scratch nodes, the topology declared on both, a sync and an
  async worker consuming with the URLs [A, B]; node A is killed (SIGKILL), both workers
  resume on B within seconds and handle what is published there; calls made on
  connections to A when it died raise ConnectionLost, never a pika/aiormq exception.
- Connections closed by the broker (`rabbitmqctl close_all_connections`) under each
  public call (declare, plan, replay, status counts, peek; sync and async) end as a
  class of the error tree; a worker reconnects by itself.

Scratch nodes cost 5-10 s to start: the two are started at once, once per module.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import unique_namespace, wait_for
from typer.testing import CliRunner, Result

from rabbit_delay import (
    App,
    BrokerUnavailable,
    ConnectionLost,
    ConnectionSettings,
    HandlerContext,
    RabbitDelayError,
    ReconnectBackoff,
    Topology,
    aio,
    topology_from_dict,
)
from rabbit_delay._cli.app import app as cli_app
from rabbit_delay._ops.queues import passive_counts, peek
from rabbit_delay._ops.replay.execute import replay_parked
from rabbit_delay._urls import MANAGEMENT_URL_ENV, URL_ENV, redact
from rabbit_delay.aio import AsyncPublisher
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, connect, declare, plan

from ._scratch_node import ScratchNode, scratch_kind
from .workers.harness import RunningWorker

# The two scratch nodes are module-scoped: one pair for the run under `--dist loadgroup`.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.scratch,
    pytest.mark.xdist_group("failover-nodes"),
]


SYNC_QUEUE = "failover.sync"
ASYNC_QUEUE = "failover.async"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (URL_ENV, MANAGEMENT_URL_ENV, "RABBIT_DELAY_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)


def cli(*args: str) -> Result:
    result = CliRunner().invoke(cli_app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def dead_url() -> str:
    """A URL nothing listens on (a port bound, then released), with a password."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return f"amqp://guest:s3cret-dead@127.0.0.1:{port}/%2F"


def failover_data(namespace: str | None = None) -> dict[str, Any]:
    return {
        "namespace": namespace or unique_namespace(),
        "tiers": {"1s": "1s"},
        "queues": {SYNC_QUEUE: {}, ASYNC_QUEUE: {}},
    }


def failover_topology() -> Topology:
    return topology_from_dict(failover_data())


def toml_for(topology: Topology) -> str:
    return (
        f'namespace = "{topology.namespace}"\n[tiers]\n1s = "1s"\n'
        f'[queues."{SYNC_QUEUE}"]\n[queues."{ASYNC_QUEUE}"]\n'
    )


class Seen:
    """Message ids a handler saw, per queue (thread-safe enough: list.append)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[str]] = {SYNC_QUEUE: [], ASYNC_QUEUE: []}

    def sync_handler(self, _message: Any, ctx: HandlerContext) -> None:
        self.ids[SYNC_QUEUE].append(str(ctx.message_id))

    async def async_handler(self, _message: Any, ctx: HandlerContext) -> None:
        self.ids[ASYNC_QUEUE].append(str(ctx.message_id))

    def wait(self, queue: str, message_id: str, timeout: float = 15.0) -> None:
        wait_for(lambda: message_id in self.ids[queue], timeout, f"{message_id} in {queue}")


def workers_for(
    topology: Topology, urls: str, seen: Seen, **options: Any
) -> tuple[RunningWorker, RunningWorker]:
    """A sync worker on SYNC_QUEUE and an async worker on ASYNC_QUEUE, not started."""
    sync_app = App(topology, store=MemoryStore())
    sync_app.add_consumer(SYNC_QUEUE, seen.sync_handler)
    async_app = App(topology, store=MemoryStore())
    async_app.add_consumer(ASYNC_QUEUE, seen.async_handler)
    return (
        RunningWorker("sync", sync_app, urls, **options),
        RunningWorker("async", async_app, urls, **options),
    )


def publish(url: str, topology: Topology, queue: str) -> str:
    with Publisher(topology, url) as publisher:
        return publisher.publish_delayed({"n": 1}, "1s", queue=queue)


def declare_on(url: str, topology: Topology) -> None:
    connection = connect(url, name="rd-test failover declare")
    try:
        declare(connection, topology)
    finally:
        connection.close()


# -- (a) a dead first URL is skipped -----------------------------------------------------------


def test_commands_and_workers_skip_a_dead_first_url(
    make_topology: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> None:
    topology: Topology = make_topology(**failover_data())
    path = tmp_path / "t.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    dead = dead_url()

    declared = cli("declare", str(path), "--url", dead, "--url", broker_url, "--no-management")
    assert declared.exit_code == 0, declared.stderr
    assert "object(s) created" in declared.stdout
    assert f"on {redact(broker_url)}" in declared.stdout  # the one that answered
    status = cli("status", str(path), "--url", f"{dead},{broker_url}", "--no-management")
    assert status.exit_code == 0, status.stderr
    assert "nothing needs attention" in status.stdout
    in_sync = CliRunner().invoke(
        cli_app, ["plan", str(path), "--no-management"], env={URL_ENV: f"{dead} {broker_url}"}
    )
    assert in_sync.exit_code == 0, in_sync.stdout + in_sync.stderr
    assert "s3cret-dead" not in declared.stdout + status.stdout + in_sync.stdout

    seen = Seen()
    sync_worker, async_worker = workers_for(topology, f"{dead},{broker_url}", seen)
    sync_worker.start()
    try:
        async_worker.start()
        try:
            for worker in (sync_worker, async_worker):
                assert worker.worker.url == broker_url
            seen.wait(SYNC_QUEUE, publish(broker_url, topology, SYNC_QUEUE))
            seen.wait(ASYNC_QUEUE, publish(broker_url, topology, ASYNC_QUEUE))
        finally:
            async_worker.stop()
    finally:
        sync_worker.stop()


def test_when_no_url_answers_one_line_names_each(tmp_path: Path, broker_url: str) -> None:
    topology = failover_topology()
    path = tmp_path / "t.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    first, second = dead_url(), dead_url()
    done = cli("status", str(path), "--url", first, "--url", second, "--no-management")
    assert done.exit_code == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: cannot connect to any of 2 brokers: ")
    for url in (first, second):
        port = url.rsplit(":", 1)[1].split("/")[0]
        assert f"nothing is listening on 127.0.0.1:{port}" in lines[0]
    assert "s3cret-dead" not in done.stderr
    with pytest.raises(BrokerUnavailable, match="any of 2 brokers"):
        connect([first, second])
    with pytest.raises(BrokerUnavailable, match="any of 2 brokers"):
        asyncio.run(aio.connect(f"{first},{second}"))


# -- scratch nodes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(broker_url: str) -> Iterator[tuple[ScratchNode, ScratchNode]]:
    """Two separate scratch nodes of the broker-under-test's version, started at once."""
    kind = scratch_kind(broker_url)
    nodes = (ScratchNode(kind), ScratchNode(kind))
    try:
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(node.start) for node in nodes]:
                started.result()
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()


def test_workers_fail_over_to_the_next_node(pair: tuple[ScratchNode, ScratchNode]) -> None:
    a, b = pair
    topology = failover_topology()
    for node in (a, b):  # separate brokers: each needs the topology
        declare_on(node.url, topology)
    seen = Seen()
    sync_worker, async_worker = workers_for(topology, f"{a.url},{b.url}", seen)
    # connections to A that are open when it dies: the next call on each must raise
    # the project's error, not pika's or aiormq's
    on_a = connect(a.url, name="rd-test on A")
    loop = asyncio.new_event_loop()
    aio_on_a = loop.run_until_complete(aio.connect(a.url, name="rd-test aio on A"))
    # publishers given both nodes, open to A when it dies: their next publish moves to B
    fast = ConnectionSettings(
        backoff=ReconnectBackoff(initial_s=0.05, max_s=0.5), connect_timeout_s=3
    )
    sync_publisher = Publisher.connect(topology, [a.url, b.url], settings=fast)
    async_publisher = loop.run_until_complete(
        AsyncPublisher.connect(topology, [a.url, b.url], settings=fast)
    )
    sync_worker.start()
    try:
        async_worker.start()
        try:
            for worker in (sync_worker, async_worker):
                assert worker.worker.url == a.url  # the first that answers
            seen.wait(SYNC_QUEUE, sync_publisher.publish_delayed({"n": 1}, "1s", queue=SYNC_QUEUE))
            seen.wait(
                ASYNC_QUEUE,
                loop.run_until_complete(
                    async_publisher.publish_delayed({"n": 1}, "1s", queue=ASYNC_QUEUE)
                ),
            )
            assert sync_publisher.connected_url == async_publisher.connected_url == a.url

            killing = time.monotonic()
            a.kill()
            killed_s = time.monotonic() - killing
            for worker in (sync_worker, async_worker):
                wait_for(
                    lambda w=worker: w.worker.started.is_set() and w.worker.url == b.url,
                    10,
                    f"the {worker.kind} worker consuming on B",
                )
            recovered_s = time.monotonic() - killing
            print(f"A killed in {killed_s:.2f}s; both workers on B {recovered_s:.2f}s after")
            # the publishers find their connection to A gone, fail over to B and send there
            seen.wait(SYNC_QUEUE, sync_publisher.publish_delayed({"n": 2}, "1s", queue=SYNC_QUEUE))
            seen.wait(
                ASYNC_QUEUE,
                loop.run_until_complete(
                    async_publisher.publish_delayed({"n": 2}, "1s", queue=ASYNC_QUEUE)
                ),
            )
            assert sync_publisher.connected_url == async_publisher.connected_url == b.url
            for worker in (sync_worker, async_worker):
                assert worker.stats.reconnects == 1
                assert worker.error is None

            with pytest.raises(ConnectionLost):
                declare(on_a, topology)
            with pytest.raises(ConnectionLost):
                loop.run_until_complete(aio.declare(aio_on_a, topology))
        finally:
            async_worker.stop()
    finally:
        sync_worker.stop()
        sync_publisher.close()
        loop.run_until_complete(async_publisher.close())
        with contextlib.suppress(RabbitDelayError, Exception):
            loop.run_until_complete(aio_on_a.close())
        loop.close()


# -- (c) connections closed by the broker under each call ----------------------------------------


def test_a_connection_closed_by_the_broker_ends_as_the_projects_error(
    pair: tuple[ScratchNode, ScratchNode],
) -> None:
    """Each public call on a connection the broker closed (CONNECTION_FORCED, as when
    an operator closes it or a node shuts down) raises ConnectionLost, and a worker
    whose connection is closed reconnects by itself. One `close_all_connections` for
    all of them (each rabbitmqctl call costs a second)."""
    _, b = pair
    topology = failover_topology()
    declare_on(b.url, topology)
    queue = topology.names.business_queue(SYNC_QUEUE)
    calls: dict[str, Callable[[Any], object]] = {
        "declare": lambda c: declare(c, topology),
        "plan": lambda c: plan(c, topology),
        "passive_counts": lambda c: passive_counts(c, [queue]),
        "peek": lambda c: peek(c, queue, 5),
        "replay_parked": lambda c: replay_parked(c, topology, SYNC_QUEUE),
    }
    connections = {what: connect(b.url, name=f"rd-test {what}") for what in calls}
    loop = asyncio.new_event_loop()
    aio_calls = {"aio declare": aio.declare, "aio plan": aio.plan}
    aio_connections = {
        what: loop.run_until_complete(aio.connect(b.url, name=f"rd-test {what}"))
        for what in aio_calls
    }
    seen = Seen()
    sync_worker, async_worker = workers_for(topology, b.url, seen)
    sync_worker.start()
    try:
        async_worker.start()
        try:
            b.ctl("close_all_connections", "rd-test")

            for what, call in calls.items():
                with pytest.raises(ConnectionLost, match="CONNECTION_FORCED"):
                    call(connections[what])
                assert not connections[what].is_open, what

            async def each_aio_call() -> None:
                await asyncio.sleep(0.2)  # the loop reads the close frames
                for what, aio_call in aio_calls.items():
                    with pytest.raises(ConnectionLost):
                        await aio_call(aio_connections[what], topology)

            loop.run_until_complete(each_aio_call())

            for worker in (sync_worker, async_worker):
                wait_for(
                    lambda w=worker: w.stats.reconnects == 1 and w.worker.started.is_set(),
                    10,
                    f"the {worker.kind} worker reconnected",
                )
                assert worker.error is None
            seen.wait(SYNC_QUEUE, publish(b.url, topology, SYNC_QUEUE))
            seen.wait(ASYNC_QUEUE, publish(b.url, topology, ASYNC_QUEUE))
        finally:
            async_worker.stop()
    finally:
        sync_worker.stop()
        for connection in aio_connections.values():
            with contextlib.suppress(Exception):
                loop.run_until_complete(connection.close())
        loop.close()
