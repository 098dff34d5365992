"""Prometheus metrics for publishers and workers (prometheus-client).

Nothing is created on import: the metrics live on a `Metrics` instance, registered in
the `CollectorRegistry` it is given (a fresh one by default). `default_metrics()`
creates, on first call, the one instance registered in prometheus-client's global
`REGISTRY`, which is what `start_metrics_server()` serves unless told otherwise.

    rabbit_delay_published_total{queue,tier}             confirmed publishes
    rabbit_delay_publish_errors_total{queue,reason}      publishes not confirmed
    rabbit_delay_handled_total{queue,outcome}            deliveries, by what became of them
    rabbit_delay_handler_seconds{queue}                  handler run time (histogram)
    rabbit_delay_delivery_lateness_seconds{queue}        receive time - rd-due-at (histogram)

Label values come from the topology (queue and tier names) and from the closed sets
below, never from message content: one label value per message would grow the
registry without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from time import perf_counter
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from rabbit_delay.errors import (
    BrokerError,
    DelayError,
    EncodeError,
    MissingObjectError,
    NackError,
    UnconfirmedError,
    UnknownTargetError,
    UnroutableError,
)

NAMESPACE = "rabbit_delay"
# Handlers: from a cache hit to a slow remote call; past 5 minutes the lease matters more.
HANDLER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Lateness: TTL expiry and the dead-letter hop cost tens of ms; minutes mean a backlog.
LATENESS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class Outcome(StrEnum):
    """What became of one delivery (label `outcome` of handled_total)."""

    SUCCESS = "success"  # the handler returned: acked
    RETRY = "retry"  # the handler failed: republished through a delay, attempt + 1
    PARK = "park"  # sent to the parking lot (last attempt, Reject, undecodable)
    DUPLICATE = "duplicate"  # already handled: acked without running the handler
    CANCELLED = "cancelled"  # cancelled (tombstone): acked without running the handler
    IN_PROGRESS = "in_progress"  # a copy is being handled elsewhere: deferred


class PublishErrorReason(StrEnum):
    """Why a publish was not confirmed (label `reason` of publish_errors_total)."""

    UNROUTABLE = "unroutable"  # returned under `mandatory`
    NACK = "nack"  # the broker refused responsibility
    MISSING_OBJECT = "missing_object"  # 404: the exchange does not exist
    INVALID = "invalid"  # refused before sending: tier, delay, target, encoding
    BROKER = "broker"  # connection or channel failure, no confirm in time, broker blocked
    OTHER = "other"


def error_reason(exc: BaseException) -> PublishErrorReason:
    """The `reason` label for an exception raised by a publish."""
    if isinstance(exc, UnroutableError):
        return PublishErrorReason.UNROUTABLE
    if isinstance(exc, NackError):
        return PublishErrorReason.NACK
    if isinstance(exc, MissingObjectError):
        return PublishErrorReason.MISSING_OBJECT
    if isinstance(exc, DelayError | UnknownTargetError | EncodeError):
        return PublishErrorReason.INVALID
    if isinstance(exc, BrokerError | ConnectionError | UnconfirmedError):
        return PublishErrorReason.BROKER
    return PublishErrorReason.OTHER


class Metrics:
    """The rabbit-delay metrics, registered in one registry.

    One instance per registry: creating a second one on the same registry raises
    ValueError (prometheus-client refuses duplicate metric names). Thread-safe, like
    prometheus-client itself.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.published_total = Counter(
            "published",
            "Delayed messages published and confirmed by the broker.",
            ["queue", "tier"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.publish_errors_total = Counter(
            "publish_errors",
            "Publishes that were not confirmed, by reason.",
            ["queue", "reason"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.handled_total = Counter(
            "handled",
            "Deliveries handled by a worker, by outcome.",
            ["queue", "outcome"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.handler_seconds = Histogram(
            "handler_seconds",
            "Time spent in the handler, seconds.",
            ["queue"],
            namespace=NAMESPACE,
            registry=r,
            buckets=HANDLER_BUCKETS,
        )
        self.delivery_lateness_seconds = Histogram(
            "delivery_lateness_seconds",
            "Time from a message's due time (rd-due-at) to its delivery to a worker, seconds.",
            ["queue"],
            namespace=NAMESPACE,
            registry=r,
            buckets=LATENESS_BUCKETS,
        )

    # -- publishers ------------------------------------------------------------------------

    def published(self, queue: str, tier: str, count: int = 1) -> None:
        """`count` messages for `queue` were confirmed after `tier` (or cascade / plugin)."""
        self.published_total.labels(queue=queue, tier=tier).inc(count)

    def publish_error(self, queue: str, reason: PublishErrorReason | BaseException) -> None:
        """A publish for `queue` failed; pass the exception or a reason."""
        label = reason if isinstance(reason, PublishErrorReason) else error_reason(reason)
        self.publish_errors_total.labels(queue=queue, reason=label.value).inc()

    # -- workers ---------------------------------------------------------------------------

    def handled(self, queue: str, outcome: Outcome | str) -> None:
        """One delivery of `queue` ended with `outcome`.

        Raises ValueError for an outcome outside `Outcome` (label values are a closed set).
        """
        self.handled_total.labels(queue=queue, outcome=Outcome(outcome).value).inc()

    def handler_time(self, queue: str, seconds: float) -> None:
        self.handler_seconds.labels(queue=queue).observe(seconds)

    @contextmanager
    def time_handler(self, queue: str) -> Iterator[None]:
        """Observe the duration of the `with` block, also when it raises."""
        start = perf_counter()
        try:
            yield
        finally:
            self.handler_seconds.labels(queue=queue).observe(perf_counter() - start)

    def lateness(self, queue: str, due_at_ms: int | None, received_ms: int) -> None:
        """Record how late a delivery is; nothing for a message without `rd-due-at`.

        Early deliveries (clock skew between publisher and worker) count as 0: a negative
        observation would make the histogram's sum go down.
        """
        if due_at_ms is None:
            return
        late_s = max(received_ms - due_at_ms, 0) / 1000
        self.delivery_lateness_seconds.labels(queue=queue).observe(late_s)


_default: Metrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> Metrics:
    """The process-wide instance in prometheus-client's global REGISTRY, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics(REGISTRY)
        return _default


def start_metrics_server(
    port: int, *, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Serve /metrics over HTTP on a daemon thread (`rabbit_delay.endpoints`, which
    also serves a worker's /healthz and /readyz when given its health).

    Serves `registry`, by default the global REGISTRY (where `default_metrics()` lives,
    beside the process and platform collectors). Port 0 picks a free port
    (`server.server_port`); `server.shutdown()` stops it. Raises OSError if the port is
    taken.
    """
    from rabbit_delay.endpoints import serve

    return serve(port, addr=addr, registry=registry if registry is not None else REGISTRY)


__all__ = [
    "Metrics",
    "Outcome",
    "PublishErrorReason",
    "default_metrics",
    "error_reason",
    "start_metrics_server",
]
