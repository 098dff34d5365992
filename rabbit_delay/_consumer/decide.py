"""The retry/park decision: what happens to a delivery after its result. Pure.

Both workers call `decide(...)` and execute the action it returns; no rule about
attempts, tiers, parking or headers is written anywhere else.

    result                           action
    -------------------------------  ---------------------------------------------------
    None (the handler returned)      Ack
    ClaimResult.DONE                 Skip(duplicate)     ack, handler not run
    ClaimResult.CANCELLED            Skip(cancelled)     ack, handler not run (tombstone,
                                                         or its schedule key cancelled)
    ClaimResult.SUPERSEDED           Skip(superseded)    ack, handler not run (a newer
                                                         generation of its key replaced it)
    ClaimResult.IN_PROGRESS          Republish(defer)    same attempt, after a delay that
                                     doubles per deferral from the shortest tier, capped at
                                     half a lease (_consumer/leases.py)
    Crashed (lost deliveries >=      Park(crashed)       handler not run again
    the queue's delivery_limit)
    Undecodable                      Park(decode_error | validation_error)
    Reject                           Park(rejected)
    Retry / any other exception      retry backend "tiers": Republish(retry) with
                                     attempt + 1; backend "broker": BrokerRetry
                                     (basic.reject(requeue=True), the queue delays it);
                                     after the queue's max_attempts, Park(max_attempts)
    Unavailable (store failure)      where the broker counts a nack-requeue towards the
                                     delivery limit (before 4.3, or unknown):
                                     Republish(store_unavailable), same attempt, shortest
                                     tier; from 4.3: Requeue (basic.nack(requeue=True))

Republish and Park are executed the same way: publish the prepared `Outgoing`
(confirmed; mandatory where the route allows) and only then ack the original.

The broker's version rules come in as a `BrokerInfo`, read once per connection by the
worker: no driver compares versions.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from pydantic import ValidationError

import rabbit_delay._headers as h
from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._consumer.control import Reject, Retry
from rabbit_delay._consumer.leases import defer_delay_ms
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay._envelope import (
    BINARY,
    Envelope,
    Outgoing,
    forward,
    outgoing,
    strip_broker_headers,
)
from rabbit_delay._errors import ConfigError, DelayError, UnknownTargetError
from rabbit_delay._idempotency.guard import ClaimResult
from rabbit_delay._topology.delays import Route, Router
from rabbit_delay._topology.model import DEFAULT_LEASE_MS, RetryBackend, Topology

# Header budget: AMQP headers travel in one frame (frame_max, 128 KiB by default).
MAX_ERROR_MESSAGE = 1_000
MAX_TRACEBACK = 4_000
TRUNCATED = "...(truncated)\n"


class ParkReason(StrEnum):
    """Why a message went to the parking lot (header rd-park-reason)."""

    MAX_ATTEMPTS = "max_attempts"  # failed on its last attempt
    REJECTED = "rejected"  # the handler raised Reject
    DECODE_ERROR = "decode_error"  # the body is not valid JSON (or not decodable at all)
    VALIDATION_ERROR = "validation_error"  # valid JSON that does not fit the model
    # Its deliveries were lost delivery_limit times while the handler may have run (the
    # worker died or lost its connection): a message that crashes every worker.
    CRASHED = "crashed"


class RepublishReason(StrEnum):
    RETRY = "retry"  # the handler failed; try again later
    DEFER = "defer"  # a copy is being handled right now; look again later
    # The idempotency store failed, on a broker that counts a nack-requeue towards the
    # delivery limit: a copy through the shortest tier, so an outage parks nothing.
    UNAVAILABLE = "store_unavailable"


# -- results ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Undecodable:
    """The body (or the project's headers) could not be turned into the handler's input."""

    reason: ParkReason
    error_type: str
    message: str

    @classmethod
    def from_exception(cls, exc: Exception) -> Undecodable:
        reason = ParkReason.VALIDATION_ERROR
        if isinstance(exc, ValidationError):
            if any(e["type"] == "json_invalid" for e in exc.errors()):
                reason = ParkReason.DECODE_ERROR
        else:
            reason = ParkReason.DECODE_ERROR
        return cls(reason, error_type_of(exc), str(exc))


@dataclass(frozen=True, slots=True)
class Crashed:
    """Deliveries of the message were lost `count` times while its handler may have run,
    reaching the queue's delivery limit: park it rather than crash another worker."""

    count: int


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The idempotency store failed: nothing is known, so the broker keeps the message."""

    error: BaseException


Result = None | ClaimResult | Undecodable | Unavailable | Crashed | BaseException


# -- actions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ack:
    """The handler succeeded: ack."""


@dataclass(frozen=True, slots=True)
class Skip:
    """Ack without running the handler: `reason` is the delivery's outcome, DUPLICATE (a
    copy was already handled), CANCELLED (app.cancel(key) left a tombstone, or its
    schedule key was cancelled) or SUPERSEDED (a newer generation of its key replaced it)."""

    reason: Outcome


@dataclass(frozen=True, slots=True)
class Republish:
    """Publish `outgoing` (a new copy through a delay), confirmed; then ack the original."""

    outgoing: Outgoing
    reason: RepublishReason
    attempt: int  # the attempt number the new copy carries
    error: str | None = None  # "Type: message" of the failure, for the log

    @property
    def requeue_if_unsent(self) -> bool:
        """When the copy cannot be published, hand the original back (nack) instead of
        dead-lettering it: a defer or a store outage is no fault of the message."""
        return self.reason is not RepublishReason.RETRY


@dataclass(frozen=True, slots=True)
class Park:
    """Publish `outgoing` to the parking exchange (confirmed, mandatory); then ack."""

    outgoing: Outgoing
    reason: ParkReason
    error: str


@dataclass(frozen=True, slots=True)
class BrokerRetry:
    """basic.reject(requeue=True), one delivery, on a queue with retry backend "broker":
    the quorum queue (RabbitMQ 4.3+ delayed retry) hands it out again after `delay_ms`;
    the reject counts towards its delivery limit, and the count is the attempt."""

    attempt: int  # the attempt number the redelivery will carry
    delay_ms: int  # what the broker waits: min(min x x-delivery-count, max)
    error: str  # "Type: message" of the failure, for the log


@dataclass(frozen=True, slots=True)
class Requeue:
    """basic.nack(requeue=True), one delivery: let the broker hand it out again at once.
    Counts towards a quorum queue's delivery limit before RabbitMQ 4.3, not from 4.3."""

    error: str


