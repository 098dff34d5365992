"""The pure side of replay: which headers go, where each copy is published."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from rabbit_delay import DelayError, Topology, UnknownTargetError, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._envelope import BINARY, JSON, strip_broker_headers
from rabbit_delay._ops.replay.rules import (
    IMMEDIATE,
    Leave,
    ParkedReplay,
    Reroute,
    UnroutableReplay,
    replay_headers,
    resolve_queue,
)
from rabbit_delay._ops.stored import Stored

NOW = 1_800_000_000_000


@pytest.fixture
def topology() -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "5m": "5m"},
            "queues": {
                "orders.cancel": {},
                "push": {"bindings": ["push.any"], "tiers": ["5m"]},
            },
        }
    )


def parked_headers(**extra: Any) -> dict[str, object]:
    return {
        h.H_ATTEMPT: 3,
        h.H_DUE_AT: NOW - 60_000,
        h.H_DELAY_MS: 1000,
        h.H_TIER: "1s",
        h.H_TARGET: "shop.v1.q.orders.cancel",
        h.H_ERROR_TYPE: "ValueError",
        h.H_ERROR_MESSAGE: "boom",
        h.H_ERROR_TRACEBACK: "Traceback ...",
        h.H_ORIGINAL_QUEUE: "orders.cancel",
        h.H_FIRST_FAILURE: NOW - 50_000,
        h.H_LAST_FAILURE: NOW - 40_000,
        h.H_PARK_REASON: "max_attempts",
        "x-death": [{"queue": "shop.v1.q.orders.cancel", "reason": "rejected", "count": 1}],
        "x-first-death-queue": "shop.v1.q.orders.cancel",
        "x-last-death-reason": "rejected",
        "x-delivery-count": 2,
        "tenant": "acme",
        "trace-id": b"abc",
        **extra,
    }


def parked(**fields: Any) -> Stored:
    base: dict[str, Any] = {
        "body": b'{"order_id": 42}',
        "message_id": "m-1",
        "content_type": JSON,
        "headers": parked_headers(),
        "exchange": "shop.v1.parking",
        "routing_key": "shop.v1.q.orders.cancel",
    }
    base.update(fields)
    return Stored(**base)


# -- headers ------------------------------------------------------------------------------


def test_replay_headers_keep_only_the_applications() -> None:
    assert replay_headers(parked_headers()) == {"tenant": "acme", "trace-id": b"abc"}


def test_strip_broker_headers_drops_only_the_brokers() -> None:
    kept = strip_broker_headers(parked_headers())
    assert not {k for k in kept if k.startswith("x-")}
    assert kept[h.H_ERROR_TYPE] == "ValueError"
    assert kept[h.H_ATTEMPT] == 3


# -- parked messages ----------------------------------------------------------------------


def test_immediate_replay_targets_only_this_queue(topology: Topology) -> None:
    plan = ParkedReplay(topology, "orders.cancel")
    out = plan.outgoing(parked(), NOW)
    assert (out.exchange, out.routing_key) == ("shop.v1.due", "shop.v1.q.orders.cancel")
    assert out.mandatory
    assert out.message_id == "m-1"
    assert out.body == b'{"order_id": 42}'
    assert out.content_type == JSON
    assert out.headers == {
        "tenant": "acme",
        "trace-id": b"abc",
        h.H_ATTEMPT: 1,
        h.H_DUE_AT: NOW,
        h.H_ASKED_DUE_AT: NOW,
        h.H_DELAY_MS: 0,
        h.H_TIER: IMMEDIATE,
        h.H_TARGET: "shop.v1.q.orders.cancel",
    }
    assert plan.parking_queue == "shop.v1.parking.orders.cancel"
    assert plan.business_queue == "shop.v1.q.orders.cancel"


def test_replay_through_a_tier(topology: Topology) -> None:
    out = ParkedReplay(topology, "orders.cancel", "1s").outgoing(parked(), NOW)
    assert (out.exchange, out.routing_key) == ("shop.v1.delay.1s", "shop.v1.q.orders.cancel")
    assert out.headers[h.H_DUE_AT] == NOW + 1000
    assert out.headers[h.H_TIER] == "1s"
    assert out.headers[h.H_ATTEMPT] == 1


def test_a_shared_binding_key_is_not_used(topology: Topology) -> None:
    """A message first published to `push.any` comes back to push alone."""
    msg = parked(headers=parked_headers(**{h.H_TARGET: "push.any"}))
    out = ParkedReplay(topology, "push").outgoing(msg, NOW)
    assert out.routing_key == out.headers[h.H_TARGET] == "shop.v1.q.push"


def test_missing_properties_are_filled(topology: Topology) -> None:
    out = ParkedReplay(topology, "push").outgoing(parked(message_id=None, content_type=None), NOW)
    assert out.content_type == BINARY
    assert out.message_id


def test_bad_queue_or_tier(topology: Topology) -> None:
    with pytest.raises(UnknownTargetError, match="unknown queue 'nope'"):
        ParkedReplay(topology, "nope")
    with pytest.raises(DelayError, match="unknown tier"):
        ParkedReplay(topology, "orders.cancel", "9s")
    with pytest.raises(DelayError, match="does not accept tier '1s'"):
        ParkedReplay(topology, "push", "1s")


@pytest.mark.parametrize("given", ["push", "shop.v1.q.push", "shop.v1.parking.push"])
def test_queue_by_any_of_its_names(topology: Topology, given: str) -> None:
    assert resolve_queue(topology, given) == "push"


def test_other_namespace_is_unknown(topology: Topology) -> None:
    with pytest.raises(UnknownTargetError):
        resolve_queue(topology, "other.v1.q.push")


# -- reading ------------------------------------------------------------------------------


def test_summary_of_a_worker_parked_message() -> None:
    summary = parked().summary()
    assert summary == {
        "message_id": "m-1",
        "error_type": "ValueError",
        "error_message": "boom",
        "attempts": 3,
        "park_reason": "max_attempts",
        "parked_at": datetime.fromtimestamp((NOW - 40_000) / 1000, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),  # ISO-8601 UTC, as every instant the CLI shows
        "first_failure": datetime.fromtimestamp((NOW - 50_000) / 1000, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "last_failure": datetime.fromtimestamp((NOW - 40_000) / 1000, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "original_queue": "orders.cancel",
        "target": "shop.v1.q.orders.cancel",
    }


def test_summary_of_a_broker_dead_lettered_message() -> None:
    """Dead-lettered by the broker (delivery limit): no rd-error headers, only x-death."""
    when = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    msg = Stored(
        body=b"",
        message_id="m-2",
        content_type=None,
        headers={
            h.H_ATTEMPT: b"2",
            "x-death": [{"queue": "shop.v1.q.push", "reason": b"delivery_limit", "time": when}],
        },
    )
    summary = msg.summary()
    assert summary["attempts"] == 2
    assert summary["park_reason"] == "delivery_limit"
    assert summary["parked_at"] == "2025-01-02T03:04:05.000Z"
    assert summary["error_type"] is None


def due(target: str | None, routing_key: str = "whatever", **headers: Any) -> Stored:
    all_headers: dict[str, object] = {h.H_ATTEMPT: 2, h.H_DUE_AT: NOW, **headers}
    if target is not None:
        all_headers[h.H_TARGET] = target
    all_headers["x-death"] = [{"queue": "shop.v1.delay.1s", "reason": "expired"}]
    return Stored(b"{}", "m-4", JSON, all_headers, "shop.v1.due", routing_key, timestamp=123)


def test_due_message_goes_to_its_target(topology: Topology) -> None:
    decision = UnroutableReplay(topology).decide(due("shop.v1.q.orders.cancel"), NOW)
    assert isinstance(decision, Reroute)
    out = decision.outgoing
    assert (out.exchange, out.routing_key) == ("shop.v1.due", "shop.v1.q.orders.cancel")
    assert decision.queues == ("orders.cancel",)
    assert not decision.to_parking
    # Never reached a handler: attempt and due time stay; only the broker's headers go.
    assert out.headers == {h.H_ATTEMPT: 2, h.H_DUE_AT: NOW, h.H_TARGET: "shop.v1.q.orders.cancel"}
    assert out.timestamp == 123
    assert out.mandatory


def test_binding_key_target_and_routing_key_fallback(topology: Topology) -> None:
    plan = UnroutableReplay(topology)
    decision = plan.decide(due("push.any"), NOW)
    assert isinstance(decision, Reroute)
    assert decision.queues == ("push",)
    fallback = plan.decide(due(None, routing_key="shop.v1.q.push"), NOW)
    assert isinstance(fallback, Reroute)
    assert fallback.outgoing.routing_key == "shop.v1.q.push"


def test_unknown_target_is_left(topology: Topology) -> None:
    decision = UnroutableReplay(topology).decide(due("shop.v1.q.gone"), NOW)
    assert isinstance(decision, Leave)
    assert "shop.v1.q.gone" in decision.reason


def test_only_one_queue(topology: Topology) -> None:
    plan = UnroutableReplay(topology, "push")
    assert isinstance(plan.decide(due("shop.v1.q.orders.cancel"), NOW), Leave)
    assert isinstance(plan.decide(due("push.any"), NOW), Reroute)


def test_parked_message_goes_back_to_a_parking_lot_not_to_a_handler(topology: Topology) -> None:
    # Dead-lettered by `push` with the binding key it was published with: no parking lot
    # is bound to `push.any`, so it fell into the catch-all.
    msg = Stored(
        b"{}",
        "m-5",
        JSON,
        {"x-death": [{"queue": "shop.v1.q.push", "reason": "delivery_limit"}]},
        "shop.v1.parking",
        "push.any",
    )
    decision = UnroutableReplay(topology).decide(msg, NOW)
    assert isinstance(decision, Reroute)
    assert decision.to_parking
    assert (decision.outgoing.exchange, decision.outgoing.routing_key) == (
        "shop.v1.parking",
        "shop.v1.q.push",
    )
    assert "x-death" not in decision.outgoing.headers
    worker_parked = parked(exchange="shop.v1.parking", routing_key="shop.v1.q.orders.cancel")
    again = UnroutableReplay(topology).decide(worker_parked, NOW)
    assert isinstance(again, Reroute)
    assert again.queues == ("orders.cancel",)
    assert again.outgoing.headers[h.H_ERROR_TYPE] == "ValueError"  # still parked: kept


def test_parked_message_of_an_unknown_queue_is_left(topology: Topology) -> None:
    msg = Stored(b"{}", "m-6", JSON, {}, "shop.v1.parking", "elsewhere")
    assert isinstance(UnroutableReplay(topology).decide(msg, NOW), Leave)
