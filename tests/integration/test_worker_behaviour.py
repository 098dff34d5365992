"""The consumer framework on the real broker: the behaviour suite (tests/worker_behaviour.py,
also run against rabbit_delay.testing's in-memory worker) on the sync worker (pika, `def`
handlers in threads) and the async worker (aio-pika) with `async def` handlers on its loop
and with `def` handlers in its thread pool alike (`workers.harness.HANDLER_KINDS`). Tests
about starting a worker run per worker (`KINDS`).

Every scenario uses 1 s tiers and waits with deadlines. What differs between RabbitMQ
versions (a consumer over its consumer_timeout, the 4.3 retry backend "broker", what a
nack counts) runs on every version, expecting what that version does. Below the suite:
what only a real broker can show (a connection the server closes, the broker's
consumer_timeout).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pika.exceptions
import pytest
from conftest import message_count, unique_namespace, wait_for
from worker_behaviour import (
    QUEUE,
    Calls,
    CancelOrder,
    Step,
    Taken,
    WorkerBehaviour,
    handler,
    publish,
    retrying,
)

from rabbit_delay import App, ConfigError, HandlerContext, Retry, Topology, topology_from_dict
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._envelope import now_ms
from rabbit_delay._urls import ManagementEndpoint
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, connect, connected, declare, plan

from ._scratch_node import ScratchNode, scratch_kind, server_info, started_node
from .workers.harness import (
    HANDLER_KINDS,
    KINDS,
    RunningWorker,
    close_connections,
    connections_named,
    get_all,
    transport,
)

pytestmark = pytest.mark.integration


class RealBench:
    """The behaviour suite's driver (worker_behaviour.Bench) on a real broker: one kind
    of worker and handler, real time."""

    handlers_take_time = True

    def __init__(
        self,
        kind: str,
        make_topology: Callable[..., Topology],
        url: str,
        broker_info: BrokerInfo,
        running: list[RunningWorker],
    ) -> None:
        self.kind = kind
        self.url = url
        self.broker_info = broker_info
        self._make = make_topology
        self._running = running

    def topology(self, **overrides: Any) -> Topology:
        return self._make(**overrides)

    def declared(self, **overrides: Any) -> Topology:
        topology = self._make(**overrides)
        self.declare(topology)
        return topology

    def declare(self, topology: Topology) -> object:
        conn = connect(self.url, name="rd-test worker declare")
        try:
            return declare(conn, topology)
        finally:
            conn.close()

    def plan(self, topology: Topology) -> object:
        conn = connect(self.url, name="rd-test worker plan")
        try:
            return plan(conn, topology)
        finally:
            conn.close()

    def calls(self) -> Calls:
        return Calls(wait_for, time.monotonic)

    def handler(
        self,
        calls: Calls,
        *,
        sleep: float | Callable[[Any, HandlerContext], float] = 0.0,
        then: Step | None = None,
        annotation: str | None = None,
    ) -> Callable[..., Any]:
        return handler(self.kind, calls, sleep=sleep, then=then, annotation=annotation)

    def run_worker(self, app: App, **options: Any) -> RunningWorker:
        worker = RunningWorker(self.kind, app, self.url, **options)
        self._running.append(worker)
        return worker.start()

    @contextmanager
    def publisher(self, topology: Topology) -> Iterator[Publisher]:
        with Publisher(topology, self.url) as publisher:
            yield publisher

    def get_all(self, queue: str, expected: int, timeout: float = 15.0) -> list[Taken]:
        return [
            Taken(g.body, g.properties.message_id, g.properties.content_type, g.headers)
            for g in get_all(self.url, queue, expected, timeout=timeout)
        ]

    def message_count(self, queue: str) -> int:
        return message_count(self.url, queue)

    def message_count_or_none(self, queue: str) -> int | None:
        try:
            return message_count(self.url, queue)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return None
            raise

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str = "") -> Any:
        return wait_for(predicate, timeout, what or "condition")

    def guard(self, app: App) -> Any:
        return app.guard() if transport(self.kind) == "sync" else app.async_guard()

    def now_ms(self) -> int:
        return now_ms()

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.fixture
def running() -> Iterator[list[RunningWorker]]:
    """The workers a test started; those still running are stopped after it (before its
    topology is deleted)."""
    workers: list[RunningWorker] = []
    yield workers
    for worker in workers:
        if worker.thread.is_alive():
            worker.stop()


def _bench(request: pytest.FixtureRequest) -> RealBench:
    return RealBench(
        str(request.param),
        request.getfixturevalue("make_topology"),
        request.getfixturevalue("broker_url"),
        request.getfixturevalue("broker_info"),
        request.getfixturevalue("running"),
    )


@pytest.fixture(params=HANDLER_KINDS)
def bench(request: pytest.FixtureRequest) -> RealBench:
    """A worker and the handlers it runs: "sync", "async", "async-def"."""
    return _bench(request)


@pytest.fixture(params=KINDS)
def worker_bench(request: pytest.FixtureRequest) -> RealBench:
    """A worker alone ("sync", "async"), for what happens before any handler runs."""
    return _bench(request)


class TestRealWorkers(WorkerBehaviour):
    """tests/worker_behaviour.py on the sync and async workers and a real broker."""


# -- only on a real broker ------------------------------------------------------------------


def test_reconnects_after_the_server_closes_the_connection(
    bench: RealBench, management: ManagementEndpoint
) -> None:
    topology = bench.declared()
    app = App(topology, store=MemoryStore())
    calls = bench.calls()

    def slow_for_40(message: Any, _ctx: HandlerContext) -> float:
        return 2.5 if message.order_id == 40 else 0.0

    app.add_consumer(QUEUE, bench.handler(calls, sleep=slow_for_40), model=CancelOrder)
    worker = bench.run_worker(app)
    [connection] = connections_named(management, worker.name)

    publish(bench, topology, {"order_id": 40})
    calls.wait_started(1)
    # The server drops the worker's connection while the handler of 40 runs: its ack
    # can no longer be sent; the broker redelivers 40, and the guard sees it through.
    close_connections(management, [connection])
    wait_for(
        lambda: worker.stats.reconnects == 1 and worker.worker.started.is_set(), 15, "a reconnect"
    )
    publish(bench, topology, {"order_id": 41})

    wait_for(
        lambda: sorted(c.message.order_id for c in calls.finished) == [40, 41], 15, "both handled"
    )
    wait_for(
        lambda: (
            bench.message_count(topology.names.business_queue(QUEUE)) == 0
            and worker.stats.duplicate == 1
        ),
        15,
        f"the redelivered 40 to be skipped as done ({worker.stats})",
    )
    worker.stop()
    assert [c.message.order_id for c in calls.started].count(40) == 1  # one effect


def test_a_copy_that_cannot_be_sent_does_not_stop_the_next_one(bench: RealBench) -> None:
    """Both workers publish retry and park copies the same way: on their own connection,
    through a publisher whose channel, once lost (here: the broker closes it, 404, for a
    copy to a tier exchange that was deleted), is opened again for the next copy. The copy
    that could not be sent is dead-lettered to the parking lot, never lost or acked."""
    topology = bench.declared(**retrying(tiers=["1s"], max_attempts=3))
    names = topology.names
    with connected(bench.url) as conn:  # the 3s tier's exchange is gone
        channel = conn.channel()
        channel.exchange_delete(names.tier_exchange("3s"))
        channel.close()
    app = App(topology, store=MemoryStore())
    calls = bench.calls()

    def steer(message: Any, ctx: HandlerContext) -> None:
        if ctx.attempt == 1:
            raise Retry("later", tier="3s" if message.order_id == 1 else None)

    app.add_consumer(QUEUE, bench.handler(calls, then=steer), model=CancelOrder)
    worker = bench.run_worker(app)
    publish(bench, topology, {"order_id": 1})
    parked = bench.get_all(names.parking_queue(QUEUE), 1)
    assert parked[0].headers.get("x-death"), "dead-lettered by the broker (rejected)"
    publish(bench, topology, {"order_id": 2})
    [done] = calls.wait_finished(1, timeout=20)  # a handler that raises does not finish
    assert (done.message.order_id, done.ctx.attempt) == (2, 2)  # its retry copy went out
    bench.wait_for(lambda: worker.stats.acked == 1, 10, "order 2 acked on attempt 2")
    worker.stop()
    assert (worker.stats.publish_failures, worker.stats.parked) == (1, 1), worker.stats
    assert worker.stats.retried == 1


def test_the_sync_worker_refuses_an_async_handler(make_topology: Callable[..., Topology]) -> None:
    from rabbit_delay import Worker

    app = App(make_topology(), store=MemoryStore())

    @app.consumer(QUEUE, model=CancelOrder)
    async def cancel(message: CancelOrder, ctx: HandlerContext) -> None: ...

    with pytest.raises(ConfigError, match="cannot run async handlers"):
        Worker(app)


# -- the broker cancels a consumer over its consumer_timeout --------------------------------------

CONSUMER_TIMEOUT_MS = 3_000


@pytest.fixture(params=HANDLER_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """A worker and the handlers it runs: "sync", "async", "async-def"."""
    return str(request.param)


@pytest.fixture(scope="module")
def timeout_node(broker_url: str) -> Iterator[ScratchNode]:
    """A scratch node of the broker-under-test's version with consumer_timeout = 3 s.

    4.3 times a quorum consumer out on a timer of its own (basic.cancel at 3.0 s, measured);
    older versions check on the channel tick, once a minute by default (406 at ~60 s), so
    this node ticks every second (no rabbitmq.conf key: set in the running node).
    """
    conf = [f"consumer_timeout = {CONSUMER_TIMEOUT_MS}"]
    with started_node(scratch_kind(broker_url), conf=conf) as node:
        node.ctl("eval", "application:set_env(rabbit, channel_tick_interval, 1000).")
        yield node


@pytest.mark.slow
# One xdist worker runs the three kinds, so they share the module's node: apart, each
# worker started a node of its own (20-25 s each on a loaded machine).
@pytest.mark.xdist_group("timeout-node")
def test_a_consumer_the_broker_timed_out_consumes_again(
    kind: str, timeout_node: ScratchNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_delay.worker")
    url = timeout_node.url
    broker = server_info(url)
    topology = topology_from_dict(
        {"namespace": unique_namespace(), "tiers": {"1s": "1s"}, "queues": {QUEUE: {}}}
    )
    node = RealBench(kind, topology_from_dict, url, broker, [])
    node.declare(topology)
    business = topology.names.business_queue(QUEUE)
    app = App(topology, store=MemoryStore())
    calls = node.calls()

    def slow_for_50(message: Any, _ctx: HandlerContext) -> float:
        return 2 * CONSUMER_TIMEOUT_MS / 1000 if message.order_id == 50 else 0.0

    app.add_consumer(QUEUE, node.handler(calls, sleep=slow_for_50), model=CancelOrder)
    worker = RunningWorker(kind, app, url).start()
    try:
        publish(node, topology, {"order_id": 50})
        calls.wait_started(1)
        # 4.3: basic.cancel of this one consumer; older: the channel closed with 406.
        said = (
            f"{QUEUE}: the broker cancelled the consumer of queue {business}"
            if broker.cancels_timed_out_quorum_consumers
            else f"the broker closed the channel consuming {business}: a delivery stayed unacked "
            "longer than the broker's consumer_timeout"
        )
        wait_for(lambda: said in caplog.text, 20, f"the warning {said!r}")
        wait_for(lambda: worker.worker.started.is_set(), 15, "the worker consuming again")
        publish(node, topology, {"order_id": 51})

        wait_for(
            lambda: sorted(c.message.order_id for c in calls.finished) == [50, 51],
            30,
            "both handled",
        )
        # 50 went back to the queue when its consumer went; its copy is deferred while the
        # first run goes on, then skipped as done. The first run's result is never acked.
        wait_for(
            lambda: worker.stats.duplicate == 1 and message_count(url, business) == 0,
            30,
            f"the redelivered 50 to be skipped as done ({worker.stats})",
        )
    finally:
        worker.stop()
    assert [c.message.order_id for c in calls.started].count(50) == 1  # one effect
    assert worker.stats.stale >= 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and said in r.message]
    assert len(warnings) == 1
    if broker.cancels_timed_out_quorum_consumers:
        assert (worker.stats.consumer_cancels, worker.stats.reconnects) == (1, 0)
        assert "consumer_timeout" in warnings[0].message
        assert "consuming again" in warnings[0].message
    else:
        assert (worker.stats.consumer_cancels, worker.stats.reconnects) == (0, 1)
        # The broker's own reason, as it closed the channel, not the client's "Channel
        # is closed" of the next call on it.
        reason = r"PRECONDITION_FAILED - delivery acknowledgement on channel \d+ timed out"
        assert re.search(reason, warnings[0].message), warnings[0].message
        said_closed = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and "Channel is closed" in r.getMessage()
        ]
        assert said_closed == []
