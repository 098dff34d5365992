"""The consumer framework on the real broker: one behaviour suite, run against the sync
worker (pika, `def` handlers in threads) and the async worker (aio-pika) with `async def`
handlers on its loop and with `def` handlers in its thread pool alike
(`workers.harness.HANDLER_KINDS`). Tests about starting a worker run per worker
(`KINDS`).

Every scenario uses 1 s tiers and waits with deadlines; handlers are built by
`workers.harness.handler` from the same steps. What differs between RabbitMQ versions (a
consumer over its consumer_timeout, the 4.3 retry backend "broker", what a nack counts)
runs on every version, expecting what that version does.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika.exceptions
import pytest
from conftest import message_count, unique_namespace, wait_for
from pydantic import BaseModel

from rabbit_delay import names as h
from rabbit_delay.broker import BrokerInfo
from rabbit_delay.consumer import App, HandlerContext, Reject, Retry
from rabbit_delay.errors import ConfigError, IncompatibleBroker, MissingObjectError
from rabbit_delay.idempotency import (
    DEFAULT_PREFIX,
    DEFAULT_TABLE,
    ClaimResult,
    MemoryStore,
    SQLiteStore,
)
from rabbit_delay.message import now_ms
from rabbit_delay.sync import Publisher, connect, declare, plan
from rabbit_delay.topology import Topology, topology_from_dict
from rabbit_delay.urls import ManagementEndpoint

from ._scratch_node import ScratchNode, scratch_kind, server_info, started_node
from .workers.harness import (
    HANDLER_KINDS,
    KINDS,
    Calls,
    RunningWorker,
    close_connections,
    connections_named,
    get_all,
    handler,
    transport,
)

pytestmark = pytest.mark.integration

QUEUE = "orders.cancel"
Declared = Callable[..., Topology]
Runner = Callable[..., RunningWorker]


class CancelOrder(BaseModel):
    order_id: int
    action: str = "ok"


@pytest.fixture(params=HANDLER_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """A worker and the handlers it runs: "sync", "async", "async-def"."""
    return str(request.param)


@pytest.fixture(params=KINDS)
def worker_kind(request: pytest.FixtureRequest) -> str:
    """A worker alone ("sync", "async"), for what happens before any handler runs."""
    return str(request.param)


@pytest.fixture
def declared(make_topology: Callable[..., Topology], broker_url: str) -> Callable[..., Topology]:
    """A unique topology, declared on the broker."""

    def make(**overrides: Any) -> Topology:
        topology = make_topology(**overrides)
        conn = connect(broker_url, name="rd-test worker declare")
        try:
            declare(conn, topology)
        finally:
            conn.close()
        return topology

    return make


@pytest.fixture
def run_worker(broker_url: str) -> Iterator[Callable[..., RunningWorker]]:
    running: list[RunningWorker] = []

    def start(kind: str, app: App, **options: Any) -> RunningWorker:
        worker = RunningWorker(kind, app, broker_url, **options)
        running.append(worker)
        return worker.start()

    yield start
    for worker in running:
        if worker.thread.is_alive():
            worker.stop()


def publish(url: str, topology: Topology, *bodies: Any, **kwargs: Any) -> list[str]:
    kwargs.setdefault("queue", QUEUE)
    with Publisher(topology, url) as publisher:
        tier = kwargs.pop("tier", "1s")
        return [publisher.publish_delayed(body, tier, **kwargs) for body in bodies]


def retrying(queue: str = QUEUE, **retry: Any) -> dict[str, Any]:
    return {"queues": {queue: {"retry": retry}}}


def sqlite_guarded(tmp_path: Path, lease: str) -> dict[str, Any]:
    """The default guard (SQLite), in a file of the test's own, with a short lease."""
    path = tmp_path / "idempotency.sqlite3"
    return {"idempotency": {"store": "sqlite", "path": str(path), "lease": lease}}


def store_key(topology: Topology, message_id: str) -> str:
    """The idempotency key of `message_id` in QUEUE (scoped to the queue), without the
    store's prefix."""
    return f"{topology.names.business_queue(QUEUE)}:{message_id}"


