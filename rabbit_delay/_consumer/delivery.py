"""The delivery program: every decision a worker makes about one delivery. Pure.

The three workers (sync, async, in-memory) drive this generator, the way the declarers
drive the declare program: it yields a step, the driver executes it and sends back the
reply, until the program returns what happened (`Settled`, with its `outcome`). The drivers
decide nothing: not whether to claim, what to publish, when to ack, reject or requeue,
what a failed publish means, nor what became of the delivery. The program logs nothing
either: a store failure it met is in `Settled.store_error`, reported with the rest.

    step                       the driver                         reply
    -------------------------  ---------------------------------  --------------------------
    Claim(key, owner, ref)     claims the key (asking the         ClaimResult, or the store's
                               schedule about `ref` in the same   exception
                               store call); keeps the lease
                               renewed until Finish
    Run(consumer, prepared)    decodes the body if not yet        None, its exception, or
                               (Consumer.decoded), calls the      Undecodable
                               handler
    Finish(key, owner, ok,     records done (ok) or releases      None, or the store's
           update)             the claim (the store's "finish"),  exception
                               with the schedule record's update;
                               stops renewing it
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
    Park,
    Republish,
    RepublishReason,
    Requeue,
    Result,
    Skip,
    Unavailable,
    Undecodable,
)
from rabbit_delay._consumer.leases import lost_deliveries, may_have_run
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay._envelope import Outgoing, text_header
from rabbit_delay._headers import H_DUE_AT, H_GENERATION, H_KEY, H_TIER
from rabbit_delay._idempotency.guard import ClaimResult
from rabbit_delay._schedule.records import Finished, Ref, Update
from rabbit_delay._schedule.rules import ref_of

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
    ref: Ref | None = None  # the delivery's schedule key and generation: asked in the claim


@dataclass(slots=True)
class Run:
    consumer: Consumer
    prepared: Prepared


@dataclass(slots=True)
class Finish:
    key: str
    owner: str
    succeeded: bool
    update: Update | None = None  # the schedule record's update, written with the finish


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

WRITE_ACK = WriteAck()
WRITE_NACK = WriteNack()


@dataclass(slots=True)
class Settled:
    """What became of one delivery, decided by the program: the workers count, log and
    trace exactly this, once (rabbit_delay._observe.report)."""

    queue: str
    message_id: str | None
    attempt: int
    outcome: Outcome
    action: Action | None  # what was decided; None: handed back before its handler started
    tier: str | None = None  # the tier it came through (rd-tier), for the log
    publish_error: str | None = None  # the copy could not be published (and why)
    # The idempotency store failed on the claim ("claim": the message was not run) or on
    # recording the handler's result ("finish": its result stands; a duplicate may run
    # again after the lease).
    store_error: BaseException | None = None
    store_error_on: str | None = None

    @property
    def stale(self) -> bool:
        """Its channel or consumer was gone: nothing was settled, the broker redelivers."""
        return self.outcome is Outcome.STALE


Program = Generator[Step, object, Settled]

# The outcome of an action whose copy (if any) was published and whose delivery was settled
# as the action says; a failed publish, a nack or a lost channel decide otherwise.
_OUTCOME_OF_ACTION: dict[object, Outcome] = {
    Ack: Outcome.ACKED,
    RepublishReason.RETRY: Outcome.RETRIED,
    RepublishReason.DEFER: Outcome.DEFERRED,
    RepublishReason.UNAVAILABLE: Outcome.DEFERRED,
    Park: Outcome.PARKED,
    BrokerRetry: Outcome.RETRIED,
    Requeue: Outcome.REQUEUED,
}


def outcome_of(action: Action) -> Outcome:
    """The outcome of `action` carried out as decided (see `_OUTCOME_OF_ACTION`)."""
    if isinstance(action, Skip):
        return action.reason
    key = action.reason if isinstance(action, Republish) else type(action)
    return _OUTCOME_OF_ACTION[key]


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
        tier = text_header((delivery.headers or {}).get(H_TIER))
        return (yield from _settle(consumer, delivery.message_id, 1, prepared, tier))
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
            action = consumer.decide(prepared, Crashed(crashes), now(), broker, crashes, lease_ms)
            return (yield from _settle(consumer, message_id, attempt, action, tier))
        ran = yield Run(consumer, prepared)
        if ran is STOPPING:
            return (yield from _hand_back(consumer, message_id, attempt, tier))
        if ran is STALE:
            return Settled(consumer.queue, message_id, attempt, Outcome.STALE, None, tier)
        action = consumer.decide(prepared, _result(ran), now(), broker, crashes, lease_ms)
        return (yield from _settle(consumer, message_id, attempt, action, tier))

    ref = _ref(consumer, delivery.headers, None if consumer.key is not None else message_id)
    claim = yield Claim(key, owner, ref)
    if claim is STALE:
        return Settled(consumer.queue, message_id, attempt, Outcome.STALE, None, tier)
    if claim is STOPPING:
        return (yield from _hand_back(consumer, message_id, attempt, tier))
    if isinstance(claim, Exception):
        yield Pause(STORE_PAUSE_S)  # back-pressure while the store fails
        crashes = lost_deliveries(env, delivery.redelivered, native=policy.native, held=False)
        action = consumer.decide(prepared, Unavailable(claim), now(), broker, crashes, lease_ms)
        settled = yield from _settle(consumer, message_id, attempt, action, tier)
        settled.store_error, settled.store_error_on = claim, "claim"
        return settled
    assert isinstance(claim, ClaimResult)
    held = claim is ClaimResult.IN_PROGRESS
    crashes = lost_deliveries(env, delivery.redelivered, native=policy.native, held=held)
    if claim is ClaimResult.CLAIMED:
        if crashes >= policy.delivery_limit:
            action = consumer.decide(prepared, Crashed(crashes), now(), broker, crashes, lease_ms)
            yield Finish(key, owner, False, _update(consumer, ref, action, now()))
            return (yield from _settle(consumer, message_id, attempt, action, tier))
        ran = yield Run(consumer, prepared)
        if ran is STOPPING or ran is STALE:  # not started: give the key back
            yield Finish(key, owner, False)
            if ran is STALE:
                return Settled(consumer.queue, message_id, attempt, Outcome.STALE, None, tier)
            return (yield from _hand_back(consumer, message_id, attempt, tier))
        result = _result(ran)
        action = consumer.decide(prepared, result, now(), broker, crashes, lease_ms)
        update = None if ref is None else _update(consumer, ref, action, now())
        stored = yield Finish(key, owner, result is None, update)
        if action is ACK:  # the common case, without a sub-generator
            reply = yield WRITE_ACK
            outcome = Outcome.STALE if reply is STALE else Outcome.ACKED
            settled = Settled(consumer.queue, message_id, attempt, outcome, action, tier)
        else:
            settled = yield from _settle(consumer, message_id, attempt, action, tier)
        if stored is not None:  # the handler's result stands; its record could not be kept
            settled.store_error = stored  # type: ignore[assignment]
            settled.store_error_on = "finish"
        return settled
    claimed: Result = claim
    if held and crashes >= policy.delivery_limit:
        claimed = Crashed(crashes)
    action = consumer.decide(prepared, claimed, now(), broker, crashes, lease_ms)
    return (yield from _settle(consumer, message_id, attempt, action, tier))


def _ref(
    consumer: Consumer, headers: Mapping[str, Any] | None, message_id: str | None
) -> Ref | None:
    """The schedule key and generation a delivery carries, if its consumer keeps the
    schedule (a topology with [schedule]) and the headers name them; with `message_id`
    when its guard key is made of it (the record may then hold the claim)."""
    keeping = consumer.schedule
    if keeping is None or not headers:
        return None
    return ref_of(keeping.scope, headers.get(H_KEY), headers.get(H_GENERATION), message_id)


def _update(consumer: Consumer, ref: Ref | None, action: Action, now_ms: int) -> Update | None:
    """What the result of a scheduled delivery does to its record: handled, parked (with
    the reason), or a retry due later (`rules.finish`)."""
    keeping = consumer.schedule
    if ref is None or keeping is None:
        return None
    if isinstance(action, Ack):
        return Update(ref, Finished.HANDLED, keeping.retention_ms)
    if isinstance(action, Park):
        return Update(
            ref, Finished.PARKED, keeping.retention_ms, f"{action.reason}: {action.error}"
        )
    if isinstance(action, Republish):
        due = action.outgoing.headers.get(H_DUE_AT)
        due_ms = int(due) if isinstance(due, int) else now_ms
    elif isinstance(action, BrokerRetry):
        due_ms = now_ms + action.delay_ms
    else:
        return None
    return Update(
        ref,
        Finished.RETRY,
        keeping.retention_ms,
        action.error,
        due_ms,
        due_ms + keeping.grace_ms,
    )


def _result(reply: object) -> Result:
    if reply is None or isinstance(reply, BaseException | Undecodable):
        return reply
    raise TypeError(f"a Run step's reply must be None or an exception, got {reply!r}")


def _hand_back(
    consumer: Consumer, message_id: str | None, attempt: int, tier: str | None
) -> Program:
    """Not started before the shutdown: nack it back for another worker, at once."""
    reply = yield WRITE_NACK
    outcome = Outcome.STALE if reply is STALE else Outcome.HANDED_BACK
    return Settled(consumer.queue, message_id, attempt, outcome, None, tier)


def _settle(
    consumer: Consumer, message_id: str | None, attempt: int, action: Action, tier: str | None
) -> Generator[Step, object, Settled]:
    """Execute `action` on the broker: ack, or publish the copy and only then ack, or
    hand the delivery back; the delivery's outcome is what was done."""
    publish_error: str | None = None
    outcome = outcome_of(action)
    if isinstance(action, Ack | Skip):
        reply = yield WRITE_ACK
    elif isinstance(action, Republish | Park):
        kind = "park" if isinstance(action, Park) else "republish"
        published = yield Publish(action.outgoing, kind)
        if published is STALE:
            return Settled(consumer.queue, message_id, attempt, Outcome.STALE, action, tier)
        if published is None:
            reply = yield WRITE_ACK  # only once the new copy is confirmed
        else:
            publish_error = str(published)
            if isinstance(action, Republish) and action.requeue_if_unsent:
                # A defer or a store outage is no fault of the message: hand it back.
                reply = yield WRITE_NACK
                outcome = Outcome.REQUEUED
            else:
                # The broker dead-letters it into the parking exchange (reason rejected):
                # visible, and no hot loop of redeliveries.
                reply = yield WriteReject(requeue=False)
                outcome = Outcome.PARKED
    elif isinstance(action, BrokerRetry):
        # Counted towards the delivery limit and held back by the queue (4.3+ delayed
        # retry); the count is the next attempt's number.
        reply = yield WriteReject(requeue=True)
    else:  # Requeue: the idempotency store failed (4.3+), or an unexpected error
        reply = yield WRITE_NACK
    if reply is STALE:
        outcome = Outcome.STALE
    return Settled(consumer.queue, message_id, attempt, outcome, action, tier, publish_error)
