"""Trace context through the delay, and OpenTelemetry spans where the application uses it.

The W3C trace context (`traceparent`, `tracestate`: names.TRACE_HEADERS) travels in the
message headers. A `traceparent` the caller put in `headers=` passes through unchanged,
with or without OpenTelemetry: through the tiers and the cascade (dead-lettering keeps
headers), retries and deferrals (a worker's copy keeps the delivery's headers) and
replays (`replay.replay_headers` keeps them). A handler reads it as `ctx.traceparent`.

OpenTelemetry is optional (`pip install 'rabbit-delay[otel]'`) and rabbit-delay never
imports it by itself: the spans below exist once the application has imported
`opentelemetry.trace` (configuring the SDK, or creating any span, does), looked up in
`sys.modules` on each publish call and delivery. Then:

    span             kind      parent                       what
    publish {dest}   PRODUCER  the current span, if any     one per publish call (until the
                                                            broker's confirms); its context
                                                            goes into each message without one
    handle {queue}   CONSUMER  the message's traceparent    one per delivery, from when the
                                                            worker takes it up to its ack;
                                                            current while the handler runs,
                                                            so its spans nest
    retry {queue}    PRODUCER  the handle span              the copy of a failed attempt (or the
                                                            broker's delayed requeue, 4.3+)
    park {queue}     PRODUCER  the handle span              the copy sent to the parking lot

Every attempt of a message is a child of the same publish span: a retried copy keeps the
original's traceparent. A publish call whose messages all carry a traceparent already
(the worker's retries, a forwarded message), made with no span current, makes no span.

Attributes: `messaging.system` = "rabbitmq", `messaging.operation.name` (publish,
handle, retry, park) and `.type` (send, process), `messaging.destination.name` (the
business queue, or the routing key a publish targets), `messaging.message.id` (a call
of one message), `messaging.batch.message_count` (several), `rabbit_delay.tier` (rd-tier:
the tier, "cascade", "plugin" or "now"), `rabbit_delay.attempt`, `rabbit_delay.delay_ms`
(publish, retry), `rabbit_delay.lateness_ms` (handle, retry, park: receipt minus
rd-due-at), `rabbit_delay.outcome` (handle: what became of the delivery, the values of
rabbit_delay._consumer.outcome.Outcome; "abandoned" for a handle span whose program never
ended, a forced stop), `rabbit_delay.park_reason` (park).

`configure(tracer_provider=..., enabled=...)` gives rabbit-delay a provider of its own
instead of the global one, or turns its spans off (the headers still pass through).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import rabbit_delay._headers as h
from rabbit_delay._consumer.decide import BrokerRetry, Park
from rabbit_delay._consumer.delivery import Delivery, Program, Publish, Run, Settled
from rabbit_delay._envelope import Outgoing, with_trace_context
from rabbit_delay._envelope import text_header as text
from rabbit_delay._version import __version__

if TYPE_CHECKING:
    from rabbit_delay._consumer.app import Consumer
    from rabbit_delay._errors import RabbitDelayError
    from rabbit_delay._publishing.confirms import Ledger

OTEL_TRACE_MODULE = "opentelemetry.trace"
INSTRUMENTATION = "rabbit_delay"

SYSTEM = "rabbitmq"
A_SYSTEM = "messaging.system"
A_OPERATION_NAME = "messaging.operation.name"
A_OPERATION_TYPE = "messaging.operation.type"
A_DESTINATION = "messaging.destination.name"
A_MESSAGE_ID = "messaging.message.id"
A_BATCH_COUNT = "messaging.batch.message_count"
A_TIER = "rabbit_delay.tier"
A_ATTEMPT = "rabbit_delay.attempt"
A_DELAY_MS = "rabbit_delay.delay_ms"
A_LATENESS_MS = "rabbit_delay.lateness_ms"
A_OUTCOME = "rabbit_delay.outcome"
A_PARK_REASON = "rabbit_delay.park_reason"
A_REDELIVERED = "rabbit_delay.redelivered"

SEVERAL = "(several)"  # the destination of a publish call to several targets

_enabled = True
_provider: Any = None
_otel: OpenTelemetry | None = None


def configure(*, tracer_provider: Any = None, enabled: bool = True) -> None:
    """Where rabbit-delay's spans go: `tracer_provider` (an OpenTelemetry
    TracerProvider; None: the global one) and whether it makes any (`enabled`; trace
    headers pass through either way)."""
    global _enabled, _provider
    _enabled = enabled
    _provider = tracer_provider
    if _otel is not None:
        _otel.tracer = None  # asked again of the new provider


def active() -> OpenTelemetry | None:
    """The OpenTelemetry adapter when the application uses OpenTelemetry (and spans are
    enabled), else None. Never imports OpenTelemetry into a process without it."""
    global _otel
    if not _enabled:
        return None
    otel = _otel
    if otel is not None:
        return otel
    if OTEL_TRACE_MODULE not in sys.modules and _provider is None:
        return None
    _otel = otel = OpenTelemetry()
    return otel


def _int(value: object) -> int | None:
    """An integer header (pika decodes 64-bit ones as its own int subclass), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class _Getter:
    """OpenTelemetry's TextMap getter over AMQP headers (values may be bytes)."""

    def get(self, carrier: Mapping[str, object], key: str) -> list[str] | None:
        value = text(carrier.get(key))
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, object]) -> list[str]:
        return list(carrier)