def stored_state(topology: Topology, message_id: str) -> str | None:
    """What the SQLite guard holds for `message_id`: claimed, done, cancelled or None,
    read from the file as another process would."""
    conn = sqlite3.connect(topology.idempotency.path)
    try:
        row = conn.execute(
            f"SELECT state FROM {DEFAULT_TABLE} WHERE key = ?",
            (DEFAULT_PREFIX + store_key(topology, message_id),),
        ).fetchone()
    finally:
        conn.close()
    return None if row is None else str(row[0])


# -- acks and context ------------------------------------------------------------------------


def test_acks_after_the_handler_returned(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls), model=CancelOrder)
    worker = run_worker(kind, app)
    ids = publish(broker_url, topology, {"order_id": 1}, {"order_id": 2}, {"order_id": 3})

    finished = calls.wait_finished(3)
    wait_for(lambda: worker.stats.acked == 3, 5, "3 acks")
    worker.stop()

    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
    assert sorted(c.message.order_id for c in finished) == [1, 2, 3]
    by_id = {c.ctx.message_id: c.ctx for c in finished}
    assert set(by_id) == set(ids)
    ctx = by_id[ids[0]]
    assert ctx.queue == QUEUE
    assert ctx.attempt == 1
    assert ctx.max_attempts == topology.queues[QUEUE].retry.max_attempts
    assert ctx.tier == "1s"
    assert ctx.redelivered is False
    assert ctx.scheduled_at is not None
    assert ctx.lateness_ms is not None
    assert -1_000 < ctx.lateness_ms < 10_000
    assert ctx.headers[h.H_TARGET] == topology.names.queue_key(QUEUE)


# -- retries and the parking lot ----------------------------------------------------------------


