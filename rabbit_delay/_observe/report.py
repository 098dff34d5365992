"""What a worker reports: its counters, its log lines and its metrics, from the events its
programs tell (`rabbit_delay._consumer.events.WorkerEvents`) and the outcome of every
delivery (`Settled.outcome`). Every worker (sync, async, in-memory) hands one in; nothing
else of a worker counts or logs what the core decided.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from rabbit_delay._broker import BrokerInfo, is_consumer_timeout
from rabbit_delay._consumer.decide import (
    Ack,
    Action,
    BrokerRetry,
    Park,
    ParkReason,
    Republish,
    RepublishReason,
    Skip,
)
from rabbit_delay._consumer.delivery import Settled
from rabbit_delay._consumer.handlers import Timer
from rabbit_delay._consumer.outcome import OUTCOMES, Outcome
from rabbit_delay._consumer.worker import WorkerCore
from rabbit_delay._durations import format_ms
from rabbit_delay._envelope import text_header
from rabbit_delay._headers import H_ASKED_DUE_AT, H_DELAY_MS, H_DUE_AT, H_TIER
from rabbit_delay._observe import tracing
from rabbit_delay._observe.logs import delivery_fields
from rabbit_delay._observe.metrics import Metrics, deviation_s, late_s, tier_label
from rabbit_delay._topology.delays import CASCADE, HELD, IMMEDIATE, PLUGIN
from rabbit_delay._urls import redact

log = logging.getLogger("rabbit_delay.worker")


@dataclass
class WorkerStats:
    """Counters of one worker: a delivery counted once, by its outcome (the names are the
    outcomes', rabbit_delay._consumer.outcome), plus what happened around the deliveries.
    Updated on the thread (or loop) that settles deliveries, so no lock."""

    received: int = 0
    acked: int = 0
    retried: int = 0
    deferred: int = 0
    parked: int = 0
    duplicate: int = 0
    cancelled: int = 0
    superseded: int = 0
    requeued: int = 0
    handed_back: int = 0
    stale: int = 0
    publish_failures: int = 0  # a retry/park copy could not be published
    store_failures: int = 0  # the idempotency store failed on a claim or a finish
    reconnects: int = 0
    consumer_cancels: int = 0  # the broker cancelled a consumer (4.3 consumer timeout): re-consumed
    leases_lost: int = 0  # a running handler's claim could not be renewed: a copy may run twice

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def count(self, outcome: Outcome) -> None:
        """One delivery more of `outcome`."""
        name = outcome.value
        setattr(self, name, getattr(self, name) + 1)


class WorkerMetrics:
    """Prometheus metrics of one worker (`rabbit_delay._observe.metrics`), label children resolved
    once per queue (and tier) so a delivery costs a few dictionary lookups.

    `tiers`: the topology's tier names, which with the backends (cascade, plugin, now)
    are the `tier` label values; any other rd-tier is counted as "other".
    """

    def __init__(self, metrics: Metrics, queues: Iterable[str], tiers: Iterable[str] = ()) -> None:
        self.metrics = metrics
        self._handled: dict[tuple[str, object], Any] = {}
        self._handler: dict[str, Any] = {}
        # (queue, tier label) -> (lateness child, deviation child), made on first use
        self._timing: dict[tuple[str, object], tuple[Any, Any]] = {}
        self._tiers = frozenset((*tiers, CASCADE, PLUGIN, HELD, IMMEDIATE))
        for queue in queues:
            for outcome in OUTCOMES:
                child = metrics.handled_total.labels(queue=queue, outcome=outcome.value)
                self._handled[(queue, outcome)] = child
            self._handler[queue] = metrics.handler_seconds.labels(queue=queue)

    def handled(self, queue: str, outcome: Outcome) -> None:
        """Count one delivery by its outcome (a delivery handed straight back to its queue,
        requeued, handed back or stale, is not counted here: it comes back)."""
        child = self._handled.get((queue, outcome))
        if child is not None:
            child.inc()

    def handler_time(self, queue: str, seconds: float) -> None:
        self._handler[queue].observe(seconds)

    def delivered(self, queue: str, headers: Mapping[str, object] | None, received_ms: int) -> None:
        """One delivery received: its lateness (receipt - rd-due-at) and its schedule's
        deviation (rd-due-at - rd-asked-due-at), by queue and tier. Nothing for a message
        without rd-due-at; early deliveries (clock skew) count as 0."""
        if not headers:
            return
        due = headers.get(H_DUE_AT)
        # pika decodes 64-bit integers as its own int subclass (`long`)
        if not isinstance(due, int) or isinstance(due, bool):
            return
        tier = headers.get(H_TIER)
        if tier.__class__ is not str or tier not in self._tiers:
            # a closed set of keys too: "none", "other", or a bytes value decoded
            tier = tier_label(tier, self._tiers)
        key = (queue, tier)
        children = self._timing.get(key)
        if children is None:
            m = self.metrics
            children = self._timing[key] = (
                m.delivery_lateness_seconds.labels(queue=queue, tier=tier),
                m.schedule_deviation_seconds.labels(queue=queue, tier=tier),
            )
        late, deviation = children
        late.observe(late_s(due, received_ms))
        asked = headers.get(H_ASKED_DUE_AT)
        if isinstance(asked, int) and not isinstance(asked, bool):
            deviation.observe(deviation_s(due, asked))


# Skips worth a line each: a message dropped on purpose, never run.
_DROPPED = {
    Outcome.CANCELLED: "its key was cancelled",
    Outcome.SUPERSEDED: "a newer generation of its schedule key replaced it",
}


def log_action(
    queue: str, message_id: str | None, attempt: int, action: Action, tier: str | None = None
) -> None:
    """debug per message, info per retry/park, warning per error. Every record carries
    the delivery's fields (rabbit_delay._observe.logs: `--log-format json` shows them)."""
    if isinstance(action, Ack):
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %s handled (attempt %d), acked",
                queue,
                message_id,
                attempt,
                extra=delivery_fields(queue, message_id, attempt, tier),
            )
    elif isinstance(action, Skip) and action.reason in _DROPPED:
        log.info(
            "%s: %s dropped, not run (%s: %s)",
            queue,
            message_id,
            action.reason.value,
            _DROPPED[action.reason],
            extra=delivery_fields(queue, message_id, attempt, tier),
        )
    elif isinstance(action, Skip):
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %s skipped (%s), acked",
                queue,
                message_id,
                action.reason.value,
                extra=delivery_fields(queue, message_id, attempt, tier),
            )
    elif isinstance(action, Republish):
        out = action.outgoing
        next_tier = text_header(out.headers.get(H_TIER))
        about = delivery_fields(queue, message_id, attempt, tier, next_tier)
        if action.reason is RepublishReason.RETRY:
            _failed(queue, message_id, attempt, action.error, about)
            delay = out.headers.get(H_DELAY_MS)
            log.info(
                "%s: %s will be retried as attempt %d after %s (%s)",
                queue,
                message_id,
                action.attempt,
                next_tier,
                format_ms(int(str(delay))) if delay is not None else "?",
                extra=about,
            )
        elif action.reason is RepublishReason.UNAVAILABLE:
            log.warning(
                "%s: %s not handled, the idempotency store failed (%s); looking again after %s "
                "(re-published, same attempt: this broker would count a requeue)",
                queue,
                message_id,
                action.error,
                next_tier,
                extra=about,
            )
        else:
            log.info(
                "%s: %s is being handled elsewhere; looking again after %s",
                queue,
                message_id,
                next_tier,
                extra=about,
            )
    elif isinstance(action, Park):
        about = delivery_fields(queue, message_id, attempt, tier)
        if action.reason is ParkReason.MAX_ATTEMPTS:
            _failed(queue, message_id, attempt, action.error, about)
        log.info(
            "%s: %s parked via %s (%s): %s",
            queue,
            message_id,
            action.outgoing.exchange,
            action.reason.value,
            action.error,
            extra=about,
        )
    elif isinstance(action, BrokerRetry):
        about = delivery_fields(queue, message_id, attempt, tier)
        _failed(queue, message_id, attempt, action.error, about)
        log.info(
            "%s: %s requeued; the broker retries it as attempt %d after %s",
            queue,
            message_id,
            action.attempt,
            format_ms(action.delay_ms),
            extra=about,
        )
    else:
        log.warning(
            "%s: %s requeued: %s",
            queue,
            message_id,
            action.error,
            extra=delivery_fields(queue, message_id, attempt, tier),
        )


