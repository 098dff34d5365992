"""Prometheus metrics for publishers and workers (prometheus-client).

Nothing is created on import: the metrics live on a `Metrics` instance, registered in
the `CollectorRegistry` it is given (a fresh one by default). `default_metrics()`
creates, on first call, the one instance registered in prometheus-client's global
`REGISTRY`, which is what `start_metrics_server()` serves unless told otherwise.

    rabbit_delay_published_total{queue,tier}             confirmed publishes
    rabbit_delay_publish_errors_total{queue,reason}      publishes not confirmed
    rabbit_delay_handled_total{queue,outcome}            deliveries, by what became of them
                                                         (rabbit_delay._consumer.outcome)
    rabbit_delay_handler_seconds{queue}                  handler run time (histogram)
    rabbit_delay_delivery_lateness_seconds{queue}        receive time - rd-due-at (histogram)
    rabbit_delay_outbox_relayed_total{queue,tier}        outbox rows published and marked sent
    rabbit_delay_outbox_relay_lag_seconds{queue}         confirm time - row creation (histogram)
    rabbit_delay_outbox_refused_total{queue,reason}      outbox rows the relay could not publish
    rabbit_delay_delivery_lateness_seconds{queue,tier}   receive time - rd-due-at (histogram)
    rabbit_delay_schedule_deviation_seconds{queue,tier}  rd-due-at - rd-asked-due-at (histogram)
    rabbit_delay_reconcile_runs_total{name,result}       reconciler runs, ok or failed
    rabbit_delay_reconcile_resubmitted_total{name}       messages reconcilers re-submitted

`tier` is the rd-tier a delivery came through: a tier of the topology, "cascade",
"plugin", "now" (sent to the due exchange: a replay, a re-submission), "other" (a value
the topology does not have) or "none" (no rd-tier header). docs/observability.md has
every metric and PromQL alerts.

Label values come from the topology (queue and tier names) and from the closed sets
below, never from message content: one label value per message would grow the
registry without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from enum import StrEnum

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from rabbit_delay._errors import (
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
# Outbox relay lag: a poll interval and a publish are tens to hundreds of ms; seconds
# mean a relay that is behind, minutes one that was down.
RELAY_LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
# Schedule deviation: 0 for tiers and the plugin (the first bucket holds them); the
# cascade rounds up by less than its resolution (100 ms .. 1 s, or a custom one), a
# longer tier for what remains of a moved message by up to that tier.
DEVIATION_BUCKETS = (0.001, 0.01, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60, 300, 3600)
# The `tier` label of a delivery without rd-tier, and of an rd-tier outside the topology.
NO_TIER = "none"
OTHER_TIER = "other"


def late_s(due_at_ms: int, received_ms: int) -> float:
    """How late a delivery is, seconds: receipt minus rd-due-at. An early one (clock skew
    between publisher and worker) counts as 0: a negative observation would make the
    histogram's sum go down."""
    return max(received_ms - due_at_ms, 0) / 1000


def deviation_s(due_at_ms: int, asked_due_at_ms: int) -> float:
    """How much later than asked a message was scheduled, seconds (rd-due-at minus
    rd-asked-due-at: the cascade's rounding up); never negative."""
    return max(due_at_ms - asked_due_at_ms, 0) / 1000