def test_retries_through_the_tier_then_parks_with_the_reason(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared(**retrying(tiers=["1s"], max_attempts=3))
    app = App(topology, store=MemoryStore())
    calls = Calls()

    def boom(message: Any, ctx: HandlerContext) -> None:
        raise ValueError(f"payment service down (attempt {ctx.attempt})")

    app.add_consumer(QUEUE, handler(kind, calls, then=boom), model=CancelOrder)
    worker = run_worker(kind, app)
    [message_id] = publish(broker_url, topology, {"order_id": 7})

    parked = get_all(broker_url, topology.names.parking_queue(QUEUE), 1, timeout=20)[0]
    worker.stop()

    assert [c.ctx.attempt for c in calls.started] == [1, 2, 3]
    assert all(c.ctx.message_id == message_id for c in calls.started)
    # The retries went through the 1 s tier; the broker's x-death of the first trip was
    # stripped when re-publishing, so each delivery carries one tier expiry only.
    for call in calls.started[1:]:
        assert call.ctx.tier == "1s"
        deaths = call.ctx.headers.get("x-death") or []
        assert sum(int(d["count"]) for d in deaths) == 1
    assert calls.finished == []

    headers = parked.headers
    assert parked.properties.message_id == message_id
    assert parked.properties.content_type == "application/json"
    assert CancelOrder.model_validate_json(parked.body).order_id == 7
    assert headers[h.H_ERROR_TYPE] == "ValueError"
    assert headers[h.H_ERROR_MESSAGE] == "payment service down (attempt 3)"
    assert "ValueError: payment service down" in str(headers[h.H_ERROR_TRACEBACK])
    assert headers[h.H_ORIGINAL_QUEUE] == QUEUE
    assert headers[h.H_ATTEMPT] == 3
    assert headers[h.H_PARK_REASON] == "max_attempts"
    assert headers[h.H_FIRST_FAILURE] <= headers[h.H_LAST_FAILURE]
    assert headers[h.H_LAST_FAILURE] - headers[h.H_FIRST_FAILURE] >= 1_500  # two 1 s trips
    # x-delivery-count is the parking lot's own (a quorum queue adds it on delivery).
    broker_headers = {k for k in headers if k.startswith(h.BROKER_HEADER_PREFIXES)}
    assert broker_headers <= {"x-delivery-count"}
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
    assert worker.stats.retried == 2
    assert worker.stats.parked == 1


def test_a_retry_that_succeeds_is_acked_and_never_parked(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared(**retrying(tiers=["1s"], max_attempts=3))
    app = App(topology, store=MemoryStore())
    calls = Calls()

    def flaky(message: Any, ctx: HandlerContext) -> None:
        if ctx.attempt == 1:
            raise ConnectionError("timeout")

    app.add_consumer(QUEUE, handler(kind, calls, then=flaky), model=CancelOrder)
    worker = run_worker(kind, app)
    publish(broker_url, topology, {"order_id": 8})

    [done] = calls.wait_finished(1, timeout=15)
    wait_for(lambda: worker.stats.acked == 1, 5, "the ack")
    worker.stop()
    assert done.ctx.attempt == 2
    assert done.ctx.headers[h.H_ERROR_TYPE] == "ConnectionError"  # the last failure travels along
    assert message_count(broker_url, topology.names.parking_queue(QUEUE)) == 0
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0


def test_a_retry_goes_back_only_to_the_queue_that_failed(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared(
        queues={
            "billing": {"bindings": ["order.paid"], "retry": {"tiers": ["1s"]}},
            "mailer": {"bindings": ["order.paid"]},
        }
    )
    app = App(topology, store=MemoryStore())
    billing, mailer = Calls(), Calls()

    def fail_first(message: Any, ctx: HandlerContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("ledger locked")

    app.add_consumer("billing", handler(kind, billing, then=fail_first), model=CancelOrder)
    app.add_consumer("mailer", handler(kind, mailer), model=CancelOrder)
    worker = run_worker(kind, app)
    with Publisher(topology, broker_url) as publisher:
        publisher.publish_delayed({"order_id": 9}, "1s", routing_key="order.paid")

    billing.wait_finished(1, timeout=15)
    wait_for(lambda: worker.stats.acked == 2, 5, "both acks")
    worker.stop()
    assert [c.ctx.attempt for c in billing.started] == [1, 2]
    assert len(mailer.started) == 1  # the retry did not reach the other queue bound to the key


# -- poison messages ---------------------------------------------------------------------------


def test_undecodable_and_invalid_bodies_are_parked_at_once(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared(**retrying(tiers=["1s"], max_attempts=5))
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls), model=CancelOrder)
    worker = run_worker(kind, app)
    poison, invalid = publish(broker_url, topology, b"\xff{not json", {"order_id": "forty-two"})

    parked = get_all(broker_url, topology.names.parking_queue(QUEUE), 2)
    worker.stop()

    assert calls.started == []
    reasons = {p.properties.message_id: p.headers for p in parked}
    assert reasons[poison][h.H_PARK_REASON] == "decode_error"
    assert reasons[invalid][h.H_PARK_REASON] == "validation_error"
    for headers in reasons.values():
        assert headers[h.H_ATTEMPT] == 1
        assert headers[h.H_ERROR_TYPE] == "pydantic_core.ValidationError"
        assert headers[h.H_ORIGINAL_QUEUE] == QUEUE
    assert "order_id" in str(reasons[invalid][h.H_ERROR_MESSAGE])
    assert [p.body for p in parked if p.properties.message_id == poison] == [b"\xff{not json"]
    assert worker.stats.retried == 0


# -- handler signals ---------------------------------------------------------------------------


def test_retry_and_reject_steer_the_message(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    # The policy would wait 3 s; Retry(tier="1s") asks for the short tier instead.
    topology = declared(**retrying(tiers=["3s"], max_attempts=4))
    app = App(topology, store=MemoryStore())
    calls = Calls()

    def steer(message: Any, ctx: HandlerContext) -> None:
        if message.action == "later" and ctx.attempt == 1:
            raise Retry("stock not there yet", tier="1s")
        if message.action == "refuse":
            raise Reject("order 11 belongs to another shop")

    app.add_consumer(QUEUE, handler(kind, calls, then=steer), model=CancelOrder)
    worker = run_worker(kind, app)
    later, refuse = publish(
        broker_url,
        topology,
        {"order_id": 10, "action": "later"},
        {"order_id": 11, "action": "refuse"},
    )

    [parked] = get_all(broker_url, topology.names.parking_queue(QUEUE), 1)
    wait_for(lambda: len(calls.finished) == 1, 15, "the retried message to succeed")
    worker.stop()

    assert parked.properties.message_id == refuse
    assert parked.headers[h.H_PARK_REASON] == "rejected"
    assert parked.headers[h.H_ERROR_MESSAGE] == "order 11 belongs to another shop"
    assert parked.headers[h.H_ERROR_TYPE] == "rabbit_delay.consumer.Reject"
    assert parked.headers[h.H_ATTEMPT] == 1
    [done] = calls.finished
    assert done.ctx.message_id == later
    assert (done.ctx.attempt, done.ctx.tier) == (2, "1s")
    assert done.ctx.headers[h.H_ERROR_TYPE] == "rabbit_delay.consumer.Retry"


# -- idempotency -------------------------------------------------------------------------------


def test_a_duplicate_of_a_handled_message_is_acked_and_skipped(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls), model=CancelOrder)
    worker = run_worker(kind, app)

    publish(broker_url, topology, {"order_id": 12}, message_id="order-12-timeout")
    calls.wait_finished(1)
    publish(broker_url, topology, {"order_id": 12}, message_id="order-12-timeout")
    wait_for(lambda: worker.stats.duplicates == 1, 10, "the duplicate to be skipped")
    worker.stop()

    assert len(calls.started) == 1
    guard = app.guard() if transport(kind) == "sync" else app.async_guard()
    assert guard.stats.duplicates_skipped == 1
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0


def test_a_duplicate_arriving_while_the_first_runs_is_not_run_beside_it(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls, sleep=1.5), model=CancelOrder)
    worker = run_worker(kind, app, concurrency=4)

    publish(broker_url, topology, {"order_id": 13}, {"order_id": 13}, message_id="order-13")
    # The second copy is deferred through the 1 s tier, comes back after the first is
    # done, and is skipped then.
    wait_for(lambda: worker.stats.duplicates == 1, 15, "the deferred copy to be skipped")
    worker.stop()

    assert len(calls.started) == 1
    assert worker.stats.deferred >= 1
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0


class FlakyStore(MemoryStore):
    """An idempotency store whose first `failures` claims raise (an outage), then works."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures_left = failures
        self.failed_claims = 0

    def claim(self, key: str, owner: str, *, now_ms: int, lease_ms: int) -> ClaimResult:
        if self.failures_left > 0:
            self.failures_left -= 1
            self.failed_claims += 1
            raise ConnectionError("idempotency store unreachable")
        return super().claim(key, owner, now_ms=now_ms, lease_ms=lease_ms)


def test_a_store_outage_longer_than_the_delivery_limit_parks_nothing(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str, broker_info: BrokerInfo
) -> None:
    # The claim fails on more deliveries than the queue's delivery limit. Where the broker
    # counts a nack-requeue towards the limit (3.10, 4.0-4.2), handing the message back
    # with a nack would have the broker dead-letter a good message to the parking lot.
    limit = 2
    topology = declared(queues={QUEUE: {"delivery_limit": limit}})
    store = FlakyStore(failures=limit + 2)
    app = App(topology, store=store)
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls), model=CancelOrder)
    worker = run_worker(kind, app)
    [message_id] = publish(broker_url, topology, {"order_id": 16})

    [done] = calls.wait_finished(1, timeout=40)
    wait_for(lambda: worker.stats.acked == 1, 10, "the ack")
    worker.stop()

    assert store.failed_claims == limit + 2
    assert done.ctx.message_id == message_id
    assert done.ctx.attempt == 1  # an outage is not an attempt
    assert len(calls.started) == 1
    # Each failed claim handed the delivery back once: a nack where it does not count
    # (4.3+), else a same-attempt copy through the shortest tier. Counted once each.
    stats = worker.stats
    if broker_info.nack_requeue_counts:
        assert (stats.deferred, stats.requeued) == (limit + 2, 0), stats
    else:
        assert (stats.deferred, stats.requeued) == (0, limit + 2), stats
    assert message_count(broker_url, topology.names.parking_queue(QUEUE)) == 0
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0


def test_cancel_drops_the_message_when_it_comes_due(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls), model=CancelOrder)
    worker = run_worker(kind, app)

    cancelled, kept = publish(broker_url, topology, {"order_id": 14}, {"order_id": 15})
    app.cancel(cancelled)  # the order was paid: its timeout must not fire

    calls.wait_finished(1)
    wait_for(lambda: worker.stats.cancelled == 1, 10, "the cancelled message to be dropped")
    worker.stop()
    assert [c.ctx.message_id for c in calls.started] == [kept]
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0


LEASE_MS = 1_500  # renewed every 500 ms
HANDLER_S = 2.5  # 5 renewals


def test_a_lease_lost_while_the_handler_runs_is_noticed_and_logged(
    kind: str,
    declared: Declared,
    run_worker: Runner,
    broker_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_delay.worker")
    topology = declared(**sqlite_guarded(tmp_path, lease=f"{LEASE_MS}ms"))
    app = App(topology)
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls, sleep=HANDLER_S), model=CancelOrder)
    worker = run_worker(kind, app, close_app=True)
    [message_id] = publish(broker_url, topology, {"order_id": 17})

    calls.wait_started(1)
    assert stored_state(topology, message_id) == "claimed"
    # Another process takes the key from under the running handler: a tombstone
    # replaces its claim, so the next renewal finds the claim gone.
    other = SQLiteStore(topology.idempotency.path)
    try:
        other.cancel(store_key(topology, message_id), now_ms=now_ms(), retention_ms=60_000)
    finally:
        other.close()
    # A renewal is due every LEASE_MS / 3, looked for twice as often: the loss shows
    # within about 0.75 s, well before the handler ends.
    wait_for(lambda: worker.stats.leases_lost >= 1, HANDLER_S - 0.5, "the lost lease")
    assert calls.finished == []  # noticed while the handler still ran

    calls.wait_finished(1)
    wait_for(lambda: worker.stats.acked == 1, 5, "the ack")  # the handler's result stands
    worker.stop()
    assert worker.stats.leases_lost == 1, worker.stats
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "rabbit_delay.worker" and r.levelno == logging.WARNING
    ]
    lost = [w for w in warnings if "lease" in w and "lost" in w]
    key = store_key(topology, message_id)
    assert any(key in w and "while its handler runs" in w for w in lost), warnings
    assert any(key in w and "finished after its lease was lost" in w for w in lost), warnings
    assert stored_state(topology, message_id) == "cancelled"  # done never overwrites it


# -- lifecycle ---------------------------------------------------------------------------------


def test_graceful_stop_finishes_in_flight_handlers_and_hands_back_the_rest(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str, broker_info: BrokerInfo
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls, sleep=1.0), model=CancelOrder)
    worker = run_worker(kind, app, concurrency=2, prefetch=4)
    publish(broker_url, topology, *({"order_id": n} for n in range(20, 24)))

    calls.wait_started(2)
    # The other 2 must have reached the worker (prefetched) before the stop, else they
    # simply stay in the queue and nothing is handed back.
    wait_for(lambda: worker.stats.received == 4, 10, "all 4 delivered to the worker")
    worker.stop()  # what SIGINT / SIGTERM do

    assert len(calls.finished) == len(calls.started) == 2  # in flight: finished, acked
    assert worker.stats.acked == 2
    # The 2 prefetched but not started were nacked back, each once, and counted once.
    assert worker.stats.requeued == 2, worker.stats
    queue = topology.names.business_queue(QUEUE)
    wait_for(lambda: message_count(broker_url, queue) == 2, 10, "the 2 not started, back")
    back = get_all(broker_url, queue, 2)
    # One hand-back each: counted by the queue where a nack counts (before 4.3); from
    # 4.3 a nack is not counted (a lost channel would have been: 1).
    expected_count = 1 if broker_info.nack_requeue_counts else None
    assert [g.headers.get(h.DELIVERY_COUNT_HEADER) for g in back] == [expected_count] * 2
    assert {g.properties.message_id for g in back}.isdisjoint(
        c.ctx.message_id for c in calls.started
    )


def test_a_handler_past_the_shutdown_timeout_is_redelivered(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls, sleep=3.0), model=CancelOrder)
    worker = run_worker(kind, app, shutdown_timeout=0.3)
    publish(broker_url, topology, {"order_id": 30})

    calls.wait_started(1)
    worker.stop()
    assert worker.stats.acked == 0
    queue = topology.names.business_queue(QUEUE)
    wait_for(lambda: message_count(broker_url, queue) == 1, 10, "the unfinished one, back")


def test_a_handler_past_the_shutdown_timeout_records_done_before_the_store_closes(
    kind: str, declared: Declared, run_worker: Runner, broker_url: str, tmp_path: Path
) -> None:
    # Past the drain timeout the connection is closed (the broker takes the message
    # back), but the handler keeps running: run() returns only once it recorded done,
    # and only then is the store closed, as `rabbit-delay worker` closes it. The copy
    # the next worker gets is then a duplicate: one effect. (The store used to be
    # closed under the handler: no done-record, and the copy ran again after the lease.)
    topology = declared(**sqlite_guarded(tmp_path, lease="2s"))
    app = App(topology)  # the topology's guard: SQLite in tmp_path
    calls = Calls()
    app.add_consumer(QUEUE, handler(kind, calls, sleep=3.0), model=CancelOrder)
    first = run_worker(kind, app, shutdown_timeout=1.0, close_app=True)
    [message_id] = publish(broker_url, topology, {"order_id": 31})

    calls.wait_started(1)
    first.stop()  # returns once run() returned and the store is closed

    assert [c.ctx.message_id for c in calls.finished] == [message_id]
    assert stored_state(topology, message_id) == "done"
    assert (first.stats.acked, first.stats.stale) == (0, 1), first.stats  # its channel closed

    again = App(topology)  # the next worker process opens the file anew
    second_calls = Calls()
    again.add_consumer(QUEUE, handler(kind, second_calls), model=CancelOrder)
    second = run_worker(kind, again, close_app=True)
    wait_for(
        lambda: second.stats.duplicates + second.stats.acked + second.stats.deferred >= 1,
        15,
        f"the redelivered copy to be settled ({second.stats})",
    )
    second.stop()
    assert (second.stats.duplicates, second.stats.acked) == (1, 0), second.stats
    assert second_calls.started == []
    assert len(calls.started) == 1
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0


def test_reconnects_after_the_server_closes_the_connection(
    kind: str,
    declared: Callable[..., Topology],
    run_worker: Callable[..., RunningWorker],
    broker_url: str,
    management: ManagementEndpoint,
) -> None:
    topology = declared()
    app = App(topology, store=MemoryStore())
    calls = Calls()

    def slow_for_40(message: Any, _ctx: HandlerContext) -> float:
        return 2.5 if message.order_id == 40 else 0.0

    app.add_consumer(QUEUE, handler(kind, calls, sleep=slow_for_40), model=CancelOrder)
    worker = run_worker(kind, app)
    [connection] = connections_named(management, worker.name)

    publish(broker_url, topology, {"order_id": 40})
    calls.wait_started(1)
    # The server drops the worker's connection while the handler of 40 runs: its ack
    # can no longer be sent; the broker redelivers 40, and the guard sees it through.
    close_connections(management, [connection])
    wait_for(
        lambda: worker.stats.reconnects == 1 and worker.worker.started.is_set(), 15, "a reconnect"
    )
    publish(broker_url, topology, {"order_id": 41})

    wait_for(
        lambda: sorted(c.message.order_id for c in calls.finished) == [40, 41], 15, "both handled"
    )
    wait_for(
        lambda: (
            message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
            and worker.stats.duplicates == 1
        ),
        15,
        f"the redelivered 40 to be skipped as done ({worker.stats})",
    )
    worker.stop()
    assert [c.message.order_id for c in calls.started].count(40) == 1  # one effect


# -- refusing to start ---------------------------------------------------------------------------


def test_refuses_a_queue_missing_on_the_broker_and_declares_on_request(
    worker_kind: str,
    make_topology: Callable[..., Topology],
    run_worker: Callable[..., RunningWorker],
) -> None:
    topology = make_topology()  # not declared
    app = App(topology, store=MemoryStore())
    app.add_consumer(QUEUE, handler(worker_kind, Calls()), model=CancelOrder)
    with pytest.raises(MissingObjectError, match="rabbit-delay declare"):
        run_worker(worker_kind, app)
    worker = run_worker(worker_kind, app, declare=True)
    worker.stop()


def test_the_sync_worker_refuses_an_async_handler(make_topology: Callable[..., Topology]) -> None:
    from rabbit_delay.sync.worker import Worker

    app = App(make_topology(), store=MemoryStore())

    @app.consumer(QUEUE, model=CancelOrder)
    async def cancel(message: CancelOrder, ctx: HandlerContext) -> None: ...

    with pytest.raises(ConfigError, match="cannot run async handlers"):
        Worker(app)


# -- the broker cancels a consumer over its consumer_timeout --------------------------------------

CONSUMER_TIMEOUT_MS = 3_000


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
def test_a_consumer_the_broker_timed_out_consumes_again(
    kind: str, timeout_node: ScratchNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_delay.worker")
    url = timeout_node.url
    broker = server_info(url)
    topology = topology_from_dict(
        {"namespace": unique_namespace(), "tiers": {"1s": "1s"}, "queues": {QUEUE: {}}}
    )
    conn = connect(url, name="rd-test consumer timeout declare")
    try:
        declare(conn, topology)
    finally:
        conn.close()
    business = topology.names.business_queue(QUEUE)
    app = App(topology, store=MemoryStore())
    calls = Calls()

    def slow_for_50(message: Any, _ctx: HandlerContext) -> float:
        return 2 * CONSUMER_TIMEOUT_MS / 1000 if message.order_id == 50 else 0.0

    app.add_consumer(QUEUE, handler(kind, calls, sleep=slow_for_50), model=CancelOrder)
    worker = RunningWorker(kind, app, url).start()
    try:
        publish(url, topology, {"order_id": 50})
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
        publish(url, topology, {"order_id": 51})

        wait_for(
            lambda: sorted(c.message.order_id for c in calls.finished) == [50, 51],
            30,
            "both handled",
        )
        # 50 went back to the queue when its consumer went; its copy is deferred while the
        # first run goes on, then skipped as done. The first run's result is never acked.
        wait_for(
            lambda: worker.stats.duplicates == 1 and message_count(url, business) == 0,
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


# -- retry backend "broker" (RabbitMQ 4.3+ quorum queue delayed retry) -----------------------------

BROKER_RETRY = {"backend": "broker", "min": "1s", "max": "2s", "max_attempts": 4}


def broker_retrying(**retry: Any) -> dict[str, Any]:
    return {"queues": {QUEUE: {"delivery_limit": 4, "retry": {**BROKER_RETRY, **retry}}}}


def needs_delayed_retry(broker_info: BrokerInfo) -> None:
    if not broker_info.supports_delayed_retry:
        pytest.skip(
            'retry backend = "broker" needs RabbitMQ 4.3+ (quorum queue delayed retry); the '
            f"broker under test is {broker_info.describe()} (its refusal is tested here)"
        )


def test_broker_retry_backend_is_refused_before_4_3(
    worker_kind: str,
    make_topology: Callable[..., Topology],
    run_worker: Runner,
    broker_url: str,
    broker_info: BrokerInfo,
) -> None:
    if broker_info.supports_delayed_retry:
        pytest.skip(f"{broker_info.describe()} has delayed retry: declared and used below")
    topology = make_topology(**broker_retrying())
    conn = connect(broker_url, name="rd-test refused declare")
    try:
        for attempt in (declare, plan):
            with pytest.raises(IncompatibleBroker, match=r"needs quorum queue delayed retry"):
                attempt(conn, topology)
    finally:
        conn.close()
    assert message_count_or_none(broker_url, topology.names.business_queue(QUEUE)) is None
    app = App(topology, store=MemoryStore())
    app.add_consumer(QUEUE, handler(worker_kind, Calls()), model=CancelOrder)
    for declare_first in (False, True):
        with pytest.raises(IncompatibleBroker, match=re.escape(broker_info.version_text)):
            run_worker(worker_kind, app, declare=declare_first)


def message_count_or_none(url: str, queue: str) -> int | None:
    """`message_count`, or None when the queue does not exist."""
    try:
        return message_count(url, queue)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return None
        raise


@pytest.mark.slow
def test_broker_retries_arrive_after_the_brokers_delays_then_park_with_the_reason(
    kind: str,
    declared: Declared,
    run_worker: Runner,
    broker_url: str,
    broker_info: BrokerInfo,
) -> None:
    needs_delayed_retry(broker_info)
    topology = declared(**broker_retrying())
    app = App(topology, store=MemoryStore())
    calls = Calls()
    failed_at: list[float] = []  # monotonic, just before each failure
    first_failure_ms: list[int] = []

    def boom(message: Any, ctx: HandlerContext) -> None:
        if not first_failure_ms:
            first_failure_ms.append(now_ms())
        failed_at.append(time.monotonic())
        raise ValueError(f"payment service down (attempt {ctx.attempt})")

    app.add_consumer(QUEUE, handler(kind, calls, then=boom), model=CancelOrder)
    worker = run_worker(kind, app)
    [message_id] = publish(broker_url, topology, {"order_id": 60})

    [parked] = get_all(broker_url, topology.names.parking_queue(QUEUE), 1, timeout=30)
    worker.stop()

    assert [c.ctx.attempt for c in calls.started] == [1, 2, 3, 4]
    # The same copy every time, requeued: never through a tier again, counted by the queue.
    assert [c.ctx.headers.get(h.DELIVERY_COUNT_HEADER) for c in calls.started] == [None, 1, 2, 3]
    for call in calls.started:  # one trip through the 1 s tier: when it was published
        deaths = call.ctx.headers.get("x-death") or []
        assert sum(int(d["count"]) for d in deaths) == 1
    assert all(c.ctx.redelivered for c in calls.started[1:])
    # Retry n waits min(1 s x n, 2 s) after the failure: never early. Late by the broker's
    # timer and the worker's reject (a few ms here); 1 s of tolerance on a busy machine.
    expected = [1.0, 2.0, 2.0]
    waited = [calls.started[n + 1].at - failed_at[n] for n in range(3)]
    for n, (took, want) in enumerate(zip(waited, expected, strict=True), start=1):
        assert took >= want, f"retry {n} came {want - took:.3f}s early (waited {waited})"
        assert took < want + 1.0, f"retry {n} came {took - want:.3f}s late (waited {waited})"

    headers = parked.headers
    assert parked.properties.message_id == message_id
    assert CancelOrder.model_validate_json(parked.body).order_id == 60
    assert headers[h.H_PARK_REASON] == "max_attempts"
    assert headers[h.H_ATTEMPT] == 4
    assert headers[h.H_ERROR_TYPE] == "ValueError"
    assert headers[h.H_ERROR_MESSAGE] == "payment service down (attempt 4)"
    assert "ValueError: payment service down" in str(headers[h.H_ERROR_TRACEBACK])
    assert headers[h.H_ORIGINAL_QUEUE] == QUEUE
    # A requeue carries no header: the first failure is derived from the broker's delays
    # (1 + 2 + 2 s before the last), the latest it can have been.
    assert headers[h.H_LAST_FAILURE] - headers[h.H_FIRST_FAILURE] == 5_000
    assert first_failure_ms[0] <= headers[h.H_FIRST_FAILURE] + 5  # ms rounding of two clocks
    assert headers[h.H_FIRST_FAILURE] - first_failure_ms[0] < 1_500
    broker_headers = {k for k in headers if k.startswith(h.BROKER_HEADER_PREFIXES)}
    assert broker_headers <= {"x-delivery-count"}  # the parking lot's own, if any
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
    assert message_count(broker_url, topology.names.tier_queue("1s")) == 0
    assert (worker.stats.retried, worker.stats.parked, worker.stats.acked) == (3, 1, 0)


def test_a_broker_retry_that_succeeds_is_acked(
    kind: str,
    declared: Declared,
    run_worker: Runner,
    broker_url: str,
    broker_info: BrokerInfo,
) -> None:
    needs_delayed_retry(broker_info)
    topology = declared(**broker_retrying())
    app = App(topology, store=MemoryStore())
    calls = Calls()

    def flaky(message: Any, ctx: HandlerContext) -> None:
        if ctx.attempt == 1:
            raise ConnectionError("timeout")

    app.add_consumer(QUEUE, handler(kind, calls, then=flaky), model=CancelOrder)
    worker = run_worker(kind, app)
    publish(broker_url, topology, {"order_id": 61})

    [done] = calls.wait_finished(1, timeout=15)
    wait_for(lambda: worker.stats.acked == 1, 5, "the ack")
    worker.stop()
    assert done.ctx.attempt == 2
    assert worker.stats.retried == 1
    assert message_count(broker_url, topology.names.parking_queue(QUEUE)) == 0
    assert message_count(broker_url, topology.names.business_queue(QUEUE)) == 0
