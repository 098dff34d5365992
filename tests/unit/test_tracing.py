"""Tracing (rabbit_delay/_observe/tracing.py): the trace headers through publish, retry and replay,
and the OpenTelemetry spans, recorded by the SDK's in-memory exporter. No broker: the
publisher core's ledger and the delivery program are driven by hand (the integration
test tests/integration/test_observe.py does it through a real broker).

OpenTelemetry is imported inside the fixture, and rabbit-delay's spans are turned off
again afterwards, so the other tests of this process keep running the untraced path.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Spans

from rabbit_delay import App, HandlerContext, NackError, Reject, Retry, Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._broker import UNKNOWN
from rabbit_delay._consumer.app import Transport
from rabbit_delay._consumer.delivery import Claim, Delivery, Finish, Publish, Run, Settled, WriteAck
from rabbit_delay._consumer.handlers import call_handler
from rabbit_delay._consumer.worker import WorkerCore
from rabbit_delay._observe import tracing
from rabbit_delay._observe.report import WorkerReport
from rabbit_delay._ops.replay.rules import replay_headers
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay.stores import ClaimResult, MemoryStore

NOW = 1_800_000_000_000
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make_topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "5s": "5s"},
            "queues": {"orders": {"retry": {"max_attempts": 2, "tiers": ["5s"]}}},
        }
    )


def ids_of(span: Any) -> str:
    """version-trace_id-span_id of a span: a traceparent pointing at it, less its flags."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"


def carried(headers: Any) -> str:
    return str(headers[h.H_TRACEPARENT]).rsplit("-", 1)[0]


def confirm_all(core: PublisherCore[Any, Any], outs: list[Any]) -> tuple[Any, list[str]]:
    ledger = core.ledger(outs)
    for index in range(len(ledger)):
        ledger.take()
        ledger.sent(index, index + 1)
        ledger.ack(index + 1)
    return ledger, core.result(ledger)


# -- headers, with or without OpenTelemetry -------------------------------------------------


def test_a_callers_traceparent_passes_through_publish_retry_and_replay() -> None:
    tracing.configure(enabled=False)  # as without OpenTelemetry (and left so)
    core: PublisherCore[Any, Any] = PublisherCore(
        make_topology(), borrowed=True, tracer=tracing.active
    )
    out = core.prepare(b"x", "1s", queue="orders", headers={h.H_TRACEPARENT: TRACEPARENT})
    ledger = core.ledger([out])
    assert ledger.trace is None
    assert ledger.outs[0].headers[h.H_TRACEPARENT] == TRACEPARENT
    parked = {**out.headers, h.H_PARK_REASON: "rejected", "x-death": [{}]}
    assert replay_headers(parked)[h.H_TRACEPARENT] == TRACEPARENT


def test_the_handler_context_reads_the_traceparent() -> None:
    from rabbit_delay._envelope import Envelope

    env = Envelope.from_headers("m", {h.H_TRACEPARENT: TRACEPARENT.encode()})
    ctx = HandlerContext("orders", env, False, NOW, 3)
    assert ctx.traceparent == TRACEPARENT
    assert (
        HandlerContext("orders", Envelope.from_headers("m", {}), False, NOW, 3).traceparent is None
    )


def test_without_opentelemetry_imported_nothing_traces() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rabbit_delay._observe import tracing\n"
        "from rabbit_delay._publishing.core import PublisherCore\n"
        "from rabbit_delay._topology.model import topology_from_dict\n"
        "t = topology_from_dict({'namespace': 's', 'tiers': {'1s': '1s'}, 'queues': {'q': {}}})\n"
        "core = PublisherCore(t, borrowed=True)\n"
        "ledger = core.ledger([core.prepare(b'x', '1s', queue='q')])\n"
        "assert ledger.trace is None and 'traceparent' not in ledger.outs[0].headers\n"
        "assert tracing.active() is None\n"
        "print('opentelemetry' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"


# -- publish spans --------------------------------------------------------------------------