Action = Ack | Skip | Republish | Park | BrokerRetry | Requeue

ACK = Ack()
SKIP_DUPLICATE = Skip(Outcome.DUPLICATE)
SKIP_CANCELLED = Skip(Outcome.CANCELLED)
SKIP_SUPERSEDED = Skip(Outcome.SUPERSEDED)


# -- per-queue policy -------------------------------------------------------------------


class QueuePolicy:
    """A queue's retry policy resolved once into routes, so a failure costs no lookups.

    Every retry and defer route targets the queue's unique key (`names.queue_key`):
    the copy goes back to the queue that failed, never to every queue bound to the
    key the message was first published with.

    Raises ConfigError if a retry tier or backoff delay cannot reach the queue
    (a tier outside the queue's `tiers`, a delay no backend serves).
    """

    __slots__ = (
        "defer_route",
        "defer_tiers",
        "delivery_limit",
        "exact_delays",
        "key",
        "max_attempts",
        "native",
        "parking_exchange",
        "queue",
        "retry",
        "retry_routes",
        "router",
        "shortest_ms",
    )

    def __init__(self, topology: Topology, queue: str, router: Router | None = None) -> None:
        if queue not in topology.queues:
            known = ", ".join(sorted(topology.queues))
            raise ConfigError(
                f"queue {queue!r} is not in the topology {topology.names.prefix!r}; it has: {known}"
            )
        cfg = topology.queues[queue]
        names = topology.names
        self.router = router if router is not None else Router(topology)
        self.queue = queue
        self.key = names.queue_key(queue)
        self.parking_exchange = names.parking_exchange()
        self.max_attempts = cfg.retry.max_attempts
        self.delivery_limit = cfg.delivery_limit
        self.retry = cfg.retry
        # Backend "broker": a retry is a requeue of the same copy, delayed by the queue.
        self.native = cfg.retry.backend is RetryBackend.BROKER
        try:
            backoff = cfg.retry.backoff
            if backoff is not None:
                retries = range(1, max(cfg.retry.max_attempts, 2))
                self.retry_routes = tuple(
                    self.router.resolve(self.key, delay_ms=backoff.delay_ms(n)) for n in retries
                )
            shortest = topology.shortest_tier(queue)
            self.shortest_ms = topology.tiers[shortest]
            self.defer_route = self.router.resolve(self.key, tier=shortest)
            # Deferral backoff: exact delays where the topology has them, else the
            # longest accepted tier not above the wanted delay.
            self.exact_delays = topology.exact_delays
            self.defer_tiers = tuple(
                sorted(
                    (topology.tiers[t], self.router.resolve(self.key, tier=t))
                    for t in topology.accepted_tiers(queue)
                )
            )
            if backoff is None:
                tiers = topology.retry_tiers(queue)
                self.retry_routes = tuple(self.router.resolve(self.key, tier=t) for t in tiers)
        except (DelayError, UnknownTargetError) as exc:
            raise ConfigError(f"queues.{queue}.retry: {exc}") from None

    def deferral_route(self, deferrals: int, lease_ms: int) -> Route:
        """Where deferral number `deferrals` (1 = first) of a copy waits (see
        consumer/_lease.defer_delay_ms)."""
        wanted = defer_delay_ms(deferrals, self.shortest_ms, lease_ms)
        if wanted <= self.shortest_ms:
            return self.defer_route
        if self.exact_delays:
            return self.router.resolve(self.key, delay_ms=wanted)
        route = self.defer_route
        for ms, tier_route in self.defer_tiers:
            if ms > wanted:
                break
            route = tier_route
        return route

    def retry_route(self, retry_number: int) -> Route:
        """Route of retry `retry_number` (1 = first retry) through the tiers (or the
        cascade / plugin for a backoff); the last one repeats."""
        routes = self.retry_routes
        return routes[min(retry_number, len(routes)) - 1]

    def scheduled_route(self, retry_number: int) -> Route | None:
        """Where the policy sends retry `retry_number`; None: the broker delays it."""
        return None if self.native else self.retry_route(retry_number)

    def requested_route(self, signal: Retry, retry_number: int) -> tuple[Route | None, str | None]:
        """The route a `Retry(tier=..., delay=...)` asks for (a re-published copy, on
        either backend), or the scheduled one and why."""
        if signal.tier is None and signal.delay_ms is None:
            return self.scheduled_route(retry_number), None
        try:
            return self.router.resolve(self.key, tier=signal.tier, delay_ms=signal.delay_ms), None
        except (DelayError, UnknownTargetError) as exc:
            return self.scheduled_route(retry_number), f"requested retry delay refused ({exc})"

    def envelope(self, message_id: str | None, headers: Mapping[str, object] | None) -> Envelope:
        """A delivery's envelope, its attempt counted the way this queue retries.

        Backend "broker": a retry is the same copy requeued, so the attempt is rd-attempt
        (1, or what a re-published copy carries) plus the queue's x-delivery-count; a lost
        channel counts as an attempt too, as it does for the broker's delivery limit.
        Raises DecodeError for malformed headers.
        """
        env = Envelope.from_headers(message_id, headers)
        if self.native and env.delivery_count:
            return dataclasses.replace(env, attempt=env.attempt + env.delivery_count)
        return env

    def first_failure_ms(self, env: Envelope, now_ms: int) -> int:
        """When the message first failed, for a message whose headers do not say.

        Backend "broker": a requeue cannot carry headers, so it is derived from the
        delays the queue waited since (one per x-delivery-count): the latest the first
        failure can have been (the broker never redelivers early). Otherwise: now.
        """
        if not self.native or not env.delivery_count:
            return now_ms
        waited = sum(self.retry.broker_delay_ms(n) for n in range(1, env.delivery_count + 1))
        return now_ms - waited


