"""What both workers share before any I/O: settings, identity, counters, metrics, the
lease book and the accounting of settled deliveries."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

from rabbit_delay._broker import BrokerInfo
from rabbit_delay._connection import ConnectionSettings, ReconnectBackoff, failover_order
from rabbit_delay._consumer.app import App, Consumer, Prepared, Transport
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay._consumer.decide import Outcome, Undecodable
from rabbit_delay._consumer.delivery import (
    Claim,
    Delivery,
    Finish,
    Program,
    Settled,
    delivery_program,
)
from rabbit_delay._consumer.health import Health, Phase
from rabbit_delay._consumer.leases import LeaseBook
from rabbit_delay._consumer.stats import (
    WorkerMetrics,
    WorkerStats,
    log_action,
    log_consumer_cancelled,
    worker_identity,
)
from rabbit_delay._errors import MissingObjectError
from rabbit_delay._idempotency.guard import ClaimResult, Guard
from rabbit_delay._observe import tracing
from rabbit_delay._observe.logs import delivery_fields
from rabbit_delay._plan.desired import desired
from rabbit_delay._plan.refusals import check_broker
from rabbit_delay._urls import redact

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics

log = logging.getLogger("rabbit_delay.worker")

PURGE_EVERY_S = 600.0
# How long running handlers get to finish once a worker is asked to stop.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
_NO_SPAN = contextlib.nullcontext()  # reusable: entering it does nothing


class WorkerSettings(TypedDict, total=False):
    """Keyword arguments of both workers (see WorkerBase)."""

    queues: Sequence[str] | None
    prefetch: int | None
    concurrency: int | None
    declare: bool
    shutdown_timeout: float
    reconnect_max_s: float | None
    connection_settings: ConnectionSettings | None
    name: str | None
    install_signal_handlers: bool
    metrics: Metrics | None


class WorkerBase:
    """Validated settings of a worker; `Worker` (pika) and `AsyncWorker` (aio-pika) add
    the I/O. Raises ConfigError for a handler the transport cannot run, an unknown queue
    or a malformed URL list, ValueError for a concurrency or prefetch below 1.

    `url`: one broker URL, several (a sequence, or one string separated by commas), or
    None for `connection_settings.urls`, else $RABBIT_DELAY_URL, else the local broker.
    The worker consumes from the first node that answers; when the connection is lost it
    reconnects with backoff (`connection_settings.backoff`, its maximum replaced by
    `reconnect_max_s` when given), trying the nodes after the lost one first. Each node
    must hold the topology (a cluster shares it; separate brokers each need `declare`).
    """

    transport: ClassVar[Transport]
    default_concurrency: ClassVar[int]

    def __init__(
        self,
        app: App,
        url: str | Sequence[str] | None = None,
        *,
        queues: Sequence[str] | None = None,
        prefetch: int | None = None,
        concurrency: int | None = None,
        declare: bool = False,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        reconnect_max_s: float | None = None,
        connection_settings: ConnectionSettings | None = None,
        name: str | None = None,
        install_signal_handlers: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        concurrency = self.default_concurrency if concurrency is None else concurrency
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.app = app
        self.consumers = app.select(queues)
        app.check_runnable(self.consumers, self.transport)
        self.connection_settings = connection_settings or ConnectionSettings()
        self.urls = self.connection_settings.resolve(url)
        self.url = self.urls[0]  # the node connected to (or tried first)
        backoff = self.connection_settings.backoff
        if reconnect_max_s is not None:
            backoff = ReconnectBackoff(
                min(backoff.initial_s, reconnect_max_s), reconnect_max_s, backoff.jitter
            )
        self.backoff = backoff
        self.concurrency = concurrency
        self.prefetch = prefetch if prefetch is not None else 2 * concurrency
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {self.prefetch}")
        self.declare = declare
        self.shutdown_timeout = shutdown_timeout
        self.reconnect_max_s = backoff.max_s
        self.identity = worker_identity()
        self.name = name or f"rabbit-delay worker {self.identity}"
        self.install_signal_handlers = install_signal_handlers
        self.stats = WorkerStats()
        self.metrics = (
            WorkerMetrics(metrics, [c.queue for c in self.consumers], app.topology.tiers)
            if metrics
            else None
        )
        self.started = threading.Event()  # set once consuming (again after a reconnect)
        self.ever_started = False
        self._wanted = desired(app.topology)
        self.guarded = any(c.idempotent for c in self.consumers)
        # Run beside the consumers, one worker at a time (consumer/_reconcile.py).
        self.reconcilers = list(app.reconcilers.values())
        self.leases = LeaseBook(app.lease_ms)
        # UTC epoch ms for the delivery program (due times, failure times, leases): the
        # wall clock; the in-memory worker of rabbit_delay.testing reads its virtual one.
        self.clock: Callable[[], int] = clock_ms
        self._seq = itertools.count(1)
        self._next_purge = time.monotonic() + PURGE_EVERY_S
        self._phase = Phase.STARTING
        self._beat: float | None = None  # monotonic time of the loop's last beat
        self._new_channel()

    # -- health (consumer/_health.py) ----------------------------------------------------

    def stop_requested(self) -> bool:
        """Whether the worker was asked to stop (signal or stop())."""
        raise NotImplementedError

    def beat(self) -> None:
        """The worker's loop is alive: called from the loop itself, at least every second
        while it runs (the liveness rule in consumer/_health.py)."""
        self._beat = time.monotonic()

    def run_begins(self) -> None:
        self._phase = Phase.RUNNING
        self.beat()

    def run_ends(self) -> None:
        self._phase = Phase.STOPPED

    def health(self) -> Health:
        """Liveness and readiness now, for /healthz and /readyz. Safe from any thread:
        it only reads (the consumer-tag map is replaced, never shared, per channel)."""
        phase = self._phase
        if phase is Phase.RUNNING and self.stop_requested():
            phase = Phase.STOPPING
        beat = self._beat
        connected = self.started.is_set()
        # the tags of a lost channel stay until the next one opens: they consume nothing
        consuming = {c.queue for c in list(self._by_tag.values())} if connected else set()
        return Health(
            phase,
            None if beat is None else max(time.monotonic() - beat, 0.0),
            connected,
            tuple(c.queue for c in self.consumers if c.queue in consuming),
            tuple(c.queue for c in self.consumers),
            redact(self.url),
        )

    # -- the delivery program ---------------------------------------------------------

    def program(self, consumer: Consumer, delivery: Delivery, broker: BrokerInfo) -> Program:
        """The delivery program of one delivery (consumer/_delivery.py), with a fresh
        owner token when it runs under the guard."""
        owner = None
        if self.guarded and consumer.idempotent:
            owner = f"{self.identity}:{next(self._seq)}"
        if self.metrics is not None:  # lateness and schedule deviation, once per delivery
            self.metrics.delivered(consumer.queue, delivery.headers, delivery.received_ms)
        program = delivery_program(
            consumer,
            delivery,
            owner=owner,
            broker=broker,
            lease_ms=self.leases.lease_ms,
            clock=self.clock,
        )
        tracer = tracing.active()
        if tracer is None:
            return program
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        return tracer.trace_delivery(program, consumer, delivery, queue_name)

    def account(self, settled: Settled) -> None:
        """Count and log what became of one delivery: every counter once, here only."""
        stats = self.stats
        if settled.stale:
            stats.stale += 1
            return
        if settled.requeued:
            stats.requeued += 1
        action = settled.action
        if action is None:
            return
        log_action(settled.queue, settled.message_id, settled.attempt, action, settled.tier)
        stats.record(action)
        if self.metrics is not None:
            self.metrics.handled(settled.queue, action)
        if settled.publish_error is not None:
            stats.publish_failures += 1
            out = getattr(action, "outgoing", None)
            log.error(
                "could not publish %s of %s to %s: %s",
                type(action).__name__.lower(),
                settled.message_id,
                getattr(out, "exchange", "?"),
                settled.publish_error,
                extra=delivery_fields(
                    settled.queue, settled.message_id, settled.attempt, settled.tier
                ),
            )

    def queue_names(self) -> list[str]:
        """The broker names of the business queues this worker consumes."""
        names = self.app.topology.names
        return [names.business_queue(c.queue) for c in self.consumers]

    def reconnect_delays(self) -> Iterator[float]:
        """Seconds to wait between reconnect rounds (rabbit_delay._connection.ReconnectBackoff)."""
        return self.backoff.delays()

    def reconnect_order(self) -> tuple[str, ...]:
        """The URLs to try after losing the connection to `self.url`: the next ones
        first, so a dead node is tried last."""
        return failover_order(self.urls, self.url)

    def log_reconnect_failed(self, why: str, delay: float) -> None:
        log.warning(
            "reconnect failed (%s); next try in %.1fs%s",
            redact(why),
            delay,
            "" if len(self.urls) == 1 else f" (of {len(self.urls)} broker URLs)",
        )

    def log_reconnected(self) -> None:
        log.info("reconnected to %s", redact(self.url))

    def log_consuming(self) -> None:
        log.info(
            "worker %s consuming %s on %s (prefetch %d, concurrency %d)",
            self.identity,
            ", ".join(c.queue for c in self.consumers),
            redact(self.url),
            self.prefetch,
            self.concurrency,
        )

    def log_shutdown_timeout(self, unsettled: int, forced: bool = False) -> None:
        if forced:
            log.warning(
                "forced stop: %d message(s) still being handled are abandoned; the broker "
                "redelivers them, and they run again once their lease has run out",
                unsettled,
            )
            return
        log.warning(
            "shutdown timeout (%.0fs): %d message(s) still being handled; the broker will "
            "redeliver them; waiting for their handlers to record their results",
            self.shutdown_timeout,
            unsettled,
        )

    def log_still_running(self, running: int) -> None:
        log.warning(
            "waiting for %d running handler(s) to finish (SIGINT/SIGTERM again to abandon "
            "them: their messages run again after the lease)",
            running,
        )

    def on_signal(self, name: str, stopping: bool) -> bool:
        """A SIGINT/SIGTERM arrived: the first stops gracefully, a second one (`stopping`)
        forces the stop. Returns True to force."""
        if stopping:
            log.warning("signal %s again: stopping now, abandoning running handlers", name)
            return True
        log.info(
            "signal %s: stopping (in-flight handlers get %.0fs; %s again stops at once)",
            name,
            self.shutdown_timeout,
            name,
        )
        return False

    def log_stopped(self) -> None:
        """The last line of a worker that consumed; one that never started has said why
        in the exception its run() raised."""
        if self.ever_started:
            log.info("worker %s stopped: %s", self.identity, self.stats.as_dict())

    def lease_lost(self, key: str, owner: str) -> None:
        self.stats.leases_lost += 1
        log.warning(
            "the lease on %s (owner %s) was lost while its handler runs: the store could not "
            "renew it in time, or another worker took it over; a second copy may run",
            key,
            owner,
        )

    def finished_after_lost_lease(self, key: str) -> None:
        log.warning(
            "%s finished after its lease was lost: another copy may have run beside it", key
        )

    def claim_now(self, guard: Guard, step: Claim) -> object:
        """Execute a Claim step on a synchronous guard: its result, or the store's
        exception (the step's reply); a claimed key is held in the lease book."""
        try:
            result = guard.claim(step.key, step.owner)
        except Exception as exc:
            return exc
        if result is ClaimResult.CLAIMED:
            self.leases.hold(step.key, step.owner, self.clock())
        return result

    def finish_now(self, guard: Guard, step: Finish) -> object:
        """Execute a Finish step on a synchronous guard: done or released, the lease
        dropped (a lease lost meanwhile is logged); None, or the store's exception."""
        if self.leases.drop(step.owner):
            self.finished_after_lost_lease(step.key)
        try:
            if step.succeeded:
                guard.done(step.key, step.owner)
            else:
                guard.failed(step.key, step.owner)
        except Exception as exc:
            return exc
        return None

    def renew_due(self, renew: Callable[[str, str], bool]) -> None:
        """One round of lease renewals with a synchronous guard (`Guard.renew`): every
        running handler's claim that is due (LeaseBook.due) is renewed; a failed renewal
        is logged and tried again next round, a lost lease counted and logged."""
        book = self.leases
        for key, owner in book.due(self.clock()):
            try:
                ok = renew(key, owner)
            except Exception as exc:
                log.warning("lease renewal of %s failed: %r", key, exc)
                continue
            if book.renewed(owner, ok, self.clock()):
                self.lease_lost(key, owner)

    def purge_due(self) -> bool:
        """True once every PURGE_EVERY_S: time to delete expired idempotency records."""
        now = time.monotonic()
        if now < self._next_purge:
            return False
        self._next_purge = now + PURGE_EVERY_S
        return True

    def _new_channel(self) -> None:
        """Forget the consumer tags of the previous channel (tags never outlive theirs)."""
        self._by_tag: dict[str, Consumer] = {}  # current consumer tags -> their consumer
        self._cancelled: set[str] = set()  # consumer tags the broker cancelled

    def _consumer_cancelled(self, tag: str, broker: BrokerInfo, stopping: bool) -> Consumer | None:
        """The broker sent basic.cancel for consumer `tag`: its deliveries went back to the
        queue, so none of them may be acked (or copied) any more. Counted and logged once,
        for both workers. Returns the consumer to consume again, or None (not ours, or the
        worker is stopping)."""
        consumer = self._by_tag.pop(tag, None)
        if consumer is None:
            return None
        self._cancelled.add(tag)
        self.stats.consumer_cancels += 1
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        log_consumer_cancelled(consumer.queue, queue_name, tag, broker, not stopping)
        return None if stopping else consumer

    @staticmethod
    def missing_queue(queue_name: str) -> MissingObjectError:
        """The error for a business queue absent from the broker at start."""
        return MissingObjectError(
            f"queue {queue_name!r} does not exist on the broker: declare the topology "
            "(`rabbit-delay declare`), or start the worker with --declare"
        )

    def check_broker(self, broker: BrokerInfo) -> None:
        """Refuse, before consuming, a broker whose version cannot serve the topology:
        the rules `rabbit-delay declare` applies (plan.broker_requirements), e.g. retry
        backend "broker" before RabbitMQ 4.3. Raises IncompatibleBroker."""
        check_broker(self._wanted, broker)


def call_handler(consumer: Consumer, prepared: Prepared, metrics: WorkerMetrics | None) -> Outcome:
    """Decode the body (if not yet) and run a plain `def` handler: None, the exception it
    raised, or Undecodable (the Run step's reply)."""
    try:
        message = consumer.decoded(prepared)
    except Exception as exc:  # ValidationError, or whatever a TypeAdapter raises
        return Undecodable.from_exception(exc)
    start = time.perf_counter() if metrics is not None else 0.0
    scope = prepared.ctx.span_scope
    try:
        with scope() if scope is not None else _NO_SPAN:  # its span current, if traced
            if consumer.takes_context:
                consumer.handler(message, prepared.ctx)
            else:
                consumer.handler(message)
    except Exception as exc:
        return exc
    finally:
        if metrics is not None:
            metrics.handler_time(consumer.queue, time.perf_counter() - start)
    return None


async def call_async_handler(
    consumer: Consumer, prepared: Prepared, metrics: WorkerMetrics | None
) -> Outcome:
    """`call_handler` for an `async def` handler."""
    try:
        message = consumer.decoded(prepared)
    except Exception as exc:
        return Undecodable.from_exception(exc)
    start = time.perf_counter() if metrics is not None else 0.0
    handler: Any = consumer.handler
    scope = prepared.ctx.span_scope
    try:
        with scope() if scope is not None else _NO_SPAN:
            if consumer.takes_context:
                await handler(message, prepared.ctx)
            else:
                await handler(message)
    except Exception as exc:
        return exc
    finally:
        if metrics is not None:
            metrics.handler_time(consumer.queue, time.perf_counter() - start)
    return None
