"""What every worker is before any I/O: its app and consumers, validated settings, its
identity, the programs it drives (lifecycle, deliveries, housekeeping), its health and
the registry of its consumer tags.

The transports (`rabbit_delay.sync.Worker`, `rabbit_delay.aio.AsyncWorker`, the test
kit's `MemoryWorker`) subclass it and add only execution: connections, threads or tasks,
acks. What a worker reports (counters, logs, metrics) is the `report` they hand in
(`rabbit_delay._observe.report.WorkerReport`): this module logs nothing itself.
"""

from __future__ import annotations

import itertools
import os
import platform
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from rabbit_delay._broker import BrokerInfo
from rabbit_delay._consumer.app import App, Consumer, Transport
from rabbit_delay._consumer.context import clock_ms
from rabbit_delay._consumer.delivery import Delivery, Program, delivery_program
from rabbit_delay._consumer.events import WorkerEvents
from rabbit_delay._consumer.handlers import Timer
from rabbit_delay._consumer.health import Health, Phase
from rabbit_delay._consumer.housekeeping import HousekeepingStep, housekeeping_program
from rabbit_delay._consumer.leases import LeaseBook
from rabbit_delay._consumer.lifecycle import Lifecycle, lifecycle_program
from rabbit_delay._consumer.settings import DEFAULT_SHUTDOWN_TIMEOUT_S, WorkerSettings
from rabbit_delay._plan.desired import desired
from rabbit_delay._plan.refusals import check_broker
from rabbit_delay._urls import redact

if TYPE_CHECKING:
    from collections.abc import Generator

    from rabbit_delay._observe.metrics import Metrics


class DeliveryTracer(Protocol):
    """Spans of deliveries (rabbit_delay._observe.tracing.OpenTelemetry), handed in by the
    transport, so the core imports no tracing."""

    def trace_delivery(
        self, program: Program, consumer: Consumer, delivery: Delivery, queue_name: str
    ) -> Program:
        """`program` wrapped in its handle span (and retry / park spans)."""
        ...


class Report(WorkerEvents, Protocol):
    """What a worker's report is, beyond the events its programs tell."""

    stats: Any  # WorkerStats: what the worker counted

    def arrived(self) -> None:
        """One delivery arrived (counted, on the thread or loop that settles)."""

    def received(self, queue: str, headers: Mapping[str, object] | None, received_ms: int) -> None:
        """One delivery's program starts: its lateness observed (thread-safe)."""

    @property
    def timer(self) -> Timer | None:
        """What handler run times are told to, or None."""

    def stopped(self) -> None:
        """The worker stopped (its last line)."""

    def consuming_again(self, queue: str, tag: str) -> None:
        """A consumer the broker cancelled consumes again, under `tag`."""


