"""The delivery program: every decision a worker makes about one delivery. Pure.

Both workers drive this generator, the way the declarers drive `plan.declare_program`:
it yields a step, the driver executes it and sends back the reply, until the program
returns what happened (`Settled`). The drivers decide nothing: not whether to claim,
what to publish, when to ack, reject or requeue, nor what a failed publish means.

    step                       the driver                         reply
    -------------------------  ---------------------------------  --------------------------
    Claim(key, owner)          claims the key; keeps the lease    ClaimResult, or the store's
                               renewed until Finish               exception
    Run(consumer, prepared)    decodes the body if not yet        None, its exception, or
                               (Consumer.decoded), calls the      Undecodable
                               handler
    Finish(key, owner, ok)     records done (ok) or releases      None, or the store's
                               the claim; stops renewing it       exception
    Pause(seconds)             waits (the store is failing)       None
    Publish(outgoing)          publishes, confirmed               None, or the PublishError /
                                                                  BrokerError
    WriteAck / WriteNack /     basic.ack / basic.nack(requeue) /  None
    WriteReject(requeue)       basic.reject on the delivery's
                               channel

To any step but Finish, a driver may reply STALE (the delivery's channel or consumer is
gone: the broker redelivers it, so nothing may be acked or copied) or STOPPING (the
worker is shutting down and the handler has not started: hand it back). Finish is always
executed: the handler did run, and its result must be recorded.

Under the guard the sync worker runs every step but Run on its connection thread, so
the claims (and finishes) of a prefetched batch go to the store together; the async
worker runs each program in a task of its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rabbit_delay._broker import BrokerInfo
from rabbit_delay._consumer.app import Consumer, Prepared
from rabbit_delay._consumer.decide import (
    ACK,
    Ack,
    Action,
    BrokerRetry,
    Crashed,
    Outcome,
    Park,
    Republish,
    Skip,
    Unavailable,
    Undecodable,
)
from rabbit_delay._consumer.leases import lost_deliveries, may_have_run
from rabbit_delay._envelope import Outgoing, text_header
from rabbit_delay._headers import H_TIER
from rabbit_delay._idempotency.guard import ClaimResult
from rabbit_delay._observe.logs import delivery_fields

log = logging.getLogger("rabbit_delay.worker")

STORE_PAUSE_S = 1.0  # back-pressure when the idempotency store fails


class Signal(Enum):
    """Replies that are not results: the delivery can no longer be settled, or the
    worker is stopping before its handler started."""

    STALE = "stale"
    STOPPING = "stopping"


STALE = Signal.STALE
STOPPING = Signal.STOPPING


@dataclass(slots=True)
class Delivery:
    """One delivery as the broker handed it out (the transport's fields copied)."""

    message_id: str | None
    headers: Mapping[str, Any] | None
    redelivered: bool
    body: bytes
    content_type: str | None
    received_ms: int


# -- steps ------------------------------------------------------------------------------


@dataclass(slots=True)
class Claim:
    key: str
    owner: str


@dataclass(slots=True)
class Run:
    consumer: Consumer
    prepared: Prepared


@dataclass(slots=True)
class Finish:
    key: str
    owner: str
    succeeded: bool


@dataclass(slots=True)
class Pause:
    seconds: float


@dataclass(slots=True)
class Publish:
    outgoing: Outgoing
    kind: str  # "republish" or "park", for the log


@dataclass(slots=True)
class WriteAck:
    pass


@dataclass(slots=True)
class WriteNack:
    """basic.nack(requeue=True): from RabbitMQ 4.3 it does not count towards a quorum
    queue's delivery limit (a reject does)."""


@dataclass(slots=True)
class WriteReject:
    requeue: bool


# Plain (not frozen) slotted records: a frozen dataclass sets each field through
# object.__setattr__, a cost paid several times per delivery on the hot path.
Step = Claim | Run | Finish | Pause | Publish | WriteAck | WriteNack | WriteReject
SettleStep = Publish | WriteAck | WriteNack | WriteReject

WRITE_ACK = WriteAck()
WRITE_NACK = WriteNack()


@dataclass(slots=True)
class Settled:
    """What became of one delivery: the workers count and log exactly this, once."""

    queue: str
    message_id: str | None
    attempt: int
    action: Action | None  # None: handed back before its handler started
    tier: str | None = None  # the tier it came through (rd-tier), for the log
    stale: bool = False  # its channel or consumer was gone: the broker redelivers it
    requeued: bool = False  # nacked back to the queue
    publish_error: str | None = None  # the copy could not be published (and why)


Program = Generator[Step, object, Settled]


def delivery_program(
    consumer: Consumer,
    delivery: Delivery,
    *,
    owner: str | None,
    broker: BrokerInfo,
    lease_ms: int,
    clock: Callable[[], int],
) -> Program:
    """The steps of one delivery. `owner` is the idempotency owner token of this
    delivery (None: the worker runs without a guard)."""
    # Hot path: a few objects per delivery (no closures, no copies), because every
    # delivery in flight keeps its program alive and the garbage collector counts them.
    prepared = consumer.prepare(
        delivery.message_id,
        delivery.headers,
        delivery.redelivered,
        delivery.body,
        delivery.content_type,
        delivery.received_ms,
        lazy=True,  # decoded where the handler runs (Run), unless the key needs it
    )
    if not isinstance(prepared, Prepared):  # undecodable: parked without a claim
        return (
            yield from _settle(
                consumer,
                delivery.message_id,
                1,
                prepared,
                text_header((delivery.headers or {}).get(H_TIER)),
            )
        )
    env = prepared.ctx.envelope
    policy = consumer.policy
    if not prepared.ctx.redelivered and may_have_run(env, delivery.redelivered):
        ctx = dataclasses.replace(prepared.ctx, redelivered=True)
        prepared = dataclasses.replace(prepared, ctx=ctx)
    message_id, attempt, tier = env.message_id, env.attempt, env.tier
    now = clock

    key = prepared.key if owner is not None else None
    if key is None or owner is None:  # no guard: the broker's counts are all there is
        crashes = lost_deliveries(env, delivery.redelivered, native=policy.native, held=False)
        if crashes >= policy.delivery_limit:
            action = consumer.finish(prepared, Crashed(crashes), now(), broker, crashes, lease_ms)
            return (yield from _settle(consumer, message_id, attempt, action, tier))
        outcome = yield Run(consumer, prepared)
        if outcome is STOPPING:
            return (yield from _hand_back(consumer, message_id, attempt, tier))
        if outcome is STALE:
            return Settled(consumer.queue, message_id, attempt, None, tier=tier, stale=True)
        action = consumer.finish(prepared, _outcome(outcome), now(), broker, crashes, lease_ms)
        return (yield from _settle(consumer, message_id, attempt, action, tier))

    claim = yield Claim(key, owner)
    if claim is STALE:
        return Settled(consumer.queue, message_id, attempt, None, tier=tier, stale=True)
    if claim is STOPPING:
        return (yield from _hand_back(consumer, message_id, attempt, tier))
    if isinstance(claim, Exception):
        log.error(
            "%s: idempotency store failed on claim: %r",
            consumer.queue,
            claim,
            extra=delivery_fields(consumer.queue, message_id, attempt, tier),
        )
        yield Pause(STORE_PAUSE_S)
        crashes = lost_deliveries(env, delivery.redelivered, native=policy.native, held=False)
        action = consumer.finish(prepared, Unavailable(claim), now(), broker, crashes, lease_ms)
        return (yield from _settle(consumer, message_id, attempt, action, tier))
    assert isinstance(claim, ClaimResult)
    held = claim is ClaimResult.IN_PROGRESS
    crashes = lost_deliveries(env, delivery.redelivered, native=policy.native, held=held)
    if claim is ClaimResult.CLAIMED:
        if crashes >= policy.delivery_limit:
            yield Finish(key, owner, False)
            action = consumer.finish(prepared, Crashed(crashes), now(), broker, crashes, lease_ms)
            return (yield from _settle(consumer, message_id, attempt, action, tier))
        outcome = yield Run(consumer, prepared)
        if outcome is STOPPING or outcome is STALE:  # not started: give the key back
            yield Finish(key, owner, False)
            if outcome is STALE:
                return Settled(consumer.queue, message_id, attempt, None, tier=tier, stale=True)
            return (yield from _hand_back(consumer, message_id, attempt, tier))
        result = _outcome(outcome)
        stored = yield Finish(key, owner, result is None)
        if stored is not None:
            # The handler's outcome stands; a duplicate may run again after the lease.
            log.error(
                "%s: idempotency store failed after the handler: %r",
                consumer.queue,
                stored,
                extra=delivery_fields(consumer.queue, message_id, attempt, tier),
            )
        action = consumer.finish(prepared, result, now(), broker, crashes, lease_ms)
        if action is ACK:  # the common case, without a sub-generator
            reply = yield WRITE_ACK
            return Settled(
                consumer.queue, message_id, attempt, action, tier=tier, stale=reply is STALE
            )
        return (yield from _settle(consumer, message_id, attempt, action, tier))
    outcome_of_claim: Outcome = claim
    if held and crashes >= policy.delivery_limit:
        outcome_of_claim = Crashed(crashes)
    action = consumer.finish(prepared, outcome_of_claim, now(), broker, crashes, lease_ms)
    return (yield from _settle(consumer, message_id, attempt, action, tier))


def _outcome(reply: object) -> Outcome:
    if reply is None or isinstance(reply, BaseException | Undecodable):
        return reply
    raise TypeError(f"a Run step's reply must be None or an exception, got {reply!r}")


def _hand_back(
    consumer: Consumer, message_id: str | None, attempt: int, tier: str | None
) -> Program:
    """Not started before the shutdown: nack it back for another worker, at once."""
    reply = yield WRITE_NACK
    stale = reply is STALE
    return Settled(
        consumer.queue, message_id, attempt, None, tier=tier, stale=stale, requeued=not stale
    )


def _settle(
    consumer: Consumer, message_id: str | None, attempt: int, action: Action, tier: str | None
) -> Generator[Step, object, Settled]:
    """Execute `action` on the broker: ack, or publish the copy and only then ack, or
    hand the delivery back."""
    publish_error: str | None = None
    requeued = False
    if isinstance(action, Ack | Skip):
        reply = yield WRITE_ACK
    elif isinstance(action, Republish | Park):
        kind = "park" if isinstance(action, Park) else "republish"
        published = yield Publish(action.outgoing, kind)
        if published is STALE:
            return Settled(consumer.queue, message_id, attempt, action, tier=tier, stale=True)
        if published is None:
            reply = yield WRITE_ACK  # only once the new copy is confirmed
        else:
            publish_error = str(published)
            if isinstance(action, Republish) and action.requeue_if_unsent:
                # A defer or a store outage is no fault of the message: hand it back.
                reply = yield WRITE_NACK
                requeued = True
            else:
                # The broker dead-letters it into the parking exchange (reason rejected):
                # visible, and no hot loop of redeliveries.
                reply = yield WriteReject(requeue=False)
    elif isinstance(action, BrokerRetry):
        # Counted towards the delivery limit and held back by the queue (4.3+ delayed
        # retry); the count is the next attempt's number.
        reply = yield WriteReject(requeue=True)
    else:  # Requeue: the idempotency store failed (4.3+), or an unexpected error
        reply = yield WRITE_NACK
        requeued = True
    stale = reply is STALE
    return Settled(
        consumer.queue,
        message_id,
        attempt,
        action,
        tier=tier,
        stale=stale,
        requeued=requeued and not stale,
        publish_error=publish_error,
    )