def test_a_publish_span_is_the_parent_the_message_carries(spans: Spans) -> None:
    core: PublisherCore[Any, Any] = PublisherCore(
        make_topology(), borrowed=True, tracer=tracing.active
    )
    tracer = spans.tracer
    with tracer.start_as_current_span("request") as request:
        out = core.prepare({"order_id": 1}, "1s", queue="orders", message_id="order-1")
        assert h.H_TRACEPARENT not in out.headers  # injected when the call starts
        ledger, ids = confirm_all(core, [out])
    assert ids == ["order-1"]
    publish = spans.one("publish ")
    assert publish.name == "publish shop.v1.q.orders"
    assert publish.parent.span_id == request.get_span_context().span_id
    assert publish.kind.name == "PRODUCER"
    assert carried(ledger.outs[0].headers) == ids_of(publish)
    attrs = dict(publish.attributes)
    assert attrs == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
        "messaging.destination.name": "shop.v1.q.orders",
        "messaging.message.id": "order-1",
        "rabbit_delay.tier": "1s",
        "rabbit_delay.attempt": 1,
        "rabbit_delay.delay_ms": 1000,
    }
    assert publish.status.is_ok


def test_a_call_of_many_is_one_span(spans: Spans) -> None:
    core: PublisherCore[Any, Any] = PublisherCore(
        make_topology(), borrowed=True, tracer=tracing.active
    )
    outs = core.prepare_many([{"i": i} for i in range(3)], "5s", queue="orders")
    ledger, _ids = confirm_all(core, outs)
    publish = spans.one("publish ")
    assert publish.parent is None  # nothing current: the trace starts here
    assert publish.attributes["messaging.batch.message_count"] == 3
    assert {carried(o.headers) for o in ledger.outs} == {ids_of(publish)}


def test_a_failed_publish_ends_its_span_with_the_error(spans: Spans) -> None:
    core: PublisherCore[Any, Any] = PublisherCore(
        make_topology(), borrowed=True, tracer=tracing.active
    )
    ledger = core.ledger([core.prepare(b"x", "1s", queue="orders")])
    ledger.take()
    ledger.sent(0, 1)
    ledger.ack(1, nack=True)
    with pytest.raises(NackError):
        core.result(ledger)
    publish = spans.one("publish ")
    assert publish.status.status_code.name == "ERROR"
    assert "nacked" in publish.status.description
    assert [e.name for e in publish.events] == ["exception"]


def test_a_carried_traceparent_wins_and_forwarded_copies_make_no_span(spans: Spans) -> None:
    core: PublisherCore[Any, Any] = PublisherCore(
        make_topology(), borrowed=True, tracer=tracing.active
    )
    out = core.prepare(b"x", "1s", queue="orders", headers={h.H_TRACEPARENT: TRACEPARENT})
    ledger, _ = confirm_all(core, [out])
    assert ledger.outs[0].headers[h.H_TRACEPARENT] == TRACEPARENT
    assert spans.named("publish ") == []  # a worker's retry copy: its handle span says it
    with spans.tracer.start_as_current_span("forwarding"):
        ledger, _ = confirm_all(core, [out])
    assert ledger.outs[0].headers[h.H_TRACEPARENT] == TRACEPARENT
    assert len(spans.named("publish ")) == 1  # the caller's span is current: it is traced


# -- delivery spans -------------------------------------------------------------------------


class Base(WorkerCore):
    transport = Transport.SYNC
    default_concurrency = 1

    def make_report(self, metrics: Any) -> WorkerReport:
        return WorkerReport(self, metrics)

    def tracer(self) -> Any:
        return tracing.active()


def worker_for(handler: Any) -> tuple[WorkerCore, App]:
    app = App(make_topology(), store=MemoryStore())
    app.add_consumer("orders", handler)
    worker = Base(app, "amqp://guest:guest@127.0.0.1:1/%2F", install_signal_handlers=False)
    return worker, app


def deliver(worker: WorkerCore, headers: dict[str, Any]) -> tuple[list[object], Settled]:
    """Drive one delivery's (traced) program as a worker would, running the handler."""
    base = {h.H_ATTEMPT: 1, h.H_TIER: "1s", h.H_DUE_AT: NOW - 40, h.H_TARGET: "shop.v1.q.orders"}
    delivery = Delivery("m-1", {**base, **headers}, False, b"{}", "application/json", NOW)
    consumer = worker.consumers[0]
    program = worker.program(consumer, delivery, UNKNOWN)
    steps: list[object] = []
    reply: object = None
    while True:
        try:
            step = program.send(reply)
        except StopIteration as stop:
            return steps, stop.value
        steps.append(step)
        if isinstance(step, Claim):
            reply = ClaimResult.CLAIMED
        elif isinstance(step, Run):
            reply = call_handler(step.consumer, step.prepared, None)
        else:
            assert isinstance(step, Finish | Publish | WriteAck), step
            reply = None


