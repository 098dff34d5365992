"""The behaviour every worker must have, run against each implementation.

Not a test module itself: `WorkerBehaviour` is subclassed by
tests/integration/test_worker_behaviour.py (the sync worker and the async worker on a
real broker: `async def` handlers on its loop and `def` handlers in its thread pool) and
by tests/unit/test_worker_behaviour_memory.py (rabbit_delay.testing's in-memory worker
on its MemoryBroker, with `def` and with `async def` handlers, emulating RabbitMQ 4.3
and 3.10). All of them drive the same delivery program (_consumer/delivery.py), so the
same assertions must hold, written once, here.

Each implementation module provides two fixtures of `Bench`es (the driver interface
below): `bench`, per worker and handler kind, and `worker_bench`, per worker, for what
happens before any handler runs. A real bench publishes on the broker under test and
waits in real time; the in-memory bench advances the virtual clock, so every wait below
is a deadline in real seconds there and in virtual seconds here.

What differs between RabbitMQ versions (the 4.3 retry backend "broker", what a nack
counts) runs on every version, expecting what that version does. Cases that need a
handler to take time skip the in-memory `def` handlers, which run inline and take no
virtual time (docs/testing.md); cases that cannot apply to an in-memory broker
(connection loss, the broker's consumer_timeout) stay in the real module.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict  # pydantic's rule on Python < 3.12

from rabbit_delay import (
    App,
    HandlerContext,
    IncompatibleBroker,
    MissingObjectError,
    Reject,
    Retry,
    ScheduleState,
    Topology,
)
from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._idempotency.guard import DEFAULT_PREFIX
from rabbit_delay._stores.sqlite import DEFAULT_IDEMPOTENCY_TABLE
from rabbit_delay.stores import ClaimResult, MemoryStore, SQLiteStore
from rabbit_delay.sync import Schedule

QUEUE = "orders.cancel"
ASYNC_HANDLER_KINDS = ("async", "memory-async")  # kinds whose handlers are `async def`


class CancelOrder(BaseModel):
    order_id: int
    action: str = "ok"


UNANNOTATED = ""  # `annotation=UNANNOTATED`: a message parameter without an annotation


class Job(TypedDict):
    job: str
    tries: int


@dataclass(frozen=True)
class Typed:
    """A handler typed by its annotation (or not, or overridden by `model`): the message
    published, what the handler must receive, and a message that does not fit (None: all
    fit) with the reason it is parked for."""

    annotation: str | None
    body: Any
    received: Any
    misfit: Any = None
    reason: str | None = None
    model: Any = None


# One business queue per case (docs/consumer.md, "What a handler receives").
TYPED = {
    "typed.dict": Typed(
        "dict[str, Any]", {"order_id": 1}, {"order_id": 1}, [1, 2], "validation_error"
    ),
    "typed.job": Typed(
        "Job",
        {"job": "mail", "tries": 2},
        {"job": "mail", "tries": 2},
        {"job": "mail"},
        "validation_error",
    ),
    "typed.ints": Typed("list[int]", [1, 2, 3], [1, 2, 3], b"[1, 2", "decode_error"),
    # text, not JSON: the body as UTF-8, quotes and all
    "typed.text": Typed("str", 'zwölf "✓"'.encode(), 'zwölf "✓"', b"\xff\xfe", "decode_error"),
    "typed.bytes": Typed("bytes", b"\xff raw", b"\xff raw"),
    "typed.any": Typed("Any", b"\xff any", b"\xff any"),
    "typed.none": Typed(UNANNOTATED, {"order_id": 2}, b'{"order_id":2}'),
    # model= wins: a dict would take {"order_id": "x"}, the model refuses it
    "typed.model": Typed(
        "dict[str, Any]",
        {"order_id": 3},
        CancelOrder(order_id=3),
        {"order_id": "x"},
        "validation_error",
        model=CancelOrder,
    ),
}


# -- handlers and what they saw --------------------------------------------------------------


@dataclass
class Call:
    message: Any
    ctx: HandlerContext
    at: float  # the bench's clock (`Bench.monotonic`)


Wait = Callable[[Callable[[], Any], float, str], Any]


class Calls:
    """Thread-safe record of handler invocations (started and finished), waited for with
    the bench's `wait_for` and stamped with its clock."""

    def __init__(self, wait: Wait, clock: Callable[[], float] = time.monotonic) -> None:
        self.started: list[Call] = []
        self.finished: list[Call] = []
        self._wait = wait
        self._clock = clock
        self._lock = threading.Lock()

    def start(self, message: Any, ctx: HandlerContext) -> None:
        with self._lock:
            self.started.append(Call(message, ctx, self._clock()))

    def finish(self, message: Any, ctx: HandlerContext) -> None:
        with self._lock:
            self.finished.append(Call(message, ctx, self._clock()))

    def wait_started(self, n: int, timeout: float = 15.0) -> list[Call]:
        self._wait(lambda: len(self.started) >= n, timeout, f"{n} handler start(s)")
        return list(self.started)

    def wait_finished(self, n: int, timeout: float = 15.0) -> list[Call]:
        self._wait(lambda: len(self.finished) >= n, timeout, f"{n} handler finish(es)")
        return list(self.finished)


