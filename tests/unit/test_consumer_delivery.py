"""The delivery program (`_consumer/delivery.py`) and its lease rules (`_consumer/leases.py`):
pure, no broker. Each test drives the program the way a worker does and checks the steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from rabbit_delay import App, ConfigError, PublishError, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._consumer.app import NOT_DECODED, scoped_key
from rabbit_delay._consumer.decide import (
    Ack,
    Park,
    ParkReason,
    Republish,
    RepublishReason,
    Requeue,
    Skip,
)
from rabbit_delay._consumer.delivery import (
    STALE,
    STOPPING,
    Claim,
    Delivery,
    Finish,
    Pause,
    Publish,
    Run,
    Settled,
    WriteAck,
    WriteReject,
    delivery_program,
)
from rabbit_delay._consumer.handlers import call_handler
from rabbit_delay._consumer.leases import LeaseBook, defer_delay_ms, renew_every_ms
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay.stores import ClaimResult, MemoryStore

NOW = 1_800_000_000_000
LEASE = 30_000
OWNER = "host:1:abc:1"
RABBITMQ_4_3 = BrokerInfo(version_text="4.3.6")


class Order(BaseModel):
    order_id: int


def make_app(*, delivery_limit: int = 3, exact: bool = False, **retry: Any) -> App:
    data: dict[str, Any] = {
        "namespace": "shop",
        "tiers": {"1s": "1s", "4s": "4s", "30s": "30s"},
        "queues": {
            "orders": {"delivery_limit": delivery_limit, "retry": retry or {}},
            "mail": {"bindings": ["order.paid"]},
        },
    }
    if exact:
        data["cascade"] = {"levels": 10, "resolution": "1s"}
    app = App(topology_from_dict(data), store=MemoryStore())
    app.add_consumer("orders", lambda msg, ctx: None, model=Order)
    return app


def delivery(
    redelivered: bool = False, body: bytes = b'{"order_id": 1}', **headers: Any
) -> Delivery:
    base: dict[str, Any] = {h.H_ATTEMPT: 1, h.H_TIER: "1s", h.H_DUE_AT: NOW - 5}
    return Delivery("m-1", {**base, **headers}, redelivered, body, "application/json", NOW)


def drive(
    app: App,
    d: Delivery,
    replies: Callable[[object], object],
    *,
    guarded: bool = True,
    broker: BrokerInfo = UNKNOWN,
) -> tuple[list[object], Settled]:
    """Run the program to its end, answering each step with `replies(step)`."""
    consumer = app.consumers["orders"]
    program = delivery_program(
        consumer,
        d,
        owner=OWNER if guarded else None,
        broker=broker,
        lease_ms=LEASE,
        clock=lambda: NOW,
    )
    steps: list[object] = []
    reply: object = None
    while True:
        try:
            step = program.send(reply)  # type: ignore[arg-type]
        except StopIteration as stop:
            return steps, stop.value
        steps.append(step)
        reply = replies(step)


def answer(claim: object = ClaimResult.CLAIMED, run: object = None, publish: object = None):
    def reply(step: object) -> object:
        if isinstance(step, Claim):
            return claim
        if isinstance(step, Run):
            return run
        if isinstance(step, Publish):
            return publish
        return None

    return reply


def kinds(steps: list[object]) -> list[str]:
    return [type(s).__name__ for s in steps]


def test_a_handled_delivery_claims_runs_records_done_then_acks() -> None:
    steps, settled = drive(make_app(), delivery(), answer())
    assert kinds(steps) == ["Claim", "Run", "Finish", "WriteAck"]
    claim, finish = steps[0], steps[2]
    assert isinstance(claim, Claim)
    assert claim.owner == OWNER
    assert claim.key.endswith(":m-1")
    assert isinstance(finish, Finish)
    assert finish.succeeded
    assert finish.key == claim.key
    assert isinstance(settled.action, Ack)
    assert settled.outcome is Outcome.ACKED


def test_without_a_guard_nothing_is_claimed() -> None:
    steps, settled = drive(make_app(), delivery(), answer(), guarded=False)
    assert kinds(steps) == ["Run", "WriteAck"]
    assert isinstance(settled.action, Ack)


def test_a_failure_releases_the_claim_then_publishes_the_retry_before_the_ack() -> None:
    steps, settled = drive(make_app(), delivery(), answer(run=ValueError("boom")))
    assert kinds(steps) == ["Claim", "Run", "Finish", "Publish", "WriteAck"]
    assert isinstance(steps[2], Finish)
    assert not steps[2].succeeded
    assert isinstance(settled.action, Republish)
    assert settled.action.reason is RepublishReason.RETRY
    assert steps[3].outgoing.headers[h.H_ATTEMPT] == 2  # type: ignore[attr-defined]


def test_a_retry_that_cannot_be_published_is_dead_lettered_not_acked() -> None:
    steps, settled = drive(
        make_app(), delivery(), answer(run=ValueError("boom"), publish=PublishError("nope"))
    )
    assert kinds(steps)[-1] == "WriteReject"
    assert steps[-1] == WriteReject(requeue=False)
    assert settled.publish_error == "nope"
    assert settled.outcome is Outcome.PARKED  # dead-lettered into the parking lot


def test_a_defer_that_cannot_be_published_is_handed_back() -> None:
    steps, settled = drive(
        make_app(), delivery(), answer(claim=ClaimResult.IN_PROGRESS, publish=PublishError("x"))
    )
    assert kinds(steps) == ["Claim", "Publish", "WriteNack"]
    assert settled.outcome is Outcome.REQUEUED
    assert isinstance(settled.action, Republish)
    assert settled.action.reason is RepublishReason.DEFER


@pytest.mark.parametrize("result", [ClaimResult.DONE, ClaimResult.CANCELLED])
def test_done_and_cancelled_keys_are_acked_without_running(result: ClaimResult) -> None:
    steps, settled = drive(make_app(), delivery(), answer(claim=result))
    assert kinds(steps) == ["Claim", "WriteAck"]
    assert isinstance(settled.action, Skip)


def test_deferrals_back_off_from_the_shortest_tier_capped_at_half_a_lease() -> None:
    assert [defer_delay_ms(n, 1_000, 30_000) for n in range(1, 8)] == [
        1_000,
        2_000,
        4_000,
        8_000,
        15_000,
        15_000,
        15_000,
    ]
    assert defer_delay_ms(1, 2_000, 1_000) == 2_000  # never below the shortest tier


@pytest.mark.parametrize(
    ("earlier", "exact", "delay_ms"),
    [
        (0, False, 1_000),  # first deferral: the shortest tier
        (1, False, 1_000),  # wants 2 s: the longest tier not above it is 1 s
        (2, False, 4_000),  # wants 4 s
        (6, False, 4_000),  # capped at 15 s: 4 s is the longest tier below
        (3, True, 8_000),  # a cascade gives the exact delay
        (9, True, 15_000),  # capped at half the lease
    ],
)
def test_a_held_key_defers_the_copy_with_backoff(earlier: int, exact: bool, delay_ms: int) -> None:
    headers = {h.H_DEFERRALS: earlier} if earlier else {}
    steps, settled = drive(
        make_app(exact=exact), delivery(**headers), answer(claim=ClaimResult.IN_PROGRESS)
    )
    assert kinds(steps) == ["Claim", "Publish", "WriteAck"]
    out = steps[1].outgoing  # type: ignore[attr-defined]
    assert out.headers[h.H_DEFERRALS] == earlier + 1
    assert out.headers[h.H_DELAY_MS] == delay_ms
    assert out.headers[h.H_ATTEMPT] == 1  # same attempt
    assert isinstance(settled.action, Republish)


def test_a_redelivery_finding_its_key_held_counts_as_a_crash_on_the_copy() -> None:
    steps, _ = drive(
        make_app(), delivery(redelivered=True, **{h.H_CRASHES: 1}), answer(ClaimResult.IN_PROGRESS)
    )
    out = steps[1].outgoing  # type: ignore[attr-defined]
    assert out.headers[h.H_CRASHES] == 2
    assert "x-delivery-count" not in out.headers


def test_a_crash_looping_message_is_parked_at_the_delivery_limit_under_the_guard() -> None:
    # Two lost deliveries on earlier copies, one more on this one: 3 = delivery_limit.
    d = delivery(redelivered=True, **{h.H_CRASHES: 2, h.H_DEFERRALS: 4})
    steps, settled = drive(make_app(delivery_limit=3), d, answer(claim=ClaimResult.IN_PROGRESS))
    assert kinds(steps) == ["Claim", "Publish", "WriteAck"]
    assert isinstance(settled.action, Park)
    assert settled.action.reason is ParkReason.CRASHED
    headers = steps[1].outgoing.headers  # type: ignore[attr-defined]
    assert headers[h.H_PARK_REASON] == "crashed"
    assert headers[h.H_CRASHES] == 3


def test_a_claimed_key_at_the_limit_is_released_and_parked_without_running() -> None:
    d = delivery(redelivered=True, **{"x-delivery-count": 1, h.H_CRASHES: 2})
    steps, settled = drive(make_app(delivery_limit=3), d, answer())
    assert kinds(steps) == ["Claim", "Finish", "Publish", "WriteAck"]
    assert isinstance(steps[1], Finish)
    assert not steps[1].succeeded
    assert isinstance(settled.action, Park)
    assert settled.action.reason is ParkReason.CRASHED


def test_without_the_guard_the_crash_count_parks_too() -> None:
    d = delivery(redelivered=True, **{"x-delivery-count": 3})
    steps, settled = drive(make_app(delivery_limit=3), d, answer(), guarded=False)
    assert kinds(steps) == ["Publish", "WriteAck"]
    assert isinstance(settled.action, Park)
    assert settled.action.reason is ParkReason.CRASHED


def test_below_the_limit_the_handler_runs_and_a_retry_carries_the_count() -> None:
    d = delivery(redelivered=True, **{"x-delivery-count": 1})
    steps, _ = drive(make_app(delivery_limit=3), d, answer(run=ValueError("x")))
    assert kinds(steps) == ["Claim", "Run", "Finish", "Publish", "WriteAck"]
    assert steps[3].outgoing.headers[h.H_CRASHES] == 1  # type: ignore[attr-defined]


def test_native_retries_are_not_counted_as_crashes() -> None:
    app = make_app(delivery_limit=4, backend="broker", min="1s", max="4s", max_attempts=4)
    d = delivery(redelivered=True, **{"x-delivery-count": 3})  # three failed attempts
    steps, settled = drive(app, d, answer())
    assert kinds(steps) == ["Claim", "Run", "Finish", "WriteAck"]
    assert isinstance(settled.action, Ack)


@pytest.mark.parametrize(
    ("redelivered", "headers", "expected"),
    [
        (False, {}, False),
        (True, {}, True),
        (False, {h.H_CRASHES: 1}, True),  # a copy of a crashed delivery
        (False, {h.H_DEFERRALS: 2}, True),  # put off behind a copy that since gave up the key
    ],
)
def test_ctx_redelivered_says_whether_the_handler_may_have_run(
    redelivered: bool, headers: dict[str, Any], expected: bool
) -> None:
    steps, _ = drive(make_app(), delivery(redelivered, **headers), answer())
    run = steps[1]
    assert isinstance(run, Run)
    assert run.prepared.ctx.redelivered is expected


def test_a_delivery_not_started_before_the_stop_is_handed_back() -> None:
    steps, settled = drive(
        make_app(), delivery(), lambda s: STOPPING if isinstance(s, Claim) else None
    )
    assert kinds(steps) == ["Claim", "WriteNack"]
    assert settled.action is None
    assert settled.outcome is Outcome.HANDED_BACK


def test_a_claimed_delivery_not_started_before_the_stop_releases_its_key() -> None:
    steps, settled = drive(make_app(), delivery(), answer(run=STOPPING))
    assert kinds(steps) == ["Claim", "Run", "Finish", "WriteNack"]
    assert isinstance(steps[2], Finish)
    assert not steps[2].succeeded
    assert settled.outcome is Outcome.HANDED_BACK


def test_a_stale_delivery_is_neither_run_nor_acked_but_its_claim_is_released() -> None:
    steps, settled = drive(make_app(), delivery(), answer(run=STALE))
    assert kinds(steps) == ["Claim", "Run", "Finish"]
    assert settled.stale
    assert settled.action is None


def test_a_stale_ack_is_reported_stale() -> None:
    steps, settled = drive(
        make_app(),
        delivery(),
        lambda s: (
            STALE
            if isinstance(s, WriteAck)
            else (ClaimResult.CLAIMED if isinstance(s, Claim) else None)
        ),
    )
    assert kinds(steps)[-1] == "WriteAck"
    assert settled.stale


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        (UNKNOWN, ["Claim", "Pause", "Publish", "WriteAck"]),
        (RABBITMQ_4_3, ["Claim", "Pause", "WriteNack"]),
    ],
)
def test_a_store_failure_pauses_then_keeps_the_message(
    broker: BrokerInfo, expected: list[str]
) -> None:
    steps, settled = drive(make_app(), delivery(), answer(claim=OSError("disk")), broker=broker)
    assert kinds(steps) == expected
    assert isinstance(steps[1], Pause)
    assert steps[1].seconds > 0
    if broker is RABBITMQ_4_3:
        assert isinstance(settled.action, Requeue)
        assert settled.outcome is Outcome.REQUEUED


def test_an_undecodable_body_is_decoded_where_the_handler_runs_then_parked() -> None:
    def reply(step: object) -> object:
        if isinstance(step, Claim):
            return ClaimResult.CLAIMED
        if isinstance(step, Run):  # what the workers run: decode, then the handler
            assert step.prepared.message is NOT_DECODED  # not on the connection thread
            return call_handler(step.consumer, step.prepared, None)
        return None

    steps, settled = drive(make_app(), delivery(body=b"not json"), reply)
    assert kinds(steps) == ["Claim", "Run", "Finish", "Publish", "WriteAck"]
    finish = steps[2]
    assert isinstance(finish, Finish)
    assert not finish.succeeded  # the key is released, not recorded done
    assert isinstance(settled.action, Park)
    assert settled.action.reason is ParkReason.DECODE_ERROR


def test_malformed_headers_are_parked_without_a_claim() -> None:
    steps, settled = drive(make_app(), delivery(**{h.H_ATTEMPT: "x"}), answer())
    assert kinds(steps) == ["Publish", "WriteAck"]
    assert isinstance(settled.action, Park)
    assert settled.action.reason is ParkReason.DECODE_ERROR


# -- the lease book -------------------------------------------------------------------------


def test_leases_are_renewed_every_third_and_a_lost_one_is_reported_once() -> None:
    book = LeaseBook(30_000)
    assert book.every_ms == renew_every_ms(30_000) == 10_000
    book.claimed("k1", "o1", ClaimResult.CLAIMED, 0)
    book.claimed("k2", "o2", ClaimResult.CLAIMED, 5_000)
    book.claimed("k3", "o3", ClaimResult.DONE, 5_000)  # not claimed: not held
    assert book.due(9_999) == []
    assert book.due(10_000) == [("k1", "o1")]
    assert book.renewed("o1", True, 10_000) is False
    assert book.due(15_000) == [("k2", "o2")]
    assert book.renewed("o2", False, 15_000) is True  # taken over: a second copy may run
    assert book.lost == 1
    assert book.due(40_000) == [("k1", "o1")]  # a lost lease is not renewed again
    assert book.drop("o2") is True
    assert book.drop("o1") is False
    assert book.renewed("o1", False, 50_000) is False  # finished meanwhile: not a loss
    assert len(book) == 0


# -- counting once ----------------------------------------------------------------------------


def test_each_delivery_is_counted_once_by_its_outcome() -> None:
    from rabbit_delay import Worker

    worker = Worker(make_app(), "amqp://guest:guest@127.0.0.1:1/", install_signal_handlers=False)
    report = worker.report
    report.settled(Settled("orders", "m-1", 1, Outcome.REQUEUED, Requeue("store down")))
    report.settled(Settled("orders", "m-2", 1, Outcome.HANDED_BACK, None))  # not started
    report.settled(Settled("orders", "m-3", 1, Outcome.STALE, Ack()))
    assert (worker.stats.requeued, worker.stats.handed_back, worker.stats.stale) == (1, 1, 1)
    assert worker.stats.acked == 0


def test_cancel_refuses_a_queue_whose_consumer_is_not_idempotent() -> None:
    app = make_app()
    app.add_consumer("mail", lambda msg: None, idempotent=False)
    with pytest.raises(ConfigError, match="idempotent=False"):
        app.cancel("m-1")
    with pytest.raises(ConfigError, match="'mail'"):
        app.cancel("m-1", queue="mail")
    app.cancel("m-1", queue="orders")  # the guarded queue still takes a tombstone
    key = scoped_key(app.topology, "orders", "m-1")
    assert app.guard().claim(key, "o") is ClaimResult.CANCELLED
