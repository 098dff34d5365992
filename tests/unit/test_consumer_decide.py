"""The retry/park decision (`rabbit_delay._consumer.decide.decide`): pure, no broker."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rabbit_delay import ConfigError, Reject, Retry, Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._broker import UNKNOWN, BrokerInfo
from rabbit_delay._consumer.decide import (
    ACK,
    MAX_ERROR_MESSAGE,
    MAX_TRACEBACK,
    BrokerRetry,
    Park,
    ParkReason,
    QueuePolicy,
    Republish,
    RepublishReason,
    Requeue,
    Skip,
    Unavailable,
    Undecodable,
    decide,
    error_type_of,
)
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay._envelope import Envelope
from rabbit_delay.stores import ClaimResult

NOW = 1_800_000_000_000
BODY = b'{"order_id":1}'
JSON = "application/json"


def topology(**queue: Any) -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "30s": "30s", "5m": "5m"},
            "queues": {"orders": queue, "mail": {"bindings": ["order.paid"]}},
        }
    )


def envelope(attempt: int = 1, **headers: object) -> Envelope:
    base: dict[str, object] = {
        h.H_ATTEMPT: attempt,
        h.H_TIER: "1s",
        h.H_DUE_AT: NOW - 5,
        h.H_TARGET: "order.paid",
    }
    return Envelope.from_headers("m-1", {**base, **headers})


RABBITMQ_3_10 = BrokerInfo(version_text="3.10.8")
RABBITMQ_4_0 = BrokerInfo(version_text="4.0.5")
RABBITMQ_4_3 = BrokerInfo(version_text="4.3.6")


def run(
    outcome: Any, env: Envelope | None = None, broker: BrokerInfo = UNKNOWN, **queue: Any
) -> Any:
    policy = QueuePolicy(topology(**queue), "orders")
    return decide(
        env or envelope(), policy, outcome, body=BODY, content_type=JSON, now_ms=NOW, broker=broker
    )


NATIVE = {"backend": "broker", "min": "1s", "max": "5s", "max_attempts": 4}


def native_envelope(delivery_count: int, attempt: int = 1, **headers: object) -> Envelope:
    """A delivery of a queue with retry backend "broker", as the worker reads it."""
    policy = QueuePolicy(topology(retry=NATIVE), "orders")
    base: dict[str, object] = {h.H_ATTEMPT: attempt, h.H_TIER: "1s", h.H_DUE_AT: NOW - 5}
    if delivery_count:
        base[h.DELIVERY_COUNT_HEADER] = delivery_count
        base["x-acquired-count"] = delivery_count
    return policy.envelope("m-1", {**base, **headers})


def test_success_acks() -> None:
    assert run(None) is ACK


@pytest.mark.parametrize(
    ("claim", "reason"),
    [(ClaimResult.DONE, Outcome.DUPLICATE), (ClaimResult.CANCELLED, Outcome.CANCELLED)],
)
def test_done_or_cancelled_claims_skip(claim: ClaimResult, reason: Outcome) -> None:
    assert run(claim) == Skip(reason)


def test_a_copy_in_progress_is_deferred_through_the_shortest_tier_with_the_same_attempt() -> None:
    env = envelope(2, **{"x-death": [{"count": 1}], "x-first-death-queue": "q"})
    action = run(ClaimResult.IN_PROGRESS, env, retry={"tiers": ["5m"]})
    assert isinstance(action, Republish)
    assert action.reason is RepublishReason.DEFER
    assert action.attempt == 2
    out = action.outgoing
    assert out.exchange == "shop.v1.delay.1s"
    assert out.routing_key == "shop.v1.q.orders"
    assert out.headers[h.H_ATTEMPT] == 2
    assert out.message_id == "m-1"
    assert not any(k.startswith("x-") for k in out.headers)


def test_claimed_is_not_an_outcome() -> None:
    with pytest.raises(ValueError, match="run the handler"):
        run(ClaimResult.CLAIMED)


def test_a_failure_retries_through_the_policy_tiers_to_the_failed_queue_only() -> None:
    env = envelope(
        1,
        **{
            "x-death": [{"count": 1}],
            "x-last-death-reason": "expired",
            "x-delivery-count": 2,
            "custom": "kept",
        },
    )
    action = run(ValueError("boom"), env, retry={"tiers": ["1s", "30s"], "max_attempts": 4})
    assert isinstance(action, Republish)
    assert action.reason is RepublishReason.RETRY
    assert action.attempt == 2
    out = action.outgoing
    # The queue's unique key, not the binding key the message was first published with.
    assert (out.exchange, out.routing_key) == ("shop.v1.delay.1s", "shop.v1.q.orders")
    assert (out.body, out.content_type, out.message_id) == (BODY, JSON, "m-1")
    headers = out.headers
    assert headers[h.H_ATTEMPT] == 2
    assert headers[h.H_TIER] == "1s"
    assert headers[h.H_DUE_AT] == NOW + 1_000
    assert headers[h.H_TARGET] == "shop.v1.q.orders"
    assert headers[h.H_FIRST_FAILURE] == headers[h.H_LAST_FAILURE] == NOW
    assert headers[h.H_ERROR_TYPE] == "ValueError"
    assert headers[h.H_ERROR_MESSAGE] == "boom"
    assert headers["custom"] == "kept"
    assert not any(k.startswith("x-") for k in headers)


@pytest.mark.parametrize(("attempt", "tier"), [(1, "1s"), (2, "30s"), (3, "30s"), (4, "30s")])
def test_retry_n_waits_tier_n_and_the_last_tier_repeats(attempt: int, tier: str) -> None:
    policy = {"tiers": ["1s", "30s"], "max_attempts": 9}
    action = run(RuntimeError(), envelope(attempt), retry=policy)
    assert isinstance(action, Republish)
    assert action.outgoing.headers[h.H_TIER] == tier


def test_without_retry_tiers_the_shortest_tier_is_used() -> None:
    action = run(RuntimeError())
    assert isinstance(action, Republish)
    assert action.outgoing.headers[h.H_TIER] == "1s"


def test_the_first_failure_time_is_kept_across_retries() -> None:
    env = envelope(2, **{h.H_FIRST_FAILURE: NOW - 60_000})
    action = run(RuntimeError(), env)
    assert isinstance(action, Republish)
    assert action.outgoing.headers[h.H_FIRST_FAILURE] == NOW - 60_000
    assert action.outgoing.headers[h.H_LAST_FAILURE] == NOW


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_the_last_attempt_parks_with_the_error_headers() -> None:
    exc = _raise(KeyError("order 1 not found"))
    env = envelope(3, **{h.H_FIRST_FAILURE: NOW - 2_000, "x-death": [{"count": 2}]})
    action = run(exc, env, retry={"max_attempts": 3})
    assert isinstance(action, Park)
    assert action.reason is ParkReason.MAX_ATTEMPTS
    out = action.outgoing
    assert (out.exchange, out.routing_key) == ("shop.v1.parking", "shop.v1.q.orders")
    assert out.mandatory is True
    assert (out.body, out.content_type, out.message_id) == (BODY, JSON, "m-1")
    headers = out.headers
    assert headers[h.H_ERROR_TYPE] == "KeyError"
    assert headers[h.H_ERROR_MESSAGE] == "'order 1 not found'"
    assert "KeyError: 'order 1 not found'" in str(headers[h.H_ERROR_TRACEBACK])
    assert headers[h.H_ORIGINAL_QUEUE] == "orders"
    assert headers[h.H_ATTEMPT] == 3
    assert headers[h.H_FIRST_FAILURE] == NOW - 2_000
    assert headers[h.H_LAST_FAILURE] == NOW
    assert headers[h.H_PARK_REASON] == "max_attempts"
    assert "x-death" not in headers


def test_long_errors_are_truncated() -> None:
    exc = _raise(ValueError("x" * 50_000))
    action = run(exc, envelope(3), retry={"max_attempts": 3})
    assert isinstance(action, Park)
    message = str(action.outgoing.headers[h.H_ERROR_MESSAGE])
    trace = str(action.outgoing.headers[h.H_ERROR_TRACEBACK])
    assert len(message) <= MAX_ERROR_MESSAGE
    assert len(trace) <= MAX_TRACEBACK
    assert message.endswith("(truncated)\n")
    assert trace.startswith("...(truncated)")


def test_reject_parks_at_once_with_its_reason() -> None:
    action = run(Reject("not our order"), envelope(1), retry={"max_attempts": 5})
    assert isinstance(action, Park)
    assert action.reason is ParkReason.REJECTED
    assert action.outgoing.headers[h.H_ERROR_MESSAGE] == "not our order"
    assert action.outgoing.headers[h.H_ERROR_TYPE] == "rabbit_delay.Reject"
    assert h.H_ERROR_TRACEBACK not in action.outgoing.headers


def test_retry_may_name_a_tier_or_a_delay() -> None:
    by_tier = run(Retry(tier="5m"), retry={"tiers": ["1s"]})
    by_delay = run(Retry(delay="30s"), retry={"tiers": ["1s"]})
    assert isinstance(by_tier, Republish)
    assert isinstance(by_delay, Republish)
    assert by_tier.outgoing.headers[h.H_TIER] == "5m"
    assert by_delay.outgoing.headers[h.H_TIER] == "30s"
    assert by_tier.attempt == 2


def test_a_retry_the_topology_cannot_serve_falls_back_to_the_policy() -> None:
    action = run(Retry("wait", delay="7s"), retry={"tiers": ["30s"]})
    assert isinstance(action, Republish)
    assert action.outgoing.headers[h.H_TIER] == "30s"
    assert "requested retry delay refused" in str(action.outgoing.headers[h.H_ERROR_MESSAGE])


def test_retry_counts_as_an_attempt() -> None:
    action = run(Retry(tier="1s"), envelope(2), retry={"max_attempts": 2})
    assert isinstance(action, Park)
    assert action.reason is ParkReason.MAX_ATTEMPTS


class Order(BaseModel):
    order_id: int


def test_undecodable_and_invalid_bodies_park_at_once() -> None:
    with pytest.raises(ValidationError) as not_json:
        Order.model_validate_json(b"\xff")
    with pytest.raises(ValidationError) as wrong:
        Order.model_validate_json(b'{"order_id": "x"}')
    cases = ((not_json.value, ParkReason.DECODE_ERROR), (wrong.value, ParkReason.VALIDATION_ERROR))
    for exc, reason in cases:
        action = run(Undecodable.from_exception(exc), envelope(1), retry={"max_attempts": 5})
        assert isinstance(action, Park)
        assert action.reason is reason
        assert action.outgoing.headers[h.H_PARK_REASON] == reason.value
        assert action.outgoing.headers[h.H_ERROR_TYPE] == "pydantic_core.ValidationError"


def test_a_store_failure_is_a_nack_where_a_requeue_costs_no_delivery() -> None:
    # RabbitMQ 4.3+ counts basic.reject, not basic.nack, towards the delivery limit.
    action = run(Unavailable(OSError("disk full")), broker=RABBITMQ_4_3)
    assert isinstance(action, Requeue)
    assert "disk full" in action.error


@pytest.mark.parametrize("broker", [RABBITMQ_3_10, RABBITMQ_4_0, UNKNOWN], ids=str)
def test_a_store_failure_is_a_same_attempt_copy_where_a_requeue_counts(broker: BrokerInfo) -> None:
    # Before 4.3 (and when unknown) every requeue counts: an outage longer than the
    # delivery limit would park good messages. A copy through the shortest tier does not.
    env = envelope(2, **{"x-delivery-count": 1, "x-death": [{"count": 1}], "custom": "kept"})
    action = run(Unavailable(OSError("disk full")), env, broker, retry={"tiers": ["5m"]})
    assert isinstance(action, Republish)
    assert action.reason is RepublishReason.UNAVAILABLE
    assert action.requeue_if_unsent
    assert action.attempt == 2
    assert action.error is not None
    assert "disk full" in action.error
    out = action.outgoing
    assert (out.exchange, out.routing_key) == ("shop.v1.delay.1s", "shop.v1.q.orders")
    assert out.message_id == "m-1"
    assert out.headers[h.H_ATTEMPT] == 2
    assert out.headers["custom"] == "kept"
    assert h.H_ERROR_TYPE not in out.headers  # not a failure of the message
    assert not any(k.startswith("x-") for k in out.headers)


def test_only_a_retry_dead_letters_when_its_copy_cannot_be_sent() -> None:
    retry = run(RuntimeError())
    defer = run(ClaimResult.IN_PROGRESS)
    assert not retry.requeue_if_unsent
    assert defer.requeue_if_unsent


# -- retry backend "broker" (RabbitMQ 4.3+ quorum delayed retry) -------------------------------


def test_broker_backend_requeues_with_the_brokers_delay() -> None:
    env = native_envelope(0)
    action = run(ValueError("boom"), env, RABBITMQ_4_3, retry=NATIVE)
    assert action == BrokerRetry(attempt=2, delay_ms=1_000, error="ValueError: boom")


@pytest.mark.parametrize(
    ("delivery_count", "attempt", "delay_ms"), [(0, 2, 1_000), (1, 3, 2_000), (2, 4, 3_000)]
)
def test_broker_backend_counts_attempts_from_the_delivery_count(
    delivery_count: int, attempt: int, delay_ms: int
) -> None:
    # delay = min(min x x-delivery-count after the reject, max): 1 s, 2 s, 3 s (max 5 s)
    env = native_envelope(delivery_count)
    assert env.attempt == delivery_count + 1
    action = run(RuntimeError(), env, RABBITMQ_4_3, retry={**NATIVE, "max_attempts": 9})
    assert action == BrokerRetry(attempt=attempt, delay_ms=delay_ms, error="RuntimeError: ")


def test_broker_backend_delays_are_capped_by_max() -> None:
    env = native_envelope(7)
    retry = {**NATIVE, "max_attempts": 20}
    action = run(RuntimeError(), env, RABBITMQ_4_3, retry=retry, delivery_limit=20)
    assert isinstance(action, BrokerRetry)
    assert action.delay_ms == 5_000


def test_broker_backend_parks_the_last_attempt_itself_with_the_usual_headers() -> None:
    exc = _raise(KeyError("order 1 not found"))
    env = native_envelope(3)  # attempts 1-3 failed, this is attempt 4 of 4
    action = run(exc, env, RABBITMQ_4_3, retry=NATIVE)
    assert isinstance(action, Park)
    assert action.reason is ParkReason.MAX_ATTEMPTS
    headers = action.outgoing.headers
    assert headers[h.H_ATTEMPT] == 4
    assert headers[h.H_PARK_REASON] == "max_attempts"
    assert headers[h.H_ERROR_TYPE] == "KeyError"
    assert "KeyError" in str(headers[h.H_ERROR_TRACEBACK])
    assert headers[h.H_LAST_FAILURE] == NOW
    # No header survives a requeue: the first failure was at least 1 + 2 + 3 s earlier.
    assert headers[h.H_FIRST_FAILURE] == NOW - 6_000
    assert not any(k.startswith("x-") for k in headers)


def test_broker_backend_keeps_a_first_failure_a_copy_carried() -> None:
    env = native_envelope(1, attempt=2, **{h.H_FIRST_FAILURE: NOW - 60_000})
    action = run(RuntimeError(), env, RABBITMQ_4_3, retry={**NATIVE, "max_attempts": 3})
    assert isinstance(action, Park)
    assert action.outgoing.headers[h.H_FIRST_FAILURE] == NOW - 60_000
    assert action.outgoing.headers[h.H_ATTEMPT] == 3


def test_broker_backend_honours_a_retry_that_names_a_tier_with_a_copy() -> None:
    env = native_envelope(1)
    action = run(Retry("later", tier="30s"), env, RABBITMQ_4_3, retry=NATIVE)
    assert isinstance(action, Republish)
    assert action.reason is RepublishReason.RETRY
    # The copy starts a new delivery count: the attempt travels in rd-attempt.
    assert action.outgoing.headers[h.H_ATTEMPT] == 3
    assert action.outgoing.headers[h.H_TIER] == "30s"
    again = QueuePolicy(topology(retry=NATIVE), "orders").envelope("m-1", action.outgoing.headers)
    assert again.attempt == 3


def test_broker_backend_falls_back_to_the_broker_when_a_retry_cannot_be_served() -> None:
    action = run(Retry("later", delay=17), native_envelope(0), RABBITMQ_4_3, retry=NATIVE)
    assert isinstance(action, BrokerRetry)
    assert "requested retry delay refused" in action.error


def test_broker_backend_defers_a_copy_in_progress_with_the_counted_attempt() -> None:
    action = run(ClaimResult.IN_PROGRESS, native_envelope(2), RABBITMQ_4_3, retry=NATIVE)
    assert isinstance(action, Republish)
    assert action.reason is RepublishReason.DEFER
    assert action.outgoing.headers[h.H_ATTEMPT] == 3


def test_the_tiers_backend_ignores_the_delivery_count() -> None:
    # A crash redelivery is not an attempt there; the broker's delivery limit handles it.
    policy = QueuePolicy(topology(), "orders")
    assert policy.envelope("m-1", {h.H_ATTEMPT: 2, h.DELIVERY_COUNT_HEADER: 5}).attempt == 2


def test_backoff_resolves_exact_delays_through_the_cascade() -> None:
    top = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s"},
            "cascade": {"levels": 12},
            "queues": {"orders": {"retry": {"max_attempts": 5, "backoff": {"initial": "2s"}}}},
        }
    )
    policy = QueuePolicy(top, "orders")
    delays = [policy.retry_route(n).delay_ms for n in range(1, 5)]
    assert delays == [2_000, 4_000, 8_000, 16_000]
    assert {policy.retry_route(n).tier for n in range(1, 5)} == {"cascade"}
    assert policy.retry_route(1).target == "shop.v1.q.orders"


def test_retry_tiers_are_accepted_even_outside_the_queues_publish_tiers() -> None:
    # `tiers` limits what publishers pick; the queue's own retry schedule always works
    # (topology/orders.toml: published at 30m only, retried after 5m).
    top = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "5m": "5m"},
            "queues": {"orders": {"tiers": ["5m"], "retry": {"tiers": ["1s"]}}},
        }
    )
    policy = QueuePolicy(top, "orders")
    assert policy.retry_route(1).tier == "1s"
    assert policy.retry_route(1).target == "shop.v1.q.orders"


def test_a_backoff_delay_no_backend_serves_is_a_config_error() -> None:
    top = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s"},
            "queues": {"orders": {"retry": {"max_attempts": 10, "backoff": {"max": "1h"}}}},
            "cascade": {"levels": 4},
        }
    )
    with pytest.raises(ConfigError, match=r"queues\.orders\.retry"):
        QueuePolicy(top, "orders")


def test_the_defer_tier_is_the_shortest_the_queue_accepts() -> None:
    top = topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s", "5m": "5m", "1h": "1h"},
            "queues": {"orders": {"tiers": ["1h", "5m"]}},
        }
    )
    assert QueuePolicy(top, "orders").defer_route.tier == "5m"


def test_error_type_names_drop_private_modules() -> None:
    class Local(Exception):
        pass

    assert error_type_of(ValueError()) == "ValueError"
    assert error_type_of(ConfigError("x")) == "rabbit_delay.ConfigError"
    name = error_type_of(Local())
    assert name.endswith("test_error_type_names_drop_private_modules.<locals>.Local")