# Duck-typed: subclassing OpenTelemetry's Getter would import it with rabbit-delay.
_GETTER: Any = _Getter()


class OpenTelemetry:
    """The OpenTelemetry API, imported on first use (see `active`)."""

    def __init__(self) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._trace = trace
        self._propagate = propagate
        self._producer = SpanKind.PRODUCER
        self._consumer = SpanKind.CONSUMER
        self._status = Status
        self._error = StatusCode.ERROR
        self.tracer: Any = None

    def _tracer(self) -> Any:
        tracer = self.tracer
        if tracer is None:
            tracer = self.tracer = self._trace.get_tracer(
                INSTRUMENTATION, __version__, tracer_provider=_provider
            )
        return tracer

    def fail(self, span: Any, error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            span.record_exception(error)
        span.set_status(self._status(self._error, str(error)))

    # -- publishing ----------------------------------------------------------------------

    def start_publish(self, outs: Sequence[Outgoing]) -> tuple[list[Outgoing], Any]:
        """The publish span of one call (or None) and the messages to send: those
        without a traceparent get the span's context."""
        bare = [o for o in outs if h.H_TRACEPARENT not in o.headers]
        if not bare and not self._trace.get_current_span().get_span_context().is_valid:
            return list(outs), None  # forwarded copies (a worker's retries): no new span
        first = outs[0]
        targets = {text(o.headers.get(h.H_TARGET)) or o.routing_key for o in outs}
        destination = targets.pop() if len(targets) == 1 else SEVERAL
        attributes: dict[str, Any] = {
            A_SYSTEM: SYSTEM,
            A_OPERATION_NAME: "publish",
            A_OPERATION_TYPE: "send",
            A_DESTINATION: destination,
        }
        tiers = {text(o.headers.get(h.H_TIER)) for o in outs}
        if len(tiers) == 1 and (tier := tiers.pop()) is not None:
            attributes[A_TIER] = tier
        if len(outs) == 1:
            attributes[A_MESSAGE_ID] = first.message_id
            for name, header in ((A_ATTEMPT, h.H_ATTEMPT), (A_DELAY_MS, h.H_DELAY_MS)):
                value = _int(first.headers.get(header))
                if value is not None:
                    attributes[name] = value
        else:
            attributes[A_BATCH_COUNT] = len(outs)
        span = self._tracer().start_span(
            f"publish {destination}", kind=self._producer, attributes=attributes
        )
        if not bare:
            return list(outs), span
        carrier: dict[str, str] = {}
        self._propagate.inject(carrier, context=self._trace.set_span_in_context(span))
        # no valid context (no SDK, nothing current): the carrier holds no traceparent
        return with_trace_context(outs, carrier), span

    def end_publish(self, span: Any, ledger: Ledger, failure: RabbitDelayError | None) -> None:
        """The end of a publish call's span: an error status when the call failed."""
        if failure is not None:
            self.fail(span, failure)
            span.set_attribute("rabbit_delay.confirmed", ledger.confirmed)
        span.end()

    # -- consuming -----------------------------------------------------------------------

    def trace_delivery(
        self, program: Program, consumer: Consumer, delivery: Delivery, queue_name: str
    ) -> Program:
        """`program` with its handle span (and the retry / park spans under it)."""
        headers = delivery.headers or {}
        parent = self._propagate.extract(headers, getter=_GETTER)
        attempt = _int(headers.get(h.H_ATTEMPT)) or 1
        # malformed headers: the program parks it, the span says so
        with contextlib.suppress(Exception):
            attempt = consumer.policy.envelope(delivery.message_id, headers).attempt
        attributes: dict[str, Any] = {
            A_SYSTEM: SYSTEM,
            A_OPERATION_NAME: "handle",
            A_OPERATION_TYPE: "process",
            A_DESTINATION: queue_name,
            A_ATTEMPT: attempt,
            A_REDELIVERED: delivery.redelivered,
        }
        if delivery.message_id:
            attributes[A_MESSAGE_ID] = delivery.message_id
        tier = text(headers.get(h.H_TIER))
        if tier is not None:
            attributes[A_TIER] = tier
        due = _int(headers.get(h.H_DUE_AT))
        lateness = None if due is None else delivery.received_ms - due
        if lateness is not None:
            attributes[A_LATENESS_MS] = lateness
        span = self._tracer().start_span(
            f"handle {queue_name}", context=parent, kind=self._consumer, attributes=attributes
        )
        return self._run(program, span, queue_name, attempt, lateness)

    def _scope(self, span: Any) -> Callable[[], AbstractContextManager[Any]]:
        use_span = self._trace.use_span

        def scope() -> AbstractContextManager[Any]:
            return use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            )

        return scope

    def _child(self, span: Any, operation: str, queue_name: str, attributes: dict[str, Any]) -> Any:
        attributes = {
            A_SYSTEM: SYSTEM,
            A_OPERATION_NAME: operation,
            A_OPERATION_TYPE: "send",
            A_DESTINATION: queue_name,
            **attributes,
        }
        return self._tracer().start_span(
            f"{operation} {queue_name}",
            context=self._trace.set_span_in_context(span),
            kind=self._producer,
            attributes=attributes,
        )

    def _run(
        self, program: Program, span: Any, queue_name: str, attempt: int, lateness: int | None
    ) -> Program:
        common: dict[str, Any] = {}
        if lateness is not None:
            common[A_LATENESS_MS] = lateness
        ended = False
        reply: object = None
        try:
            while True:
                try:
                    step = program.send(reply)
                except StopIteration as stop:
                    settled: Settled = stop.value
                    if isinstance(settled.action, BrokerRetry):
                        retry = self._child(
                            span,
                            "retry",
                            queue_name,
                            {
                                A_ATTEMPT: settled.action.attempt,
                                A_DELAY_MS: settled.action.delay_ms,
                                A_TIER: "broker",
                                **common,
                            },
                        )
                        retry.end()
                    self._end_handle(span, settled)
                    ended = True
                    return settled
                kind = type(step)
                if kind is Run:
                    run: Any = step
                    ctx = dataclasses.replace(run.prepared.ctx, span_scope=self._scope(span))
                    reply = yield Run(run.consumer, dataclasses.replace(run.prepared, ctx=ctx))
                    if isinstance(reply, BaseException):
                        self.fail(span, reply)
                    continue
                if kind is Publish:
                    publish: Any = step
                    child = self._copy_span(span, publish, queue_name, attempt, common)
                    reply = yield step
                    if child is not None:
                        if reply is not None:  # the publish failed, or the channel is gone
                            why = reply if isinstance(reply, BaseException) else f"{reply}"
                            self.fail(child, why)
                        child.end()
                    continue
                reply = yield step
        finally:
            if not ended:  # abandoned (a forced stop), or the program raised
                span.set_attribute(A_OUTCOME, "abandoned")
                span.end()
            program.close()

    def _copy_span(
        self, span: Any, publish: Any, queue_name: str, attempt: int, common: dict[str, Any]
    ) -> Any:
        out = publish.outgoing
        copy_attempt = _int(out.headers.get(h.H_ATTEMPT)) or attempt
        attributes: dict[str, Any] = {A_MESSAGE_ID: out.message_id, A_ATTEMPT: copy_attempt}
        if publish.kind == "park":
            reason = text(out.headers.get(h.H_PARK_REASON))
            if reason is not None:
                attributes[A_PARK_REASON] = reason
            return self._child(span, "park", queue_name, attributes | common)
        if copy_attempt <= attempt:
            return None  # a deferral or a store outage: the same attempt, later
        tier = text(out.headers.get(h.H_TIER))
        if tier is not None:
            attributes[A_TIER] = tier
        delay = _int(out.headers.get(h.H_DELAY_MS))
        if delay is not None:
            attributes[A_DELAY_MS] = delay
        return self._child(span, "retry", queue_name, attributes | common)

    def _end_handle(self, span: Any, settled: Settled) -> None:
        action = settled.action
        span.set_attribute(A_OUTCOME, settled.outcome.value)
        if isinstance(action, Park):
            span.set_status(self._status(self._error, f"parked: {action.reason.value}"))
        if settled.publish_error is not None:
            span.set_attribute("rabbit_delay.publish_error", settled.publish_error)
        span.end()


__all__ = ["OpenTelemetry", "active", "configure"]
