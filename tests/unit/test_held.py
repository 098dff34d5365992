"""The [held] backend without a broker: the topology table, the holding queue's
arguments, the refusal before RabbitMQ 4.3, the publishers' route, the holders' decision
and their error conditions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from rabbit_delay import (
    AccessRefused,
    App,
    ConfigError,
    ConnectionLost,
    DelayError,
    HandlerContext,
    IncompatibleBroker,
    MissingObjectError,
    Topology,
    TopologyError,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo, QueueCounts
from rabbit_delay._envelope import outgoing
from rabbit_delay._held.rules import (
    Hold,
    Release,
    ReleaseReason,
    decide,
    endpoint_of,
    holding_address,
)
from rabbit_delay._io.management import counts_from_api
from rabbit_delay._ops.dashboard.rules import picture
from rabbit_delay._ops.status.rules import QueueRole, Status, status_rows
from rabbit_delay._plan.desired import HELD_DELIVERY_LIMIT, desired
from rabbit_delay._plan.permissions import publish_targets
from rabbit_delay._plan.refusals import broker_requirements, check_broker
from rabbit_delay._topology.delays import HELD, Router
from rabbit_delay.testing import MemoryBroker, MemoryPublisher, TestBroker

BASE: dict[str, Any] = {
    "namespace": "shop",
    "tiers": {"5s": "5s"},
    "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}},
}


def make(held: dict[str, Any] | None = None, **overrides: Any) -> Topology:
    return topology_from_dict({**BASE, "held": held or {}, **overrides})


def broker(version: str) -> BrokerInfo:
    return BrokerInfo(version_text=version)


# -- the table ------------------------------------------------------------------------------


def test_held_is_one_of_the_arbitrary_delay_backends() -> None:
    for other in ("cascade", "plugin"):
        with pytest.raises(TopologyError, match="choose one arbitrary-delay backend"):
            topology_from_dict({**BASE, "held": {}, other: {}})


def test_held_needs_quorum_queues() -> None:
    with pytest.raises(TopologyError, match=r"\[held\] needs quorum queues"):
        make(queue_type="classic")


def test_held_max_delay_bounds_the_idempotency_retention() -> None:
    assert make().longest_delay_ms() == 49 * 86_400_000
    assert make({"max_delay": "400d"}).longest_delay_ms() == 400 * 86_400_000
    assert make().exact_delays


def test_held_allows_exact_retry_backoff() -> None:
    queues = {"orders.cancel": {"retry": {"backoff": {"initial": "1s"}}}}
    assert make(queues=queues).queues["orders.cancel"].retry.backoff is not None


# -- declarations ---------------------------------------------------------------------------


def test_holding_queue_dead_letters_at_least_once_to_the_due_exchange() -> None:
    topology = make()
    n = topology.names
    want = desired(topology)
    assert want.held_queue == n.held_queue() == "shop.v1.held"
    (queue,) = [q for q in want.queues if q.name == n.held_queue()]
    assert dict(queue.arguments) == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": n.due_exchange(),
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        # no x-dead-letter-routing-key: the message keeps its own, its business queue's
        "x-delivery-limit": HELD_DELIVERY_LIMIT,
        "x-consumer-disconnected-timeout": 5_000,
        "x-queue-leader-locator": "balanced",
    }
    (exchange,) = [e for e in want.exchanges if e.name == n.held_exchange()]
    assert exchange.type == "fanout"
    assert [(b.source, b.routing_key) for b in want.bindings if b.destination == queue.name] == [
        (n.held_exchange(), "")
    ]


def test_no_holding_queue_without_the_table() -> None:
    topology = topology_from_dict(BASE)
    want = desired(topology)
    assert want.held_queue is None
    assert topology.names.held_queue() not in {q.name for q in want.queues}


@pytest.mark.parametrize("version", ["3.10.8", "4.0.5", "4.2.1", ""])
def test_refused_before_rabbitmq_4_3(version: str) -> None:
    want = desired(make())
    (reason,) = broker_requirements(want, broker(version))
    assert "[held]" in reason
    assert "4.3" in reason
    with pytest.raises(IncompatibleBroker, match="x-opt-delivery-time"):
        check_broker(want, broker(version))


@pytest.mark.parametrize("version", ["4.3.0", "4.3.6", "4.4.0", "5.0.0"])
def test_accepted_from_rabbitmq_4_3(version: str) -> None:
    check_broker(desired(make()), broker(version))


# -- publishing -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["shop.v1.q.orders.cancel", "push.any"])
def test_delays_go_to_the_holding_queue_with_the_business_key(key: str) -> None:
    topology = make()
    route = Router(topology).resolve(key, delay_ms=12_345)
    assert (route.exchange, route.routing_key, route.tier) == ("shop.v1.held", key, HELD)
    assert route.delay_ms == 12_345
    assert route.asked_ms is None  # exact: nothing rounded
    assert route.mandatory
    message = outgoing(route, b"{}", "application/json", now=1_000_000)
    assert message.headers[h.H_DUE_AT] == 1_012_345
    assert message.headers[h.H_ASKED_DUE_AT] == 1_012_345
    assert message.headers[h.H_TIER] == HELD


def test_a_tier_delay_still_takes_its_tier() -> None:
    route = Router(make()).resolve("shop.v1.q.push", delay_ms=5_000)
    assert route.tier == "5s"


def test_delays_past_max_delay_are_refused() -> None:
    router = Router(make({"max_delay": "1h"}))
    router.resolve("shop.v1.q.push", delay_ms=3_600_000)
    with pytest.raises(DelayError, match=r"held\.max_delay"):
        router.resolve("shop.v1.q.push", delay_ms=3_600_001)


def test_remaining_delays_are_exact() -> None:
    route = Router(make()).resolve_remaining("shop.v1.q.push", 777)
    assert (route.tier, route.delay_ms) == (HELD, 777)


def test_publishers_may_write_to_the_held_exchange() -> None:
    assert "shop.v1.held" in publish_targets(make())
    assert "shop.v1.held" not in publish_targets(topology_from_dict(BASE))


# -- the holders' decision -------------------------------------------------------------------


def test_not_due_yet_is_held_until_its_due_time() -> None:
    assert decide({h.H_DUE_AT: 10_000}, now_ms=9_999) == Hold(10_000)


@pytest.mark.parametrize(("now", "late"), [(10_000, 0), (10_250, 250)])
def test_due_is_released_with_its_lateness(now: int, late: int) -> None:
    assert decide({h.H_DUE_AT: 10_000}, now_ms=now) == Release(ReleaseReason.DUE, late)


@pytest.mark.parametrize("properties", [None, {}, {h.H_DUE_AT: "10000"}, {h.H_DUE_AT: True}])
def test_without_a_readable_due_time_it_is_released_not_held_forever(
    properties: dict[str, object] | None,
) -> None:
    assert decide(properties, now_ms=5) == Release(ReleaseReason.NO_DUE_TIME)


def test_endpoint_from_the_workers_url() -> None:
    ep = endpoint_of("amqps://app:p%40ss@rabbit.example:5671/shop%2Fprod")
    assert (ep.host, ep.port, ep.user, ep.password, ep.tls) == (
        "rabbit.example",
        5671,
        "app",
        "p@ss",
        True,
    )
    assert ep.open_hostname == "vhost:shop/prod"
    assert endpoint_of("amqp://127.0.0.1").vhost == "/"
    assert endpoint_of("amqp://127.0.0.1").port == 5672
    with pytest.raises(ConfigError, match="amqp://"):
        endpoint_of("http://127.0.0.1:15672/")


def test_holding_address_is_the_v2_queue_address() -> None:
    assert holding_address(make().names) == "/queues/shop.v1.held"


# -- the AMQP 1.0 conditions -----------------------------------------------------------------


def test_conditions_map_into_the_error_tree() -> None:
    errors = pytest.importorskip("rabbit_delay._amqp10.errors", reason="the held extra")
    refused = errors.condition_error("amqp:unauthorized-access", "no", doing="x")
    assert isinstance(refused, AccessRefused)
    missing = errors.condition_error("amqp:not-found", "no queue", doing="x", address="/queues/q")
    assert isinstance(missing, MissingObjectError)
    old = errors.condition_error(
        "amqp:connection:framing-error",
        "Expected SASL protocol header got: Unknown protocol ['AMQP\x00\x00\t\x01']",
        doing="x",
    )
    assert isinstance(old, IncompatibleBroker)
    assert "\x00" not in str(old)
    lost = errors.condition_error("amqp:internal-error", "Connection forced", doing="x")
    assert isinstance(lost, ConnectionLost)
    assert [errors.fatal(e) for e in (refused, missing, old, lost)] == [True, True, True, False]


# -- the test kit ----------------------------------------------------------------------------


def test_the_kit_holds_on_its_virtual_clock_and_delivers_exactly() -> None:
    broker = MemoryBroker("4.3.6", start=datetime(2026, 1, 1, tzinfo=UTC))
    topology = make()
    broker.declare(topology)
    publisher = MemoryPublisher(topology, broker)
    n = topology.names
    try:
        for seconds, key in ((90.5, "shop.v1.q.push"), (3, "push.any"), (86_400 * 30, None)):
            start = broker.now_ms()
            if key is None:
                publisher.publish_delayed({}, queue="orders.cancel", delay=seconds)
                business = n.business_queue("orders.cancel")
            else:
                publisher.publish_delayed({}, routing_key=key, delay=seconds)
                business = n.business_queue("push")
            assert broker.depth(n.held_queue()) == 1  # held aside
            assert broker.run_until(lambda b=business: broker.depth(b) > 0, "60d")
            assert broker.now_ms() - start == round(seconds * 1000)  # exactly, never early
            assert broker.depth(n.held_queue()) == 0
            message = broker.get(business)
            assert message is not None
            assert message.headers[h.H_TIER] == HELD
    finally:
        broker.close()


def test_the_kit_refuses_held_before_4_3() -> None:
    broker = MemoryBroker("4.0.5")
    try:
        with pytest.raises(IncompatibleBroker, match=r"\[held\]"):
            broker.declare(make())
    finally:
        broker.close()


def test_exact_retries_through_the_holding_queue_in_the_kit() -> None:
    """retry.backoff on a [held] topology: each retry waits exactly its delay (a copy
    through the holding queue), then the message is parked."""
    start = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)
    topology = make(
        queues={
            "orders.cancel": {
                "retry": {
                    "max_attempts": 4,
                    "backoff": {"initial": "1.5s", "factor": 3.0, "max": "1h"},
                }
            },
            "push": {},
        }
    )
    app = App(topology)

    def handler(_body: dict[str, object], ctx: HandlerContext) -> None:
        raise ValueError("down")

    app.add_consumer("orders.cancel", handler)
    with TestBroker(app, start=start) as broker:
        broker.publisher.publish_delayed({}, queue="orders.cancel", delay=10.25)
        broker.run_until_idle()
        assert broker.outcomes("orders.cancel") == ["retried", "retried", "retried", "parked"]
        handled = broker.handled("orders.cancel")
    offsets = [(r.at - start).total_seconds() for r in handled]
    assert offsets == [10.25, 11.75, 16.25, 29.75]  # + 1.5 s, 4.5 s, 13.5 s: exact


# -- status ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ready", "consumers", "flagged"), [(3, 0, True), (3, 1, False), (0, 0, False)]
)
def test_status_flags_a_holding_queue_that_no_holder_consumes(
    ready: int, consumers: int, flagged: bool
) -> None:
    topology = make()
    names = topology.names
    live = {spec.name: QueueCounts(ready=0, consumers=0) for spec in desired(topology).queues}
    live[names.held_queue()] = QueueCounts(ready=ready, consumers=consumers)
    rows = {row.name: row for row in status_rows(topology, live, None)}
    row = rows[names.held_queue()]
    assert row.role is QueueRole.HOLDING
    assert row.attention is flagged
    if flagged:
        assert "rabbit-delay hold" in row.hints[0]


def test_the_dashboard_draws_the_holding_queue_between_publish_and_due() -> None:
    topology = make()
    names = topology.names
    live = {spec.name: QueueCounts(ready=0, consumers=1) for spec in desired(topology).queues}
    rows = status_rows(topology, live, None)
    status = Status("shop.v1", "amqp://x", "4.3.6", None, 0, rows, (), None, {}, "ok")
    drawn = picture(status, names)
    assert ("publish", names.held_queue()) in drawn.edges
    assert (names.held_queue(), "due") in drawn.edges


def test_status_shows_how_many_are_held_and_the_next_due_time() -> None:
    topology = make()
    names = topology.names
    api_row = {
        "name": names.held_queue(),
        "type": "quorum",
        "messages_ready": 0,
        "messages_unacknowledged": 0,
        "consumers": 2,
        "messages_delayed": 50,
        "next_delayed_at": 1_796_485_463_586,
    }
    counts = counts_from_api(api_row)
    assert (counts.delayed, counts.next_delayed_at) == (50, 1_796_485_463_586)
    live = {spec.name: QueueCounts(ready=0, consumers=1) for spec in desired(topology).queues}
    live[names.held_queue()] = QueueCounts(ready=50, consumers=2)
    rows = {r.name: r for r in status_rows(topology, live, {names.held_queue(): counts})}
    row = rows[names.held_queue()]
    assert (row.held, row.attention) == (50, False)
    assert row.notes == ["50 held, the next due 2026-12-05T15:44:23.586Z"]
    assert row.as_json()["next_due_at"] == "2026-12-05T15:44:23.586Z"