Step = Callable[[Any, HandlerContext], None]


def handler(
    kind: str,
    calls: Calls,
    *,
    sleep: float | Callable[[Any, HandlerContext], float] = 0.0,
    then: Step | None = None,
    annotation: str | None = None,
) -> Callable[..., Any]:
    """record start -> sleep -> `then` (which may raise) -> record finish.

    An `async def` for the kinds in ASYNC_HANDLER_KINDS (sleeps on its loop: the
    in-memory kit's loop is on the virtual clock), else a `def` (sleeps on its thread).
    Its message parameter is annotated `Any`, or `annotation` (see `annotated`).
    """

    def pause(message: Any, ctx: HandlerContext) -> float:
        return sleep(message, ctx) if callable(sleep) else sleep

    if kind not in ASYNC_HANDLER_KINDS:

        def handle(message: Any, ctx: HandlerContext) -> None:
            calls.start(message, ctx)
            seconds = pause(message, ctx)
            if seconds:
                time.sleep(seconds)
            if then is not None:
                then(message, ctx)
            calls.finish(message, ctx)

        return annotated(handle, annotation)

    async def handle_async(message: Any, ctx: HandlerContext) -> None:
        calls.start(message, ctx)
        seconds = pause(message, ctx)
        if seconds:
            await asyncio.sleep(seconds)
        if then is not None:
            then(message, ctx)
        calls.finish(message, ctx)

    return annotated(handle_async, annotation)


def annotated(fn: Callable[..., Any], annotation: str | None) -> Callable[..., Any]:
    """`fn` with its first parameter (the message) annotated `annotation` as source code
    under `from __future__ import annotations` is: a string, resolved in this module
    (`Job`, `list[int]`...); UNANNOTATED removes the annotation, None keeps `Any`."""
    if annotation is None:
        return fn
    hints = dict(fn.__annotations__)
    if annotation == UNANNOTATED:
        del hints["message"]
    else:
        hints["message"] = annotation
    fn.__annotations__ = hints
    return fn


@dataclass
class Taken:
    """A message taken from a queue (basic.get), whatever the broker."""

    body: bytes
    message_id: str | None
    content_type: str | None
    headers: dict[str, Any] = field(default_factory=dict)


# -- the driver interface ---------------------------------------------------------------------


class Running(Protocol):
    """A started worker."""

    @property
    def stats(self) -> Any: ...

    def stop(self) -> None: ...


class Bench(Protocol):
    """What a behaviour case needs from an implementation: a broker, a worker of one
    kind, handlers of that kind, and waits with deadlines."""

    kind: str  # "sync", "async", "async-def" (real); "memory", "memory-async"
    broker_info: BrokerInfo
    handlers_take_time: bool  # can a handler of this kind take (virtual) time?

    def topology(self, **overrides: Any) -> Topology:
        """A unique topology, not declared (defaults: tiers 1s and 3s, queues
        orders.cancel and push, binding push.any); removed after the test."""
        ...

    def declared(self, **overrides: Any) -> Topology:
        """`topology(...)`, declared on the broker."""
        ...

    def declare(self, topology: Topology) -> object: ...

    def plan(self, topology: Topology) -> object: ...

    def calls(self) -> Calls: ...

    def handler(
        self,
        calls: Calls,
        *,
        sleep: float | Callable[[Any, HandlerContext], float] = 0.0,
        then: Step | None = None,
        annotation: str | None = None,
    ) -> Callable[..., Any]: ...

    def run_worker(self, app: App, **options: Any) -> Running:
        """Start a worker of this kind for `app` (options as the workers', plus
        `close_app`: close the app's store when it stopped); raises what it raised when
        it could not start. Stopped after the test if still running."""
        ...

    def publisher(self, topology: Topology) -> AbstractContextManager[Any]:
        """A sync publisher (Publisher's API) for `topology`, as a context manager."""
        ...

    def get_all(self, queue: str, expected: int, timeout: float = 15.0) -> list[Taken]:
        """Take (and ack) `expected` messages from the broker queue `queue`."""
        ...

    def message_count(self, queue: str) -> int:
        """Ready messages in the broker queue `queue`."""
        ...

    def message_count_or_none(self, queue: str) -> int | None:
        """`message_count`, or None when the queue does not exist."""
        ...

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str = "") -> Any:
        """Until `predicate()` is truthy (its value), at most `timeout` s; fail the test
        naming `what` at the deadline."""
        ...

    def guard(self, app: App) -> Any:
        """The idempotency guard the worker of `app` used (its stats)."""
        ...

    def now_ms(self) -> int:
        """The broker's clock, UTC epoch ms (wall clock, or the virtual one)."""
        ...

    def monotonic(self) -> float:
        """Seconds, for measuring how long something took."""
        ...


def publish(bench: Bench, topology: Topology, *bodies: Any, **kwargs: Any) -> list[str]:
    kwargs.setdefault("queue", QUEUE)
    tier = kwargs.pop("tier", "1s")
    with bench.publisher(topology) as publisher:
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
            f"SELECT state FROM {DEFAULT_IDEMPOTENCY_TABLE} WHERE key = ?",
            (DEFAULT_PREFIX + store_key(topology, message_id),),
        ).fetchone()
    finally:
        conn.close()
    return None if row is None else str(row[0])