def _failed(
    queue: str, message_id: str | None, attempt: int, error: object, about: dict[str, Any]
) -> None:
    log.warning("%s: %s failed on attempt %d: %s", queue, message_id, attempt, error, extra=about)


class WorkerReport:
    """The report of one worker (`WorkerCore.report`): `stats` always, Prometheus metrics
    when the worker was given a `Metrics`, log lines on the `rabbit_delay.worker` logger."""

    def __init__(self, worker: WorkerCore, metrics: Metrics | None) -> None:
        self._worker = worker
        self.stats = WorkerStats()
        self.metrics = (
            WorkerMetrics(metrics, [c.queue for c in worker.consumers], worker.app.topology.tiers)
            if metrics is not None
            else None
        )

    @property
    def timer(self) -> Timer | None:
        return self.metrics.handler_time if self.metrics is not None else None

    # -- deliveries ---------------------------------------------------------------------------

    def arrived(self) -> None:
        self.stats.received += 1

    def received(self, queue: str, headers: Mapping[str, object] | None, received_ms: int) -> None:
        if self.metrics is not None:  # lateness and schedule deviation, once per delivery
            self.metrics.delivered(queue, headers, received_ms)

    def settled(self, settled: Settled) -> None:
        """Count and log what became of one delivery: every counter once, here only."""
        stats = self.stats
        outcome = settled.outcome
        stats.count(outcome)
        if settled.store_error is not None:
            stats.store_failures += 1
            _store_failed(settled)
        action = settled.action
        if outcome is Outcome.STALE or action is None:
            return
        log_action(settled.queue, settled.message_id, settled.attempt, action, settled.tier)
        if self.metrics is not None:
            self.metrics.handled(settled.queue, outcome)
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

    # -- the connection -----------------------------------------------------------------------

    def consuming(self, url: str) -> None:
        worker = self._worker
        log.info(
            "worker %s consuming %s on %s (prefetch %d, concurrency %d)",
            worker.identity,
            ", ".join(c.queue for c in worker.consumers),
            redact(url),
            worker.prefetch,
            worker.concurrency,
        )

    def connection_lost(self, reason: str) -> None:
        """The connection or the consuming channel is gone (`reason` already redacted)."""
        self.stats.reconnects += 1
        if is_consumer_timeout(reason):
            log.warning(
                "the broker closed the channel consuming %s: a delivery stayed unacked longer "
                "than the broker's consumer_timeout (a handler ran too long): %s. Its unacked "
                "messages go back to the queue; reconnecting and consuming again",
                ", ".join(self._worker.queue_names()),
                reason,
            )
        else:
            log.warning("connection lost (%s); reconnecting", reason)

    def connection_lost_at_stop(self, reason: str) -> None:
        log.warning("connection lost during shutdown (%s)", reason)

    def reconnect_failed(self, why: str, delay_s: float, urls: int) -> None:
        log.warning(
            "reconnect failed (%s); next try in %.1fs%s",
            redact(why),
            delay_s,
            "" if urls == 1 else f" (of {urls} broker URLs)",
        )

    def reconnected(self, url: str) -> None:
        log.info("reconnected to %s", redact(url))

    def consumer_cancelled(
        self, queue: str, queue_name: str, tag: str, broker: BrokerInfo, again: bool
    ) -> None:
        """The broker sent basic.cancel for one of our consumers."""
        self.stats.consumer_cancels += 1
        why = (
            "a delivery stayed unacked longer than the broker's consumer_timeout (a handler "
            "ran too long), or the queue was deleted"
            if broker.cancels_timed_out_quorum_consumers
            else "the queue was deleted, or its leader moved away"
        )
        log.warning(
            "%s: the broker cancelled the consumer of queue %s (consumer tag %s): %s. Its "
            "unacked messages go back to the queue; results of their running handlers are not "
            "acked; %s",
            queue,
            queue_name,
            tag,
            why,
            "consuming again" if again else "stopping anyway",
        )

    def consuming_again(self, queue: str, tag: str) -> None:
        log.info("%s: consuming again (consumer tag %s)", queue, tag)

    # -- stopping ----------------------------------------------------------------------------

    def stop_begins(self, signal_name: str | None, forced: bool) -> None:
        if signal_name is None:
            return
        if forced:
            log.warning("signal %s again: stopping now, abandoning running handlers", signal_name)
            return
        log.info(
            "signal %s: stopping (in-flight handlers get %.0fs; %s again stops at once)",
            signal_name,
            self._worker.shutdown_timeout,
            signal_name,
        )

    def shutdown_timeout(self, unsettled: int, forced: bool) -> None:
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
            self._worker.shutdown_timeout,
            unsettled,
        )

    def still_running(self, running: int) -> None:
        log.warning(
            "waiting for %d running handler(s) to finish (SIGINT/SIGTERM again to abandon "
            "them: their messages run again after the lease)",
            running,
        )

    def stopped(self) -> None:
        """The last line of a worker that consumed; one that never started has said why
        in the exception its run() raised."""
        log.info("worker %s stopped: %s", self._worker.identity, self.stats.as_dict())

    # -- leases and the store --------------------------------------------------------------

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

    def renewal_failed(self, key: str, error: BaseException) -> None:
        log.warning("lease renewal of %s failed: %r", key, error)

    def purge_failed(self, error: BaseException) -> None:
        log.warning("idempotency purge failed: %r", error)


class ReportingWorker(WorkerCore):
    """What every transport's worker is: a WorkerCore that reports through a
    WorkerReport and traces its deliveries with OpenTelemetry where the application
    uses it (rabbit_delay._observe.tracing)."""

    report: WorkerReport

    def make_report(self, metrics: Metrics | None) -> WorkerReport:
        return WorkerReport(self, metrics)

    def tracer(self) -> tracing.OpenTelemetry | None:
        return tracing.active()


def _store_failed(settled: Settled) -> None:
    fields_ = delivery_fields(settled.queue, settled.message_id, settled.attempt, settled.tier)
    if settled.store_error_on == "claim":
        log.error(
            "%s: idempotency store failed on claim: %r",
            settled.queue,
            settled.store_error,
            extra=fields_,
        )
    else:  # the handler's outcome stands; a duplicate may run again after the lease
        log.error(
            "%s: idempotency store failed after the handler: %r",
            settled.queue,
            settled.store_error,
            extra=fields_,
        )


__all__ = ["ReportingWorker", "WorkerMetrics", "WorkerReport", "WorkerStats", "log_action"]
