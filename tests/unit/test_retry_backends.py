"""Retry backends in the topology, the declaration and the broker's version rules. Pure.

Backend "tiers" (the default) re-publishes a failed message through the delay tiers;
backend "broker" requeues it and lets a RabbitMQ 4.3+ quorum queue delay it
(`x-delayed-retry-*`). Plus the consumer-timeout rule both workers log by.
"""

from __future__ import annotations

from typing import Any

import pytest

from rabbit_delay import App, IncompatibleBroker, Topology, TopologyError, topology_from_dict
from rabbit_delay._broker import UNKNOWN, BrokerInfo, is_consumer_timeout
from rabbit_delay._consumer.app import Transport
from rabbit_delay._consumer.decide import BrokerRetry
from rabbit_delay._consumer.delivery import outcome_of
from rabbit_delay._consumer.outcome import Outcome
from rabbit_delay._consumer.worker import WorkerCore
from rabbit_delay._observe.report import WorkerReport, WorkerStats
from rabbit_delay._plan.desired import desired
from rabbit_delay._plan.program import declare_program, plan_program
from rabbit_delay._plan.refusals import broker_requirements
from rabbit_delay._topology.model import RetryBackend
from rabbit_delay.stores import MemoryStore

BROKER_3_10 = BrokerInfo(version_text="3.10.8")
BROKER_4_0 = BrokerInfo(version_text="4.0.5")
BROKER_4_3 = BrokerInfo(version_text="4.3.6")


def shop(queue: dict[str, Any] | None = None, **top: Any) -> Topology:
    return topology_from_dict(
        {
            "namespace": "shop",
            "tiers": {"1s": "1s"},
            "queues": {"orders": queue if queue is not None else {}, "mail": {}},
            **top,
        },
        "shop.toml",
    )


NATIVE = {"retry": {"backend": "broker", "min": "200ms", "max": "5m"}}


# -- the topology ------------------------------------------------------------------------------


def test_tiers_is_the_default_backend() -> None:
    assert shop().queues["orders"].retry.backend is RetryBackend.TIERS


def test_broker_backend_reads_min_and_max_as_durations() -> None:
    retry = shop(NATIVE).queues["orders"].retry
    assert (retry.backend, retry.min, retry.max, retry.max_attempts) == (
        RetryBackend.BROKER,
        200,
        300_000,
        3,
    )
    assert [retry.broker_delay_ms(n) for n in (1, 2, 3)] == [200, 400, 600]
    assert retry.broker_delay_ms(10_000) == 300_000


@pytest.mark.parametrize(
    ("queue", "top", "expected"),
    [
        (
            {"retry": {"backend": "broker"}},
            {},
            'queues.orders.retry: backend = "broker" needs `min`',
        ),
        (
            {"retry": {"backend": "broker", "min": "1s", "tiers": ["1s"]}},
            {},
            'queues.orders.retry: backend = "broker" waits in the queue itself: remove `tiers`',
        ),
        (
            {"retry": {"backend": "broker", "min": "1s", "backoff": {}}},
            {"cascade": {}},
            "remove `tiers`/`backoff`",
        ),
        (
            {"retry": {"min": "1s"}},
            {},
            'queues.orders.retry: `min`/`max` belong to backend = "broker"',
        ),
        (
            {"retry": {"backend": "broker", "min": "2s", "max": "1s"}},
            {},
            "queues.orders.retry: `max` (1s) must be at least `min` (2s)",
        ),
        (
            {"retry": {"backend": "broker", "min": "0s"}},
            {},
            "queues.orders.retry.min: Input should be greater than 0",
        ),
        (
            {"retry": {"backend": "broker", "min": 5}},
            {},
            "queues.orders.retry.min: 5: write a duration with its unit",
        ),
        (
            {"retry": {"backend": "later", "min": "1s"}},
            {},
            "queues.orders.retry.backend: Input should be 'tiers' or 'broker'",
        ),
        (
            {"delivery_limit": 2, "retry": {"backend": "broker", "min": "1s", "max_attempts": 3}},
            {},
            "queues.orders: delivery_limit (2) must be at least retry.max_attempts (3)",
        ),
        (
            NATIVE,
            {"queue_type": "classic"},
            'queues.orders.retry.backend = "broker" needs quorum queues',
        ),
        (
            {"retry": {"backend": "broker", "min": "1s", "mni": "1s"}},
            {},
            "queues.orders.retry.mni: unknown key 'mni'; allowed keys here: max_attempts, "
            "backend, tiers, backoff, min, max",
        ),
    ],
)
def test_invalid_retry_backends_name_the_field_and_what_is_allowed(
    queue: dict[str, Any], top: dict[str, Any], expected: str
) -> None:
    with pytest.raises(TopologyError) as info:
        shop(queue, **top)
    assert str(info.value).startswith("shop.toml: invalid topology")
    assert expected in str(info.value)