def scheduled(tmp_path: Path, **schedule: Any) -> dict[str, Any]:
    """A topology with [schedule], its records in a SQLite file of the test's own (the
    publisher and the worker each open it, as two processes would)."""
    path = tmp_path / "schedule.sqlite3"
    return {"schedule": schedule, "idempotency": {"store": "sqlite", "path": str(path)}}


def record_of(topology: Topology, key: str) -> Any:
    """The key's schedule record, read from the file as another process would."""
    with Schedule(topology) as schedule:
        return schedule.lookup(key)


def needs_handler_time(bench: Bench) -> None:
    if not bench.handlers_take_time:
        pytest.skip(
            f"a {bench.kind!r} handler takes no time (the in-memory kit runs `def` handlers "
            "inline, in no virtual time): the `async def` kind covers this case"
        )


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


BROKER_RETRY = {"backend": "broker", "min": "1s", "max": "2s", "max_attempts": 4}


def broker_retrying(**retry: Any) -> dict[str, Any]:
    return {"queues": {QUEUE: {"delivery_limit": 4, "retry": {**BROKER_RETRY, **retry}}}}


def needs_delayed_retry(broker_info: BrokerInfo) -> None:
    if not broker_info.supports_delayed_retry:
        pytest.skip(
            'retry backend = "broker" needs RabbitMQ 4.3+ (quorum queue delayed retry); the '
            f"broker under test is {broker_info.describe()} (its refusal is tested here)"
        )


LEASE_MS = 1_500  # renewed every 500 ms
HANDLER_S = 2.5  # 5 renewals