# -- the decision -----------------------------------------------------------------------


def error_type_of(exc: BaseException) -> str:
    """`ValueError`, `myapp.errors.PaymentDeclined`; private module segments dropped
    (`pydantic_core._pydantic_core.ValidationError` -> `pydantic_core.ValidationError`)."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    public = [part for part in cls.__module__.split(".") if not part.startswith("_")]
    return ".".join((*public, cls.__qualname__))


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def _tail(text: str, limit: int) -> str:
    """The end of a traceback is where the error is: keep that."""
    return text if len(text) <= limit else TRUNCATED + text[len(text) - limit + len(TRUNCATED) :]


def format_traceback(exc: BaseException) -> str:
    return _tail("".join(traceback.format_exception(exc)), MAX_TRACEBACK)


def _carried_headers(env: Envelope, crashes: int, deferrals: int) -> dict[str, object]:
    """The delivery's headers for a new copy: the broker's stripped, the crash count
    (across copies) and the deferral count (of this attempt) set."""
    headers = strip_broker_headers(env.headers)
    for name, value in ((h.H_CRASHES, crashes), (h.H_DEFERRALS, deferrals)):
        if value > 0:
            headers[name] = value
        else:
            headers.pop(name, None)
    return headers


def _failure_headers(
    env: Envelope,
    policy: QueuePolicy,
    now_ms: int,
    error_type: str,
    message: str,
    crashes: int = 0,
) -> dict[str, object]:
    headers = _carried_headers(env, crashes, 0)
    if h.H_FIRST_FAILURE not in headers:
        headers[h.H_FIRST_FAILURE] = policy.first_failure_ms(env, now_ms)
    headers[h.H_LAST_FAILURE] = now_ms
    headers[h.H_ERROR_TYPE] = error_type
    headers[h.H_ERROR_MESSAGE] = _truncate(message, MAX_ERROR_MESSAGE)
    return headers


class _Parking(NamedTuple):
    """Why a delivery goes to the parking lot: rd-park-reason, and the error it carries."""

    reason: ParkReason
    error_type: str
    message: str
    trace: str | None = None


def _why_parked(
    env: Envelope, policy: QueuePolicy, result: Crashed | Undecodable | BaseException
) -> _Parking | None:
    """Why a failed delivery is parked rather than tried again; None: it is not."""
    if isinstance(result, Crashed):
        return _Parking(
            ParkReason.CRASHED,
            "rabbit_delay.Crashed",
            f"{result.count} deliveries of this message were lost while its handler may "
            f"have been running (delivery_limit {policy.delivery_limit}): the handler "
            "probably kills or hangs its worker",
        )
    if isinstance(result, Undecodable):
        return _Parking(result.reason, result.error_type, result.message)
    if isinstance(result, Reject):
        return _Parking(ParkReason.REJECTED, error_type_of(result), result.reason)
    if env.attempt >= policy.max_attempts:
        return _Parking(
            ParkReason.MAX_ATTEMPTS, error_type_of(result), str(result), format_traceback(result)
        )
    return None


def _park(
    env: Envelope,
    policy: QueuePolicy,
    why: _Parking,
    body: bytes,
    content_type: str | None,
    now_ms: int,
    crashes: int,
) -> Park:
    headers = _failure_headers(env, policy, now_ms, why.error_type, why.message, crashes)
    if why.trace:
        headers[h.H_ERROR_TRACEBACK] = why.trace
    headers[h.H_ORIGINAL_QUEUE] = policy.queue
    headers[h.H_ATTEMPT] = env.attempt
    headers[h.H_PARK_REASON] = why.reason.value
    out = forward(
        policy.parking_exchange,
        policy.key,
        body,
        content_type,
        env.message_id,
        headers,
        now_ms // 1000,
    )
    return Park(out, why.reason, f"{why.error_type}: {_truncate(why.message, 200)}")


def _same_attempt(
    env: Envelope,
    policy: QueuePolicy,
    reason: RepublishReason,
    body: bytes,
    content_type: str | None,
    now_ms: int,
    error: str | None = None,
    *,
    route: Route | None = None,
    crashes: int = 0,
    deferrals: int = 0,
) -> Republish:
    """A copy through `route` (default: the shortest tier) with the same attempt,
    message_id and headers (the broker's stripped): it comes back after that delay,
    uncounted by any broker."""
    headers = _carried_headers(env, crashes, deferrals)
    out = outgoing(
        route or policy.defer_route,
        body,
        content_type or BINARY,
        now_ms,
        env.message_id,
        headers,
        env.attempt,
    )
    return Republish(out, reason, env.attempt, error)


def decide(
    env: Envelope,
    policy: QueuePolicy,
    result: Result,
    *,
    body: bytes,
    content_type: str | None,
    now_ms: int,
    broker: BrokerInfo = UNKNOWN,
    crashes: int = 0,
    lease_ms: int = DEFAULT_LEASE_MS,
) -> Action:
    """The action for one delivery. See the module docstring for the table.

    `broker` is what the worker's connection said about the broker (its version rules);
    unknown takes the conservative side. `crashes` is the message's count of deliveries
    lost while its handler may have run (consumer/_lease.lost_deliveries), carried by
    every copy; `lease_ms` the guard's lease, which caps the deferral backoff.

    Raises ValueError for ClaimResult.CLAIMED, which is not an result (run the handler).
    """
    if result is None:
        return ACK
    if isinstance(result, ClaimResult):
        if result is ClaimResult.DONE:
            return SKIP_DUPLICATE
        if result is ClaimResult.CANCELLED:
            return SKIP_CANCELLED
        if result is ClaimResult.SUPERSEDED:
            return SKIP_SUPERSEDED
        if result is ClaimResult.IN_PROGRESS:
            # Not run beside the copy in progress, and not requeued (that spins, and on a
            # quorum queue every requeue counts towards x-delivery-limit): look again
            # later, same attempt, backing off per deferral up to half a lease. By then
            # the copy is done (this one is skipped) or its lease ran out (this one runs).
            deferrals = env.deferrals + 1
            return _same_attempt(
                env,
                policy,
                RepublishReason.DEFER,
                body,
                content_type,
                now_ms,
                route=policy.deferral_route(deferrals, lease_ms),
                crashes=crashes,
                deferrals=deferrals,
            )
        raise ValueError(f"{result!r} is not an result: run the handler")
    if isinstance(result, Unavailable):
        error = f"{error_type_of(result.error)}: {_truncate(str(result.error), 200)}"
        if not broker.nack_requeue_counts:
            return Requeue(error)  # 4.3+: a nack-requeue costs no delivery
        # Before 4.3 every requeue counts: an outage longer than the delivery limit would
        # have the broker dead-letter good messages. A copy through the shortest tier
        # (same attempt) waits the outage out uncounted, as a deferred duplicate does.
        return _same_attempt(
            env,
            policy,
            RepublishReason.UNAVAILABLE,
            body,
            content_type,
            now_ms,
            error,
            crashes=crashes,
            deferrals=env.deferrals,
        )
    why = _why_parked(env, policy, result)
    if why is not None:
        return _park(env, policy, why, body, content_type, now_ms, crashes)
    assert isinstance(result, BaseException)  # a Crashed or an Undecodable is parked
    error_type = error_type_of(result)
    message = str(result)
    note = None
    if isinstance(result, Retry):
        route, note = policy.requested_route(result, env.attempt)
    else:
        route = policy.scheduled_route(env.attempt)
    if note:
        message = f"{message}; {note}"
    summary = f"{error_type}: {_truncate(message, 200)}"
    if route is None:
        # The queue delays the requeued delivery itself; the reject raises its
        # x-delivery-count, which is what the next attempt is counted from.
        delay_ms = policy.retry.broker_delay_ms(env.delivery_count + 1)
        return BrokerRetry(env.attempt + 1, delay_ms, summary)
    headers = _failure_headers(env, policy, now_ms, error_type, message, crashes)
    out = outgoing(
        route, body, content_type or BINARY, now_ms, env.message_id, headers, env.attempt + 1
    )
    return Republish(out, RepublishReason.RETRY, env.attempt + 1, summary)
