"""Observability on the real broker, with each worker: one trace from the publishing code
through a tier, a failed attempt, its retry through the cascade and the handler (the
OpenTelemetry SDK's in-memory exporter), a parked message's span, and the lateness and
schedule-deviation histograms by queue and tier.

OpenTelemetry is imported in the fixture only, and rabbit-delay's spans are turned off
again afterwards: the other tests of the process keep the untraced path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Spans, wait_for
from prometheus_client import CollectorRegistry

from rabbit_delay import App, HandlerContext, Reject, Retry, Topology
from rabbit_delay import _headers as h
from rabbit_delay._observe import tracing
from rabbit_delay.metrics import Metrics
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, connect, declare

from .workers.harness import HANDLER_KINDS, RunningWorker, transport

pytestmark = pytest.mark.integration

QUEUE = "orders.cancel"


@pytest.fixture
def topology(make_topology: Callable[..., Topology], broker_url: str) -> Topology:
    """Tier 1s, a fine cascade (100 ms), and a retry through the cascade (500 ms)."""
    topology = make_topology(
        cascade={"levels": 6, "resolution": "100ms"},
        queues={
            QUEUE: {"retry": {"max_attempts": 2, "backoff": {"initial": "500ms", "factor": 2}}},
        },
    )
    conn = connect(broker_url, name="rd-test observe declare")
    try:
        declare(conn, topology)
    finally:
        conn.close()
    return topology


class Seen:
    """What each handler run saw: (message_id, attempt, the current span's context)."""

    def __init__(self, spans: Spans) -> None:
        self.spans = spans
        self.runs: list[tuple[str | None, int, Any]] = []
        self._lock = threading.Lock()

    def handle(self, msg: bytes, ctx: HandlerContext) -> None:
        current = self.spans.trace.get_current_span().get_span_context()
        with self._lock:
            self.runs.append((ctx.message_id, ctx.attempt, current))
        if ctx.message_id == "m-retry" and ctx.attempt == 1:
            raise Retry("the payment service is down")
        if ctx.message_id == "m-park":
            raise Reject("no such order")


def handler_for(kind: str, seen: Seen) -> Callable[..., Any]:
    if kind != "async":
        return seen.handle

    async def handle(msg: bytes, ctx: HandlerContext) -> None:
        seen.handle(msg, ctx)

    return handle


@pytest.mark.parametrize("kind", HANDLER_KINDS)
def test_one_trace_and_the_timings_follow_each_message(
    kind: str, topology: Topology, spans: Spans, broker_url: str
) -> None:
    seen = Seen(spans)
    registry = CollectorRegistry()
    app = App(topology, store=MemoryStore())
    app.add_consumer(QUEUE, handler_for(kind, seen))
    worker = RunningWorker(kind, app, broker_url, metrics=Metrics(registry)).start()
    try:
        with (
            spans.tracer.start_as_current_span("checkout") as checkout,
            Publisher(topology, broker_url) as publisher,
        ):
            publisher.publish_delayed(b"r", "1s", queue=QUEUE, message_id="m-retry")
            publisher.publish_delayed(b"p", "1s", queue=QUEUE, message_id="m-park")
            # 550 ms through the 100 ms cascade: scheduled 50 ms later than asked
            publisher.publish_delayed(b"c", queue=QUEUE, delay=0.55, message_id="m-cascade")
        wait_for(lambda: len(seen.runs) >= 4, 15, "four handler runs")
        wait_for(lambda: len(spans.named("handle ")) >= 4, 5, "four handle spans")
    finally:
        worker.stop()

    # -- the trace: checkout > publish > handle (each attempt) > retry / park
    queue_name = topology.names.business_queue(QUEUE)
    publishes = {s.attributes["messaging.message.id"]: s for s in spans.named("publish ")}
    assert set(publishes) == {"m-retry", "m-park", "m-cascade"}  # not the worker's copies
    trace_id = checkout.get_span_context().trace_id
    for publish in publishes.values():
        assert publish.context.trace_id == trace_id
        assert publish.parent.span_id == checkout.get_span_context().span_id
    handles: dict[tuple[str, int], Any] = {
        (s.attributes["messaging.message.id"], s.attributes["rabbit_delay.attempt"]): s
        for s in spans.named("handle ")
    }
    assert set(handles) == {("m-retry", 1), ("m-retry", 2), ("m-park", 1), ("m-cascade", 1)}
    for (message_id, _attempt), handle in handles.items():
        assert handle.name == f"handle {queue_name}"
        assert handle.context.trace_id == trace_id
        # every attempt is a child of the publish: the retried copy kept its traceparent
        assert handle.parent.span_id == publishes[message_id].context.span_id
        assert handle.attributes["messaging.destination.name"] == queue_name
        assert 0 <= handle.attributes["rabbit_delay.lateness_ms"] < 5_000
    assert handles[("m-retry", 1)].attributes["rabbit_delay.tier"] == "1s"
    assert handles[("m-retry", 2)].attributes["rabbit_delay.tier"] == "cascade"
    assert handles[("m-retry", 1)].attributes["rabbit_delay.outcome"] == "retried"
    assert handles[("m-retry", 2)].attributes["rabbit_delay.outcome"] == "acked"
    (retry,) = spans.named("retry ")
    assert retry.parent.span_id == handles[("m-retry", 1)].context.span_id
    assert retry.attributes["rabbit_delay.attempt"] == 2
    assert retry.attributes["rabbit_delay.tier"] == "cascade"
    (park,) = spans.named("park ")
    assert park.parent.span_id == handles[("m-park", 1)].context.span_id
    assert park.attributes["rabbit_delay.park_reason"] == "rejected"
    # each handler ran inside its own handle span
    for message_id, attempt, current in seen.runs:
        assert current.span_id == handles[(message_id, attempt)].context.span_id, transport(kind)

    # -- lateness by queue and tier, and the cascade's rounding
    def sample(name: str, tier: str) -> float:
        value = registry.get_sample_value(name, {"queue": QUEUE, "tier": tier})
        return value or 0.0

    late = "rabbit_delay_delivery_lateness_seconds"
    deviation = "rabbit_delay_schedule_deviation_seconds"
    assert sample(f"{late}_count", "1s") == 2  # m-retry's first attempt, m-park
    assert sample(f"{late}_count", "cascade") == 2  # m-cascade, m-retry's retry
    assert 0 <= sample(f"{late}_sum", "cascade") < 5
    assert sample(f"{deviation}_sum", "1s") == 0
    assert sample(f"{deviation}_sum", "cascade") == pytest.approx(0.05)  # 550 -> 600 ms
    assert (
        registry.get_sample_value(
            f"{deviation}_bucket", {"queue": QUEUE, "tier": "cascade", "le": "0.001"}
        )
        == 1
    )  # the retry: 500 ms is a whole number of units


def test_without_spans_the_headers_still_carry_the_trace(
    topology: Topology, broker_url: str
) -> None:
    """No OpenTelemetry span is made (tracing off, as in a process without it): a
    traceparent passed in headers= reaches the handler, and its retry, unchanged."""
    tracing.configure(enabled=False)
    seen: list[tuple[int, str | None]] = []

    def handle(msg: bytes, ctx: HandlerContext) -> None:
        seen.append((ctx.attempt, ctx.traceparent))
        if ctx.attempt == 1:
            raise Retry("again")

    app = App(topology, store=MemoryStore())
    app.add_consumer(QUEUE, handle)
    worker = RunningWorker("sync", app, broker_url).start()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        with Publisher(topology, broker_url) as publisher:
            publisher.publish_delayed(b"x", "1s", queue=QUEUE, headers={h.H_TRACEPARENT: parent})
        wait_for(lambda: len(seen) >= 2, 10, "the retry")
    finally:
        worker.stop()
    assert seen == [(1, parent), (2, parent)]