class WorkerBehaviour:
    """The cases. Subclasses live in modules that provide the `bench` and
    `worker_bench` fixtures."""

    # -- acks and context ----------------------------------------------------------------

    def test_acks_after_the_handler_returned(self, bench: Bench) -> None:
        topology = bench.declared()
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app)
        ids = publish(bench, topology, {"order_id": 1}, {"order_id": 2}, {"order_id": 3})

        finished = calls.wait_finished(3)
        bench.wait_for(lambda: worker.stats.acked == 3, 5, "3 acks")
        worker.stop()

        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0
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

    # -- retries and the parking lot -----------------------------------------------------

    def test_retries_through_the_tier_then_parks_with_the_reason(self, bench: Bench) -> None:
        topology = bench.declared(**retrying(tiers=["1s"], max_attempts=3))
        app = App(topology, store=MemoryStore())
        calls = bench.calls()

        def boom(message: Any, ctx: HandlerContext) -> None:
            raise ValueError(f"payment service down (attempt {ctx.attempt})")

        app.add_consumer(QUEUE, bench.handler(calls, then=boom), model=CancelOrder)
        worker = bench.run_worker(app)
        [message_id] = publish(bench, topology, {"order_id": 7})

        parked = bench.get_all(topology.names.parking_queue(QUEUE), 1, timeout=20)[0]
        worker.stop()

        assert [c.ctx.attempt for c in calls.started] == [1, 2, 3]
        assert all(c.ctx.message_id == message_id for c in calls.started)
        # The retries went through the 1 s tier; the broker's x-death of the first trip
        # was stripped when re-publishing, so each delivery carries one tier expiry only.
        for call in calls.started[1:]:
            assert call.ctx.tier == "1s"
            deaths = call.ctx.headers.get("x-death") or []
            assert sum(int(d["count"]) for d in deaths) == 1
        assert calls.finished == []

        headers = parked.headers
        assert parked.message_id == message_id
        assert parked.content_type == "application/json"
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
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0
        assert worker.stats.retried == 2
        assert worker.stats.parked == 1

    def test_a_retry_that_succeeds_is_acked_and_never_parked(self, bench: Bench) -> None:
        topology = bench.declared(**retrying(tiers=["1s"], max_attempts=3))
        app = App(topology, store=MemoryStore())
        calls = bench.calls()

        def flaky(message: Any, ctx: HandlerContext) -> None:
            if ctx.attempt == 1:
                raise ConnectionError("timeout")

        app.add_consumer(QUEUE, bench.handler(calls, then=flaky), model=CancelOrder)
        worker = bench.run_worker(app)
        publish(bench, topology, {"order_id": 8})

        [done] = calls.wait_finished(1, timeout=15)
        bench.wait_for(lambda: worker.stats.acked == 1, 5, "the ack")
        worker.stop()
        assert done.ctx.attempt == 2
        # the last failure travels along
        assert done.ctx.headers[h.H_ERROR_TYPE] == "ConnectionError"
        assert bench.message_count(topology.names.parking_queue(QUEUE)) == 0
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0

    def test_a_retry_goes_back_only_to_the_queue_that_failed(self, bench: Bench) -> None:
        topology = bench.declared(
            queues={
                "billing": {"bindings": ["order.paid"], "retry": {"tiers": ["1s"]}},
                "mailer": {"bindings": ["order.paid"]},
            }
        )
        app = App(topology, store=MemoryStore())
        billing, mailer = bench.calls(), bench.calls()

        def fail_first(message: Any, ctx: HandlerContext) -> None:
            if ctx.attempt == 1:
                raise RuntimeError("ledger locked")

        app.add_consumer("billing", bench.handler(billing, then=fail_first), model=CancelOrder)
        app.add_consumer("mailer", bench.handler(mailer), model=CancelOrder)
        worker = bench.run_worker(app)
        with bench.publisher(topology) as publisher:
            publisher.publish_delayed({"order_id": 9}, "1s", routing_key="order.paid")

        billing.wait_finished(1, timeout=15)
        bench.wait_for(lambda: worker.stats.acked == 2, 5, "both acks")
        worker.stop()
        assert [c.ctx.attempt for c in billing.started] == [1, 2]
        # the retry did not reach the other queue bound to the key
        assert len(mailer.started) == 1

    # -- poison messages -----------------------------------------------------------------

    def test_undecodable_and_invalid_bodies_are_parked_at_once(self, bench: Bench) -> None:
        topology = bench.declared(**retrying(tiers=["1s"], max_attempts=5))
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app)
        poison, invalid = publish(bench, topology, b"\xff{not json", {"order_id": "forty-two"})

        parked = bench.get_all(topology.names.parking_queue(QUEUE), 2)
        worker.stop()

        assert calls.started == []
        reasons = {p.message_id: p.headers for p in parked}
        assert reasons[poison][h.H_PARK_REASON] == "decode_error"
        assert reasons[invalid][h.H_PARK_REASON] == "validation_error"
        for headers in reasons.values():
            assert headers[h.H_ATTEMPT] == 1
            assert headers[h.H_ERROR_TYPE] == "pydantic_core.ValidationError"
            assert headers[h.H_ORIGINAL_QUEUE] == QUEUE
        assert "order_id" in str(reasons[invalid][h.H_ERROR_MESSAGE])
        assert [p.body for p in parked if p.message_id == poison] == [b"\xff{not json"]
        assert worker.stats.retried == 0

    def test_a_handler_without_model_receives_what_its_annotation_says(self, bench: Bench) -> None:
        topology = bench.declared(queues={queue: {} for queue in TYPED})
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        for queue, case in TYPED.items():
            typed = bench.handler(calls, annotation=case.annotation)
            app.add_consumer(queue, typed, model=case.model)
        worker = bench.run_worker(app)
        with bench.publisher(topology) as publisher:
            for queue, case in TYPED.items():
                publisher.publish_delayed(case.body, "1s", queue=queue, message_id=f"{queue}-fits")
                if case.misfit is not None:
                    publisher.publish_delayed(case.misfit, "1s", queue=queue, message_id=queue)

        misfits = {q: c for q, c in TYPED.items() if c.misfit is not None}
        parked = {
            queue: bench.get_all(topology.names.parking_queue(queue), 1)[0] for queue in misfits
        }
        finished = calls.wait_finished(len(TYPED))
        bench.wait_for(lambda: worker.stats.acked == len(TYPED), 5, "every fitting message acked")
        worker.stop()

        got = {c.ctx.queue: c.message for c in finished}
        assert set(got) == set(TYPED)
        for queue, case in TYPED.items():
            assert got[queue] == case.received, queue
            assert type(got[queue]) is type(case.received), queue
        assert {c.ctx.message_id for c in calls.started} == {f"{q}-fits" for q in TYPED}
        for queue, case in misfits.items():
            headers = parked[queue].headers
            assert parked[queue].message_id == queue
            assert headers[h.H_PARK_REASON] == case.reason, (queue, headers)
            assert headers[h.H_ATTEMPT] == 1
        assert parked["typed.text"].headers[h.H_ERROR_TYPE] == "UnicodeDecodeError"
        assert parked["typed.text"].body == b"\xff\xfe"
        assert worker.stats.parked == len(misfits)
        assert worker.stats.retried == 0

    # -- handler signals -----------------------------------------------------------------

    def test_retry_and_reject_steer_the_message(self, bench: Bench) -> None:
        # The policy would wait 3 s; Retry(tier="1s") asks for the short tier instead.
        topology = bench.declared(**retrying(tiers=["3s"], max_attempts=4))
        app = App(topology, store=MemoryStore())
        calls = bench.calls()

        def steer(message: Any, ctx: HandlerContext) -> None:
            if message.action == "later" and ctx.attempt == 1:
                raise Retry("stock not there yet", tier="1s")
            if message.action == "refuse":
                raise Reject("order 11 belongs to another shop")

        app.add_consumer(QUEUE, bench.handler(calls, then=steer), model=CancelOrder)
        worker = bench.run_worker(app)
        later, refuse = publish(
            bench,
            topology,
            {"order_id": 10, "action": "later"},
            {"order_id": 11, "action": "refuse"},
        )

        [parked] = bench.get_all(topology.names.parking_queue(QUEUE), 1)
        bench.wait_for(lambda: len(calls.finished) == 1, 15, "the retried message to succeed")
        worker.stop()

        assert parked.message_id == refuse
        assert parked.headers[h.H_PARK_REASON] == "rejected"
        assert parked.headers[h.H_ERROR_MESSAGE] == "order 11 belongs to another shop"
        assert parked.headers[h.H_ERROR_TYPE] == "rabbit_delay.Reject"
        assert parked.headers[h.H_ATTEMPT] == 1
        [done] = calls.finished
        assert done.ctx.message_id == later
        assert (done.ctx.attempt, done.ctx.tier) == (2, "1s")
        assert done.ctx.headers[h.H_ERROR_TYPE] == "rabbit_delay.Retry"

    # -- idempotency ---------------------------------------------------------------------

    def test_a_duplicate_of_a_handled_message_is_acked_and_skipped(self, bench: Bench) -> None:
        topology = bench.declared()
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app)

        publish(bench, topology, {"order_id": 12}, message_id="order-12-timeout")
        calls.wait_finished(1)
        publish(bench, topology, {"order_id": 12}, message_id="order-12-timeout")
        bench.wait_for(lambda: worker.stats.duplicate == 1, 10, "the duplicate to be skipped")
        worker.stop()

        assert len(calls.started) == 1
        assert bench.guard(app).stats.duplicates_skipped == 1
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0

    def test_a_duplicate_arriving_while_the_first_runs_is_not_run_beside_it(
        self, bench: Bench
    ) -> None:
        needs_handler_time(bench)
        topology = bench.declared()
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls, sleep=1.5), model=CancelOrder)
        worker = bench.run_worker(app, concurrency=4)

        publish(bench, topology, {"order_id": 13}, {"order_id": 13}, message_id="order-13")
        # The second copy is deferred through the 1 s tier, comes back after the first is
        # done, and is skipped then.
        bench.wait_for(lambda: worker.stats.duplicate == 1, 15, "the deferred copy to be skipped")
        worker.stop()

        assert len(calls.started) == 1
        assert worker.stats.deferred >= 1
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0

    def test_a_store_outage_longer_than_the_delivery_limit_parks_nothing(
        self, bench: Bench
    ) -> None:
        # The claim fails on more deliveries than the queue's delivery limit. Where the
        # broker counts a nack-requeue towards the limit (3.10, 4.0-4.2), handing the
        # message back with a nack would have the broker dead-letter a good message.
        limit = 2
        topology = bench.declared(queues={QUEUE: {"delivery_limit": limit}})
        store = FlakyStore(failures=limit + 2)
        app = App(topology, store=store)
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app)
        [message_id] = publish(bench, topology, {"order_id": 16})

        [done] = calls.wait_finished(1, timeout=40)
        bench.wait_for(lambda: worker.stats.acked == 1, 10, "the ack")
        worker.stop()

        assert store.failed_claims == limit + 2
        assert done.ctx.message_id == message_id
        assert done.ctx.attempt == 1  # an outage is not an attempt
        assert len(calls.started) == 1
        # Each failed claim handed the delivery back once: a nack where it does not count
        # (4.3+), else a same-attempt copy through the shortest tier. Counted once each.
        stats = worker.stats
        if bench.broker_info.nack_requeue_counts:
            assert (stats.deferred, stats.requeued) == (limit + 2, 0), stats
        else:
            assert (stats.deferred, stats.requeued) == (0, limit + 2), stats
        assert bench.message_count(topology.names.parking_queue(QUEUE)) == 0
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0

    def test_cancel_drops_the_message_when_it_comes_due(self, bench: Bench) -> None:
        topology = bench.declared()
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app)

        cancelled, kept = publish(bench, topology, {"order_id": 14}, {"order_id": 15})
        app.cancel(cancelled)  # the order was paid: its timeout must not fire

        calls.wait_finished(1)
        bench.wait_for(
            lambda: worker.stats.cancelled == 1, 10, "the cancelled message to be dropped"
        )
        worker.stop()
        assert [c.ctx.message_id for c in calls.started] == [kept]
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0

    def test_a_lease_lost_while_the_handler_runs_is_noticed_and_logged(
        self, bench: Bench, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        needs_handler_time(bench)
        caplog.set_level(logging.INFO, logger="rabbit_delay.worker")
        topology = bench.declared(**sqlite_guarded(tmp_path, lease=f"{LEASE_MS}ms"))
        app = App(topology)
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls, sleep=HANDLER_S), model=CancelOrder)
        worker = bench.run_worker(app, close_app=True)
        [message_id] = publish(bench, topology, {"order_id": 17})

        calls.wait_started(1)
        assert stored_state(topology, message_id) == "claimed"
        # Another process takes the key from under the running handler: a tombstone
        # replaces its claim, so the next renewal finds the claim gone.
        other = SQLiteStore(topology.idempotency.path)
        try:
            key = store_key(topology, message_id)
            other.cancel(key, now_ms=bench.now_ms(), retention_ms=60_000)
        finally:
            other.close()
        # A renewal is due every LEASE_MS / 3, looked for twice as often: the loss shows
        # within about 0.75 s, well before the handler ends.
        bench.wait_for(lambda: worker.stats.leases_lost >= 1, HANDLER_S - 0.5, "the lost lease")
        assert calls.finished == []  # noticed while the handler still ran

        calls.wait_finished(1)
        bench.wait_for(lambda: worker.stats.acked == 1, 5, "the ack")  # the result stands
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

    # -- the schedule (a topology with [schedule]) -----------------------------------------

    def test_a_reschedule_runs_only_the_new_generation_at_its_new_time(
        self, bench: Bench, tmp_path: Path
    ) -> None:
        topology = bench.declared(**scheduled(tmp_path))
        app = App(topology)
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app, close_app=True)
        with bench.publisher(topology) as publisher:
            # later: due in 1s, moved to 3s; earlier: due in 3s, moved to 1s
            publisher.publish_delayed({"order_id": 1}, "1s", queue=QUEUE, key="later")
            publisher.publish_delayed({"order_id": 2}, "3s", queue=QUEUE, key="earlier")
            moved_at = bench.now_ms()
            assert publisher.schedule.reschedule("later", "3s") is ScheduleState.SCHEDULED
            assert publisher.schedule.reschedule("earlier", "1s") is ScheduleState.SCHEDULED
            # keep: the key is scheduled, so nothing is sent
            kept = publisher.publish_delayed(
                {"order_id": 3}, "1s", queue=QUEUE, key="later", on_conflict="keep"
            )
            assert kept.kept
            assert kept.generation == 2

        finished = calls.wait_finished(2)
        bench.wait_for(lambda: worker.stats.superseded == 2, 10, "the 2 stale copies dropped")
        worker.stop()
        by_order = {c.message.order_id: c for c in finished}
        assert sorted(by_order) == [1, 2]  # each once, and never the kept body
        for order_id, key, delay_ms in ((1, "later", 3_000), (2, "earlier", 1_000)):
            ctx = by_order[order_id].ctx
            assert ctx.headers[h.H_GENERATION] == 2
            assert ctx.scheduled_at is not None
            due = int(ctx.scheduled_at.timestamp() * 1000)
            assert due >= moved_at + delay_ms  # never early: not before the new due time
            record = record_of(topology, key)
            assert (record.state, record.generation) == (ScheduleState.HANDLED, 2)
            assert (record.replaced, record.dropped) == (1, 1)
        assert worker.stats.acked == 2

    def test_debounce_runs_once_after_the_last_publish_and_cancel_drops_the_key(
        self, bench: Bench, tmp_path: Path
    ) -> None:
        topology = bench.declared(**scheduled(tmp_path))
        app = App(topology)
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls), model=CancelOrder)
        worker = bench.run_worker(app, close_app=True)
        with bench.publisher(topology) as publisher:
            for n in range(10):  # the cart changed ten times: remind once, after the last
                publisher.publish_delayed({"order_id": n}, "1s", queue=QUEUE, key="cart-7")
            publisher.publish_delayed({"order_id": 99}, "1s", queue=QUEUE, key="paid-8")
            assert app.cancel("paid-8") is ScheduleState.SCHEDULED  # paid: no timeout
            assert app.cancel("never-published") is None

        [call] = calls.wait_finished(1)
        bench.wait_for(
            lambda: worker.stats.superseded == 9 and worker.stats.cancelled == 1,
            10,
            "9 superseded and 1 cancelled copies dropped",
        )
        worker.stop()
        assert call.message.order_id == 9
        assert len(calls.started) == 1
        cart = record_of(topology, "cart-7")
        assert (cart.state, cart.generation, cart.replaced, cart.dropped) == (
            ScheduleState.HANDLED,
            10,
            9,
            9,
        )
        paid = record_of(topology, "paid-8")
        assert (paid.state, paid.dropped) == (ScheduleState.CANCELLED, 1)

    def test_the_record_follows_the_result_handled_retried_parked(
        self, bench: Bench, tmp_path: Path
    ) -> None:
        topology = bench.declared(**scheduled(tmp_path), **retrying(tiers=["1s"], max_attempts=2))
        app = App(topology)
        calls = bench.calls()
        failed_once: set[int] = set()

        def steer(msg: CancelOrder, ctx: HandlerContext) -> None:
            if msg.action == "reject":
                raise Reject("no such order")
            if msg.action == "flaky" and msg.order_id not in failed_once:
                failed_once.add(msg.order_id)
                raise ValueError("payment service down")

        app.add_consumer(QUEUE, bench.handler(calls, then=steer), model=CancelOrder)
        worker = bench.run_worker(app, close_app=True)
        with bench.publisher(topology) as publisher:
            publisher.publish_delayed({"order_id": 1}, "1s", queue=QUEUE, key="ok")
            publisher.publish_delayed(
                {"order_id": 2, "action": "flaky"}, "1s", queue=QUEUE, key="flaky"
            )
            publisher.publish_delayed(
                {"order_id": 3, "action": "reject"}, "1s", queue=QUEUE, key="rejected"
            )
            bench.wait_for(
                lambda: worker.stats.acked == 2 and worker.stats.parked == 1,
                15,
                "2 handled and 1 parked",
            )
        worker.stop()
        ok, flaky, rejected = (record_of(topology, k) for k in ("ok", "flaky", "rejected"))
        assert (ok.state, ok.attempts) == (ScheduleState.HANDLED, 0)
        assert (flaky.state, flaky.attempts) == (ScheduleState.HANDLED, 1)
        assert flaky.last_error == "ValueError: payment service down"
        assert flaky.due_ms > ok.due_ms  # moved to the retry's due time
        assert (rejected.state, rejected.attempts) == (ScheduleState.PARKED, 1)
        assert rejected.last_error is not None
        assert rejected.last_error.startswith("rejected: ")
        assert all(r.expires_ms is not None for r in (ok, flaky, rejected))

    # -- lifecycle -----------------------------------------------------------------------

    def test_graceful_stop_finishes_in_flight_handlers_and_hands_back_the_rest(
        self, bench: Bench
    ) -> None:
        needs_handler_time(bench)
        topology = bench.declared()
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls, sleep=1.0), model=CancelOrder)
        worker = bench.run_worker(app, concurrency=2, prefetch=4)
        publish(bench, topology, *({"order_id": n} for n in range(20, 24)))

        calls.wait_started(2)
        # The other 2 must have reached the worker (prefetched) before the stop, else they
        # simply stay in the queue and nothing is handed back.
        bench.wait_for(lambda: worker.stats.received == 4, 10, "all 4 delivered to the worker")
        worker.stop()  # what SIGINT / SIGTERM do

        assert len(calls.finished) == len(calls.started) == 2  # in flight: finished, acked
        assert worker.stats.acked == 2
        # The 2 prefetched but not started were nacked back, each once, and counted once.
        assert worker.stats.handed_back == 2, worker.stats
        queue = topology.names.business_queue(QUEUE)
        bench.wait_for(lambda: bench.message_count(queue) == 2, 10, "the 2 not started, back")
        back = bench.get_all(queue, 2)
        # One hand-back each: counted by the queue where a nack counts (before 4.3); from
        # 4.3 a nack is not counted (a lost channel would have been: 1).
        expected_count = 1 if bench.broker_info.nack_requeue_counts else None
        assert [g.headers.get(h.DELIVERY_COUNT_HEADER) for g in back] == [expected_count] * 2
        assert {g.message_id for g in back}.isdisjoint(c.ctx.message_id for c in calls.started)

    def test_a_handler_past_the_shutdown_timeout_is_redelivered(self, bench: Bench) -> None:
        needs_handler_time(bench)
        topology = bench.declared()
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls, sleep=3.0), model=CancelOrder)
        worker = bench.run_worker(app, shutdown_timeout=0.3)
        publish(bench, topology, {"order_id": 30})

        calls.wait_started(1)
        worker.stop()
        assert worker.stats.acked == 0
        queue = topology.names.business_queue(QUEUE)
        bench.wait_for(lambda: bench.message_count(queue) == 1, 10, "the unfinished one, back")

    def test_a_handler_past_the_shutdown_timeout_records_done_before_the_store_closes(
        self, bench: Bench, tmp_path: Path
    ) -> None:
        # Past the drain timeout the connection is closed (the broker takes the message
        # back), but the handler keeps running: run() returns only once it recorded done,
        # and only then is the store closed, as `rabbit-delay worker` closes it. The copy
        # the next worker gets is then a duplicate: one effect. (The store used to be
        # closed under the handler: no done-record, and the copy ran again after the lease.)
        needs_handler_time(bench)
        topology = bench.declared(**sqlite_guarded(tmp_path, lease="2s"))
        app = App(topology)  # the topology's guard: SQLite in tmp_path
        calls = bench.calls()
        app.add_consumer(QUEUE, bench.handler(calls, sleep=3.0), model=CancelOrder)
        first = bench.run_worker(app, shutdown_timeout=1.0, close_app=True)
        [message_id] = publish(bench, topology, {"order_id": 31})

        calls.wait_started(1)
        first.stop()  # returns once run() returned and the store is closed

        assert [c.ctx.message_id for c in calls.finished] == [message_id]
        assert stored_state(topology, message_id) == "done"
        assert (first.stats.acked, first.stats.stale) == (0, 1), first.stats  # channel closed

        again = App(topology)  # the next worker process opens the file anew
        second_calls = bench.calls()
        again.add_consumer(QUEUE, bench.handler(second_calls), model=CancelOrder)
        second = bench.run_worker(again, close_app=True)
        bench.wait_for(
            lambda: second.stats.duplicate + second.stats.acked + second.stats.deferred >= 1,
            15,
            f"the redelivered copy to be settled ({second.stats})",
        )
        second.stop()
        assert (second.stats.duplicate, second.stats.acked) == (1, 0), second.stats
        assert second_calls.started == []
        assert len(calls.started) == 1
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0

    # -- refusing to start -----------------------------------------------------------------

    def test_refuses_a_queue_missing_on_the_broker_and_declares_on_request(
        self, worker_bench: Bench
    ) -> None:
        bench = worker_bench
        topology = bench.topology()  # not declared
        app = App(topology, store=MemoryStore())
        app.add_consumer(QUEUE, bench.handler(bench.calls()), model=CancelOrder)
        with pytest.raises(MissingObjectError, match="rabbit-delay declare"):
            bench.run_worker(app)
        worker = bench.run_worker(app, declare=True)
        worker.stop()

    # -- retry backend "broker" (RabbitMQ 4.3+ quorum queue delayed retry) -----------------

    def test_broker_retry_backend_is_refused_before_4_3(self, worker_bench: Bench) -> None:
        bench = worker_bench
        info = bench.broker_info
        if info.supports_delayed_retry:
            pytest.skip(f"{info.describe()} has delayed retry: declared and used below")
        topology = bench.topology(**broker_retrying())
        for attempt in (bench.declare, bench.plan):
            with pytest.raises(IncompatibleBroker, match=r"needs quorum queue delayed retry"):
                attempt(topology)
        assert bench.message_count_or_none(topology.names.business_queue(QUEUE)) is None
        app = App(topology, store=MemoryStore())
        app.add_consumer(QUEUE, bench.handler(bench.calls()), model=CancelOrder)
        for declare_first in (False, True):
            with pytest.raises(IncompatibleBroker, match=re.escape(info.version_text)):
                bench.run_worker(app, declare=declare_first)

    @pytest.mark.slow
    def test_broker_retries_arrive_after_the_brokers_delays_then_park_with_the_reason(
        self, bench: Bench
    ) -> None:
        needs_delayed_retry(bench.broker_info)
        topology = bench.declared(**broker_retrying())
        app = App(topology, store=MemoryStore())
        calls = bench.calls()
        failed_at: list[float] = []  # the bench's clock, just before each failure
        first_failure_ms: list[int] = []

        def boom(message: Any, ctx: HandlerContext) -> None:
            if not first_failure_ms:
                first_failure_ms.append(bench.now_ms())
            failed_at.append(bench.monotonic())
            raise ValueError(f"payment service down (attempt {ctx.attempt})")

        app.add_consumer(QUEUE, bench.handler(calls, then=boom), model=CancelOrder)
        worker = bench.run_worker(app)
        [message_id] = publish(bench, topology, {"order_id": 60})

        [parked] = bench.get_all(topology.names.parking_queue(QUEUE), 1, timeout=30)
        worker.stop()

        assert [c.ctx.attempt for c in calls.started] == [1, 2, 3, 4]
        # The same copy every time, requeued: never through a tier again, counted by the
        # queue.
        counts = [c.ctx.headers.get(h.DELIVERY_COUNT_HEADER) for c in calls.started]
        assert counts == [None, 1, 2, 3]
        for call in calls.started:  # one trip through the 1 s tier: when it was published
            deaths = call.ctx.headers.get("x-death") or []
            assert sum(int(d["count"]) for d in deaths) == 1
        assert all(c.ctx.redelivered for c in calls.started[1:])
        # Retry n waits min(1 s x n, 2 s) after the failure: never early. Late by the
        # broker's timer and the worker's reject (a few ms here); 1 s of tolerance on a
        # busy machine.
        expected = [1.0, 2.0, 2.0]
        waited = [calls.started[n + 1].at - failed_at[n] for n in range(3)]
        for n, (took, want) in enumerate(zip(waited, expected, strict=True), start=1):
            assert took >= want, f"retry {n} came {want - took:.3f}s early (waited {waited})"
            assert took < want + 1.0, f"retry {n} came {took - want:.3f}s late (waited {waited})"

        headers = parked.headers
        assert parked.message_id == message_id
        assert CancelOrder.model_validate_json(parked.body).order_id == 60
        assert headers[h.H_PARK_REASON] == "max_attempts"
        assert headers[h.H_ATTEMPT] == 4
        assert headers[h.H_ERROR_TYPE] == "ValueError"
        assert headers[h.H_ERROR_MESSAGE] == "payment service down (attempt 4)"
        assert "ValueError: payment service down" in str(headers[h.H_ERROR_TRACEBACK])
        assert headers[h.H_ORIGINAL_QUEUE] == QUEUE
        # A requeue carries no header: the first failure is derived from the broker's
        # delays (1 + 2 + 2 s before the last), the latest it can have been.
        assert headers[h.H_LAST_FAILURE] - headers[h.H_FIRST_FAILURE] == 5_000
        assert first_failure_ms[0] <= headers[h.H_FIRST_FAILURE] + 5  # ms rounding, 2 clocks
        assert headers[h.H_FIRST_FAILURE] - first_failure_ms[0] < 1_500
        broker_headers = {k for k in headers if k.startswith(h.BROKER_HEADER_PREFIXES)}
        assert broker_headers <= {"x-delivery-count"}  # the parking lot's own, if any
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0
        assert bench.message_count(topology.names.tier_queue("1s")) == 0
        assert (worker.stats.retried, worker.stats.parked, worker.stats.acked) == (3, 1, 0)

    def test_a_broker_retry_that_succeeds_is_acked(self, bench: Bench) -> None:
        needs_delayed_retry(bench.broker_info)
        topology = bench.declared(**broker_retrying())
        app = App(topology, store=MemoryStore())
        calls = bench.calls()

        def flaky(message: Any, ctx: HandlerContext) -> None:
            if ctx.attempt == 1:
                raise ConnectionError("timeout")

        app.add_consumer(QUEUE, bench.handler(calls, then=flaky), model=CancelOrder)
        worker = bench.run_worker(app)
        publish(bench, topology, {"order_id": 61})

        [done] = calls.wait_finished(1, timeout=15)
        bench.wait_for(lambda: worker.stats.acked == 1, 5, "the ack")
        worker.stop()
        assert done.ctx.attempt == 2
        assert worker.stats.retried == 1
        assert bench.message_count(topology.names.parking_queue(QUEUE)) == 0
        assert bench.message_count(topology.names.business_queue(QUEUE)) == 0