def tier_label(value: object, known: frozenset[str] | set[str]) -> str:
    """The `tier` label for an rd-tier header value: itself when in `known` (the
    topology's tiers and the backends: a closed set), else "other"; "none" if absent."""
    if value is None:
        return NO_TIER
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", errors="replace")
    return value if isinstance(value, str) and value in known else OTHER_TIER


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
        self.published_total = self._counter(
            "published", "Delayed messages published and confirmed by the broker.", "queue", "tier"
        )
        self.publish_errors_total = self._counter(
            "publish_errors", "Publishes that were not confirmed, by reason.", "queue", "reason"
        )
        self.handled_total = self._counter(
            "handled", "Deliveries handled by a worker, by outcome.", "queue", "outcome"
        )
        self.handler_seconds = self._histogram(
            "handler_seconds", "Time spent in the handler, seconds.", HANDLER_BUCKETS, "queue"
        )
        self.delivery_lateness_seconds = self._histogram(
            "delivery_lateness_seconds",
            "Time from a message's due time (rd-due-at) to its delivery to a worker, seconds, "
            "by queue and the tier (or cascade / plugin / now) it came through.",
            LATENESS_BUCKETS,
            "queue",
            "tier",
        )
        self.schedule_deviation_seconds = self._histogram(
            "schedule_deviation_seconds",
            "How much later a message was scheduled than asked: rd-due-at minus the due time "
            "asked for (rd-asked-due-at), seconds; the cascade's rounding up.",
            DEVIATION_BUCKETS,
            "queue",
            "tier",
        )
        self.reconcile_runs_total = self._counter(
            "reconcile_runs",
            "Reconciler runs by result: ok, or failed (the function raised, or a "
            "re-submission was not confirmed).",
            "name",
            "result",
        )
        self.reconcile_resubmitted_total = self._counter(
            "reconcile_resubmitted",
            "Messages re-submitted (and confirmed) by reconcilers: what should have fired "
            "and had not.",
            "name",
        )

        self.outbox_relayed_total = self._counter(
            "outbox_relayed",
            "Outbox rows published, confirmed and marked sent by a relay.",
            "queue",
            "tier",
        )
        self.outbox_relay_lag_seconds = self._histogram(
            "outbox_relay_lag_seconds",
            "Time from an outbox row's creation (application clock) to its confirm, seconds.",
            RELAY_LAG_BUCKETS,
            "queue",
        )
        self.outbox_refused_total = self._counter(
            "outbox_refused",
            "Outbox rows a relay could not publish (kept, tried again later), by reason.",
            "queue",
            "reason",
        )

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        """A counter `rabbit_delay_<name>_total{labels}` in this instance's registry."""
        return Counter(name, documentation, labels, namespace=NAMESPACE, registry=self.registry)

    def _histogram(
        self, name: str, documentation: str, buckets: Sequence[float], *labels: str
    ) -> Histogram:
        """A histogram `rabbit_delay_<name>{labels}` in this instance's registry."""
        return Histogram(
            name,
            documentation,
            labels,
            namespace=NAMESPACE,
            registry=self.registry,
            buckets=buckets,
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

    # -- reconcilers -----------------------------------------------------------------------

    def reconciled(self, name: str, ok: bool, resubmitted: int) -> None:
        """One run of reconciler `name` (a registered name: a closed set)."""
        self.reconcile_runs_total.labels(name=name, result="ok" if ok else "failed").inc()
        self.reconcile_resubmitted_total.labels(name=name).inc(resubmitted)

    # -- outbox relays ----------------------------------------------------------------------

    def relayed(self, queue: str, tier: str, lag_s: Sequence[float]) -> None:
        """Rows for `queue` (its routing key) were confirmed after `tier`, each
        `lag_s` after its creation (negative lags, clock skew, count as 0)."""
        self.outbox_relayed_total.labels(queue=queue, tier=tier).inc(len(lag_s))
        histogram = self.outbox_relay_lag_seconds.labels(queue=queue)
        for lag in lag_s:
            histogram.observe(max(lag, 0.0))

    def relay_refused(self, queue: str, reason: PublishErrorReason | BaseException) -> None:
        """A row for `queue` could not be published; pass the exception or a reason."""
        label = reason if isinstance(reason, PublishErrorReason) else error_reason(reason)
        self.outbox_refused_total.labels(queue=queue, reason=label.value).inc()


_default: Metrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> Metrics:
    """The process-wide instance in prometheus-client's global REGISTRY, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics(REGISTRY)
        return _default


__all__ = [
    "NO_TIER",
    "OTHER_TIER",
    "Metrics",
    "PublishErrorReason",
    "default_metrics",
    "deviation_s",
    "error_reason",
    "late_s",
    "tier_label",
]