def worker_identity() -> str:
    """host:pid:random, the prefix of every idempotency owner token of one worker.

    An owner token is this plus a per-delivery counter: a claim is re-entrant for its
    owner, so two deliveries must never share one.
    """
    return f"{platform.node()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class WorkerCore:
    """A worker's state and decisions, shared by the sync, async and in-memory workers.

    `url`: one broker URL, several (a sequence, or one string separated by commas), or
    None for `connection_settings.urls`, else $RABBIT_DELAY_URL, else the local broker.
    The worker consumes from the first node that answers; when the connection is lost it
    reconnects with backoff (`connection_settings.backoff`, its maximum replaced by
    `reconnect_max_s` when given), trying the nodes after the lost one first. Each node
    must hold the topology (a cluster shares it; separate brokers each need `declare`).

    Raises ConfigError for a handler the transport cannot run, an unknown queue or a
    malformed URL list, ValueError for a concurrency or prefetch below 1.
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
        connection_settings: Any = None,
        name: str | None = None,
        install_signal_handlers: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.consumers = app.select(queues)
        app.check_runnable(self.consumers, self.transport)
        self.settings = WorkerSettings.resolve(
            url,
            default_concurrency=self.default_concurrency,
            prefetch=prefetch,
            concurrency=concurrency,
            declare=declare,
            shutdown_timeout=shutdown_timeout,
            reconnect_max_s=reconnect_max_s,
            connection_settings=connection_settings,
            install_signal_handlers=install_signal_handlers,
        )
        self.urls = self.settings.urls
        self.url = self.urls[0]  # the node connected to (or tried first)
        self.identity = worker_identity()
        self.name = name or f"rabbit-delay worker {self.identity}"
        self.started = threading.Event()  # set once consuming (again after a reconnect)
        self.ever_started = False
        self.guarded = any(c.idempotent for c in self.consumers)
        # Run beside the consumers, one worker at a time (rabbit_delay._reconcile).
        self.reconcilers = list(app.reconcilers.values())
        self.leases = LeaseBook(app.lease_ms)
        # UTC epoch ms for the programs (due times, failure times, leases): the wall
        # clock; the in-memory worker of rabbit_delay.testing reads its virtual one.
        self.clock: Callable[[], int] = clock_ms
        self._wanted = desired(app.topology)
        self._seq = itertools.count(1)
        self._phase = Phase.STARTING
        self._beat: float | None = None  # monotonic time of the loop's last beat
        self.report = self.make_report(metrics)
        self.new_channel()
        self._prepare()

    # -- what each transport hands in ------------------------------------------------------

    def make_report(self, metrics: Metrics | None) -> Report:
        """The worker's report: counters, logs and metrics (the core counts and logs
        nothing itself)."""
        raise NotImplementedError

    def tracer(self) -> DeliveryTracer | None:
        """Where the spans of a delivery come from, asked per delivery (None: none)."""
        return None

    def _prepare(self) -> None:
        """The transport's own state, set up once the core's is (no I/O)."""

    # -- settings, as read by the drivers ---------------------------------------------------

    @property
    def stats(self) -> Any:
        """What this worker counted (WorkerStats)."""
        return self.report.stats

    @property
    def concurrency(self) -> int:
        return self.settings.concurrency

    @property
    def prefetch(self) -> int:
        return self.settings.prefetch

    @property
    def shutdown_timeout(self) -> float:
        return self.settings.shutdown_timeout_s

    # -- the programs --------------------------------------------------------------------------

    def lifecycle(self) -> Lifecycle:
        """The connection lifecycle of one `run()` (consumer/lifecycle.py)."""
        return lifecycle_program(self, self.report)

    def program(self, consumer: Consumer, delivery: Delivery, broker: BrokerInfo) -> Program:
        """The delivery program of one delivery (consumer/delivery.py), with a fresh owner
        token when it runs under the guard, traced where the application uses
        OpenTelemetry."""
        owner = None
        if self.guarded and consumer.idempotent:
            owner = f"{self.identity}:{next(self._seq)}"
        self.report.received(consumer.queue, delivery.headers, delivery.received_ms)
        program = delivery_program(
            consumer,
            delivery,
            owner=owner,
            broker=broker,
            lease_ms=self.leases.lease_ms,
            clock=self.clock,
        )
        tracer = self.tracer()
        if tracer is None:
            return program
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        return tracer.trace_delivery(program, consumer, delivery, queue_name)

    def housekeeping(
        self, *, purges: bool, until_idle: bool = False
    ) -> Generator[HousekeepingStep, object, None]:
        """Lease renewals and purges beside the deliveries (consumer/housekeeping.py)."""
        return housekeeping_program(
            self.leases,
            self.report,
            clock=self.clock,
            monotonic=time.monotonic,
            purges=purges,
            until_idle=until_idle,
        )

    def check_broker(self, broker: BrokerInfo) -> None:
        """Refuse, before consuming, a broker whose version cannot serve the topology:
        the rules `rabbit-delay declare` applies, e.g. retry backend "broker" before
        RabbitMQ 4.3. Raises IncompatibleBroker."""
        check_broker(self._wanted, broker)

    def queue_names(self) -> list[str]:
        """The broker names of the business queues this worker consumes."""
        names = self.app.topology.names
        return [names.business_queue(c.queue) for c in self.consumers]

    def on_signal(self, name: str, stopping: bool) -> bool:
        """A SIGINT/SIGTERM arrived: the first stops gracefully, a second one (`stopping`)
        forces the stop. Returns True to force."""
        self.report.stop_begins(name, stopping)
        return stopping

    # -- health (consumer/health.py) --------------------------------------------------------

    def stop_requested(self) -> bool:
        """Whether the worker was asked to stop (signal or stop())."""
        raise NotImplementedError

    def beat(self) -> None:
        """The worker's loop is alive: called from the loop itself, at least every second
        while it runs (the liveness rule in consumer/health.py)."""
        self._beat = time.monotonic()

    def run_begins(self) -> None:
        self._phase = Phase.RUNNING
        self.beat()

    def run_ends(self) -> None:
        self._phase = Phase.STOPPED
        if self.ever_started:
            self.report.stopped()

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

    # -- consumer tags ------------------------------------------------------------------------

    def new_channel(self) -> None:
        """Forget the consumer tags of the previous channel (tags never outlive theirs)."""
        self._by_tag: dict[str, Consumer] = {}  # current consumer tags -> their consumer
        self._cancelled: set[str] = set()  # consumer tags the broker cancelled

    def consuming(self, tag: str, consumer: Consumer) -> None:
        """`consumer` consumes under `tag` now."""
        self._by_tag[tag] = consumer

    def consumer_tags(self) -> list[str]:
        return list(self._by_tag)

    def consumer_cancelled(self, tag: str, broker: BrokerInfo, stopping: bool) -> Consumer | None:
        """The broker sent basic.cancel for consumer `tag`: its deliveries went back to the
        queue, so none of them may be acked (or copied) any more. Reported once, for every
        driver. Returns the consumer to consume again, or None (not ours, or the worker is
        stopping)."""
        consumer = self._by_tag.pop(tag, None)
        if consumer is None:
            return None
        self._cancelled.add(tag)
        queue_name = self.app.topology.names.business_queue(consumer.queue)
        self.report.consumer_cancelled(consumer.queue, queue_name, tag, broker, not stopping)
        return None if stopping else consumer


__all__ = ["DeliveryTracer", "Report", "WorkerCore", "worker_identity"]