def test_the_handle_span_continues_the_trace_and_is_current_in_the_handler(
    spans: Spans,
) -> None:
    seen: list[Any] = []

    def handler(msg: bytes, ctx: HandlerContext) -> None:
        seen.append(spans.trace.get_current_span())
        with spans.tracer.start_as_current_span("cancel order"):
            pass

    worker, _app = worker_for(handler)
    _steps, settled = deliver(worker, {h.H_TRACEPARENT: TRACEPARENT})
    assert settled.action is not None
    handle = spans.one("handle ")
    assert handle.name == "handle shop.v1.q.orders"
    assert handle.kind.name == "CONSUMER"
    assert f"{handle.context.trace_id:032x}" == TRACEPARENT.split("-")[1]
    assert f"{handle.parent.span_id:016x}" == TRACEPARENT.split("-")[2]
    assert [s.get_span_context() for s in seen] == [handle.get_span_context()]
    assert spans.one("cancel order").parent.span_id == handle.context.span_id
    assert dict(handle.attributes) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "handle",
        "messaging.operation.type": "process",
        "messaging.destination.name": "shop.v1.q.orders",
        "messaging.message.id": "m-1",
        "rabbit_delay.tier": "1s",
        "rabbit_delay.attempt": 1,
        "rabbit_delay.redelivered": False,
        "rabbit_delay.lateness_ms": 40,
        "rabbit_delay.outcome": "acked",
    }
    assert handle.status.is_unset


def test_a_failed_attempt_has_a_retry_span_and_its_copy_keeps_the_trace(spans: Spans) -> None:
    def handler(msg: bytes) -> None:
        raise Retry("payment service down")

    worker, _app = worker_for(handler)
    steps, settled = deliver(worker, {h.H_TRACEPARENT: TRACEPARENT})
    publish = next(s for s in steps if isinstance(s, Publish))
    assert publish.outgoing.headers[h.H_TRACEPARENT] == TRACEPARENT  # unchanged
    handle, retry = spans.one("handle "), spans.one("retry ")
    assert handle.status.status_code.name == "ERROR"
    assert handle.attributes["rabbit_delay.outcome"] == "retried"
    assert retry.parent.span_id == handle.context.span_id
    assert dict(retry.attributes) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "retry",
        "messaging.operation.type": "send",
        "messaging.destination.name": "shop.v1.q.orders",
        "messaging.message.id": "m-1",
        "rabbit_delay.attempt": 2,
        "rabbit_delay.tier": "5s",
        "rabbit_delay.delay_ms": 5000,
        "rabbit_delay.lateness_ms": 40,
    }
    assert settled.action is not None


def test_a_parked_message_has_a_park_span(spans: Spans) -> None:
    def handler(msg: bytes) -> None:
        raise Reject("no such order")

    worker, _app = worker_for(handler)
    deliver(worker, {})  # no traceparent: the handle span starts a trace
    handle, park = spans.one("handle "), spans.one("park ")
    assert handle.parent is None
    assert handle.attributes["rabbit_delay.outcome"] == "parked"
    assert handle.status.description == "parked: rejected"
    assert park.parent.span_id == handle.context.span_id
    assert park.attributes["rabbit_delay.park_reason"] == "rejected"
    assert park.attributes["rabbit_delay.attempt"] == 1


def test_a_deferred_copy_is_no_retry(spans: Spans) -> None:
    worker, _app = worker_for(lambda msg: None)
    consumer = worker.consumers[0]
    base = {h.H_ATTEMPT: 1, h.H_TIER: "1s", h.H_DUE_AT: NOW}
    program = worker.program(consumer, Delivery("m-2", base, False, b"{}", None, NOW), UNKNOWN)
    step = program.send(None)
    assert isinstance(step, Claim)
    step = program.send(ClaimResult.IN_PROGRESS)  # another copy runs: deferred
    assert isinstance(step, Publish)
    assert isinstance(program.send(None), WriteAck)  # the copy is confirmed: ack
    with pytest.raises(StopIteration):
        program.send(None)
    assert spans.named("retry ") == []
    assert spans.one("handle ").attributes["rabbit_delay.outcome"] == "deferred"


def test_an_abandoned_delivery_still_ends_its_span(spans: Spans) -> None:
    worker, _app = worker_for(lambda msg: None)
    consumer = worker.consumers[0]
    headers = {h.H_ATTEMPT: 1, h.H_DUE_AT: NOW}
    program = worker.program(consumer, Delivery("m-3", headers, False, b"{}", None, NOW), UNKNOWN)
    program.send(None)
    program.close()  # a forced stop
    assert spans.one("handle ").attributes["rabbit_delay.outcome"] == "abandoned"
