"""What both workers share before any I/O: settings, identity, counters, metrics."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypedDict

from rabbit_delay.broker import BrokerInfo
from rabbit_delay.consumer._app import App, Consumer, Transport
from rabbit_delay.consumer._stats import (
    WorkerMetrics,
    WorkerStats,
    log_consumer_cancelled,
    worker_identity,
)
from rabbit_delay.plan import check_broker, desired
from rabbit_delay.urls import broker_url

if TYPE_CHECKING:
    from rabbit_delay.metrics import Metrics


class WorkerSettings(TypedDict, total=False):
    """Keyword arguments of both workers (see WorkerBase)."""

    queues: Sequence[str] | None
    prefetch: int | None
    concurrency: int | None
    declare: bool
    shutdown_timeout: float
    reconnect_max_s: float
    name: str | None
    install_signal_handlers: bool
    metrics: Metrics | None


class WorkerBase:
    """Validated settings of a worker; `Worker` (pika) and `AsyncWorker` (aio-pika) add
    the I/O. Raises ConfigError for a handler the transport cannot run or an unknown
    queue, ValueError for a concurrency or prefetch below 1."""

    transport: ClassVar[Transport]
    default_concurrency: ClassVar[int]

    def __init__(
        self,
        app: App,
        url: str | None = None,
        *,
        queues: Sequence[str] | None = None,
        prefetch: int | None = None,
        concurrency: int | None = None,
        declare: bool = False,
        shutdown_timeout: float = 30.0,
        reconnect_max_s: float = 30.0,
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
        self.url = broker_url(url)
        self.concurrency = concurrency
        self.prefetch = prefetch if prefetch is not None else 2 * concurrency
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {self.prefetch}")
        self.declare = declare
        self.shutdown_timeout = shutdown_timeout
        self.reconnect_max_s = reconnect_max_s
        self.identity = worker_identity()
        self.name = name or f"rabbit-delay worker {self.identity}"
        self.install_signal_handlers = install_signal_handlers
        self.stats = WorkerStats()
        self.metrics = (
            WorkerMetrics(metrics, [c.queue for c in self.consumers]) if metrics else None
        )
        self.started = threading.Event()  # set once consuming (again after a reconnect)
        self._wanted = desired(app.topology)
        self._new_channel()

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

    def check_broker(self, broker: BrokerInfo) -> None:
        """Refuse, before consuming, a broker whose version cannot serve the topology:
        the rules `rabbit-delay declare` applies (plan.broker_requirements), e.g. retry
        backend "broker" before RabbitMQ 4.3. Raises IncompatibleBroker."""
        check_broker(self._wanted, broker)
