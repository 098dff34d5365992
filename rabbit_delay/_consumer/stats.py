"""What a worker counts and logs per action; shared by both workers so they read alike."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

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
    SkipReason,
)
from rabbit_delay._durations import format_ms
from rabbit_delay._envelope import text_header
from rabbit_delay._headers import H_ASKED_DUE_AT, H_DELAY_MS, H_DUE_AT, H_TIER
from rabbit_delay._observe.logs import delivery_fields
from rabbit_delay._topology.delays import CASCADE, IMMEDIATE, PLUGIN

if TYPE_CHECKING:
    from rabbit_delay._observe.metrics import Metrics

log = logging.getLogger("rabbit_delay.worker")


def worker_identity() -> str:
    """host:pid:random, the prefix of every idempotency owner token of one worker.

    An owner token is this plus a per-delivery counter: a claim is re-entrant for its
    owner, so two deliveries must never share one.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class WorkerStats:
    """Counters of one worker. Updated on the thread (or loop) that acks, so no lock."""

    received: int = 0
    acked: int = 0  # handler succeeded
    retried: int = 0  # another attempt: re-published through a tier, or requeued (backend broker)
    deferred: int = 0  # in progress elsewhere, or the store failed: re-published, same attempt
    parked: int = 0
    duplicates: int = 0  # already done: acked, not run
    cancelled: int = 0  # tombstoned: acked, not run
    requeued: int = 0  # nacked back: store failed (4.3+), unsent defer, not started at shutdown
    publish_failures: int = 0  # a retry/park publish failed: rejected to the broker's DLX
    stale: int = 0  # finished after its channel or consumer was lost: not acked (redelivered)
    reconnects: int = 0
    consumer_cancels: int = 0  # the broker cancelled a consumer (4.3 consumer timeout): re-consumed
    leases_lost: int = 0  # a running handler's claim could not be renewed: a copy may run twice

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def record(self, action: Action) -> None:
        if isinstance(action, Ack):
            self.acked += 1
        elif isinstance(action, Skip):
            if action.reason is SkipReason.DUPLICATE:
                self.duplicates += 1
            else:
                self.cancelled += 1
        elif isinstance(action, Republish):
            if action.reason is RepublishReason.RETRY:
                self.retried += 1
            else:
                self.deferred += 1
        elif isinstance(action, Park):
            self.parked += 1
        elif isinstance(action, BrokerRetry):
            self.retried += 1
        # Requeue: counted as `requeued` once the nack is written (Settled.requeued).


# What an action counts as in rabbit_delay_handled_total{outcome}: keyed by the reason of
# a Skip or Republish, else by the action's type. A requeue, or a copy re-published during
# a store outage, is no outcome: the message comes back.
_OUTCOME_OF: dict[object, str] = {
    Ack: "success",
    Park: "park",
    RepublishReason.RETRY: "retry",
    BrokerRetry: "retry",
    RepublishReason.DEFER: "in_progress",
    SkipReason.DUPLICATE: "duplicate",
    SkipReason.CANCELLED: "cancelled",
}


def _outcome_key(action: Action) -> object:
    return action.reason if isinstance(action, Skip | Republish) else type(action)


def outcome_of(action: Action) -> str | None:
    """The `outcome` label (rabbit_delay._observe.metrics.Outcome) of an action, or None for one
    that is no outcome (the message comes back)."""
    return _OUTCOME_OF.get(_outcome_key(action))


class WorkerMetrics:
    """Prometheus metrics of one worker (`rabbit_delay._observe.metrics`), label children resolved
    once per queue (and tier) so a delivery costs a few dictionary lookups.

    `tiers`: the topology's tier names, which with the backends (cascade, plugin, now)
    are the `tier` label values; any other rd-tier is counted as "other".
    """

    def __init__(self, metrics: Metrics, queues: Iterable[str], tiers: Iterable[str] = ()) -> None:
        from rabbit_delay._observe.metrics import Outcome

        self.metrics = metrics
        self._handled: dict[tuple[str, object], Any] = {}
        self._handler: dict[str, Any] = {}
        # (queue, tier label) -> (lateness child, deviation child), made on first use
        self._timing: dict[tuple[str, object], tuple[Any, Any]] = {}
        self._tiers = frozenset((*tiers, CASCADE, PLUGIN, IMMEDIATE))
        for queue in queues:
            for key, outcome in _OUTCOME_OF.items():
                child = metrics.handled_total.labels(queue=queue, outcome=Outcome(outcome).value)
                self._handled[(queue, key)] = child
            self._handler[queue] = metrics.handler_seconds.labels(queue=queue)

    def handled(self, queue: str, action: Action) -> None:
        """Count one delivery by outcome (a requeue, or a copy re-published during a store
        outage, is not an outcome: it comes back)."""
        child = self._handled.get((queue, _outcome_key(action)))
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
            from rabbit_delay._observe.metrics import tier_label

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
        late.observe(max(received_ms - due, 0) / 1000)
        asked = headers.get(H_ASKED_DUE_AT)
        if isinstance(asked, int) and not isinstance(asked, bool):
            deviation.observe(max(due - asked, 0) / 1000)


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


def log_consumer_cancelled(
    queue: str, queue_name: str, consumer_tag: str, broker: BrokerInfo, again: bool
) -> None:
    """The broker sent basic.cancel for one of our consumers (both workers log this)."""
    why = (
        "a delivery stayed unacked longer than the broker's consumer_timeout (a handler ran "
        "too long), or the queue was deleted"
        if broker.cancels_timed_out_quorum_consumers
        else "the queue was deleted, or its leader moved away"
    )
    log.warning(
        "%s: the broker cancelled the consumer of queue %s (consumer tag %s): %s. Its unacked "
        "messages go back to the queue; results of their running handlers are not acked; %s",
        queue,
        queue_name,
        consumer_tag,
        why,
        "consuming again" if again else "stopping anyway",
    )


def log_connection_lost(reason: str, queue_names: Iterable[str]) -> None:
    """The connection or the consuming channel is gone (`reason` already redacted)."""
    if is_consumer_timeout(reason):
        log.warning(
            "the broker closed the channel consuming %s: a delivery stayed unacked longer than "
            "the broker's consumer_timeout (a handler ran too long): %s. Its unacked messages go "
            "back to the queue; reconnecting and consuming again",
            ", ".join(queue_names),
            reason,
        )
    else:
        log.warning("connection lost (%s); reconnecting", reason)