def test_a_delivery_limit_equal_to_max_attempts_is_enough() -> None:
    # Deliveries 1..max_attempts: the worker parks the last one itself; the broker's
    # limit (dead-letter after limit + 1 deliveries) stays behind it as a backstop.
    shop({"delivery_limit": 3, "retry": {"backend": "broker", "min": "1s", "max_attempts": 3}})


# -- what declare builds -----------------------------------------------------------------------


def business_args(topology: Topology, queue: str = "orders") -> dict[str, object]:
    name = topology.names.business_queue(queue)
    [spec] = [q for q in desired(topology).queues if q.name == name]
    return dict(spec.arguments)


def test_broker_backend_adds_the_delayed_retry_arguments_to_its_queue_only() -> None:
    topology = shop(NATIVE)
    args = business_args(topology)
    assert args["x-delayed-retry-type"] == "failed"  # rejects wait; a nack comes back at once
    assert args["x-delayed-retry-min"] == 200
    assert args["x-delayed-retry-max"] == 300_000
    assert args["x-delivery-limit"] == 10
    assert not any(k.startswith("x-delayed-retry") for k in business_args(topology, "mail"))
    assert business_args(shop()) == business_args(topology, "mail") | {
        "x-dead-letter-routing-key": "shop.v1.q.orders"
    }


def test_without_max_the_broker_gets_no_cap() -> None:
    args = business_args(shop({"retry": {"backend": "broker", "min": "1s"}}))
    assert "x-delayed-retry-max" not in args


# -- which brokers can hold it ------------------------------------------------------------------


@pytest.mark.parametrize("broker", [BROKER_3_10, BROKER_4_0, UNKNOWN], ids=str)
def test_broker_backend_is_refused_before_4_3(broker: BrokerInfo) -> None:
    [reason] = broker_requirements(desired(shop(NATIVE)), broker)
    assert 'retry backend = "broker"' in reason
    assert "shop.v1.q.orders" in reason
    assert "4.3" in reason
    assert broker.describe() in reason
    assert 'backend = "tiers"' in reason


def test_broker_backend_is_fine_from_4_3_and_tiers_everywhere() -> None:
    assert broker_requirements(desired(shop(NATIVE)), BROKER_4_3) == []
    for broker in (BROKER_3_10, BROKER_4_0, BROKER_4_3, UNKNOWN):
        assert broker_requirements(desired(shop()), broker) == []


@pytest.mark.parametrize("program", [declare_program, plan_program])
def test_declare_and_plan_refuse_before_any_operation(program: Any) -> None:
    started = program(desired(shop(NATIVE)), None, BROKER_4_0)
    with pytest.raises(IncompatibleBroker, match=r"needs quorum queue delayed retry"):
        next(started)  # not one operation asked of the broker


class _Worker(WorkerCore):
    """The settings both workers share, without a transport."""

    transport = Transport.SYNC
    default_concurrency = 1

    def make_report(self, metrics: Any) -> WorkerReport:
        return WorkerReport(self, metrics)


def test_workers_share_one_start_check() -> None:
    app = App(shop(NATIVE), store=MemoryStore())
    app.add_consumer("mail", lambda message: None)
    worker = _Worker(app, "amqp://guest:guest@127.0.0.1:5672/%2F")
    with pytest.raises(IncompatibleBroker, match=r"4\.0\.5"):
        worker.check_broker(BROKER_4_0)
    worker.check_broker(BROKER_4_3)


# -- counted by the workers ---------------------------------------------------------------------


def test_a_broker_retry_counts_as_a_retry() -> None:
    action = BrokerRetry(attempt=2, delay_ms=200, error="ValueError: x")
    assert outcome_of(action) is Outcome.RETRIED
    stats = WorkerStats()
    stats.count(outcome_of(action))
    assert (stats.retried, stats.requeued) == (1, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout "
            "value used: 3000 ms. This timeout value can be configured, see consumers doc "
            "guide to learn more",
            True,
        ),
        ("ChannelClosedByBroker: (406) 'PRECONDITION_FAILED - unknown delivery tag 5'", False),
        ("StreamLostError: ('Transport indicated EOF',)", False),
    ],
)
def test_a_consumer_timeout_is_recognised_by_its_reply_text(text: str, expected: bool) -> None:
    assert is_consumer_timeout(text) is expected
