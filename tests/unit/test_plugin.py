"""The delayed-message plugin backend, without a broker: declaration arguments, the
order that makes the missing-plugin failure create nothing, and delay validation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rabbit_delay import names as h
from rabbit_delay.delays import PLUGIN, Router
from rabbit_delay.durations import MAX_TTL_MS
from rabbit_delay.errors import DelayError, MissingPluginError
from rabbit_delay.plan import (
    Bind,
    Declare,
    ExchangeSpec,
    ExistingObject,
    Exists,
    Kind,
    Observed,
    Operation,
    declare_program,
    desired,
)
from rabbit_delay.publishing import PublisherCore
from rabbit_delay.topology import Topology, topology_from_dict

PLUGIN_TYPE = "x-delayed-message"


BASE: dict[str, Any] = {
    "namespace": "shop",
    "tiers": {"5s": "5s"},
    "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}},
}


def make(plugin: dict[str, Any] | None = None) -> Topology:
    return topology_from_dict({**BASE, "plugin": plugin or {}})


# -- declarations -------------------------------------------------------------------------


def test_plugin_exchange_arguments() -> None:
    topology = make()
    n = topology.names
    want = desired(topology)
    (x,) = [e for e in want.exchanges if e.name == n.plugin_exchange()]
    assert x.type == PLUGIN_TYPE
    assert x.durable
    # A pure delay stage: fanout, and no alternate-exchange (the plugin's route returns no
    # queue while it holds a message, so an AE would get a copy of EVERY message).
    assert dict(x.arguments) == {"x-delayed-type": "fanout"}
    assert want.exchanges[0] is x  # declared first: a missing plugin stops declare at once


def test_due_plugin_messages_go_through_the_due_exchange_to_reach_the_catch_all() -> None:
    topology = make()
    n = topology.names
    want = desired(topology)
    got = {
        (b.destination, b.destination_type, b.routing_key)
        for b in want.bindings
        if b.source == n.plugin_exchange()
    }
    # One binding, whatever the keys: routing by key happens in the due exchange only, so
    # no per-key binding of the plugin exchange can be missing.
    assert got == {(n.due_exchange(), Kind.EXCHANGE, "")}
    (due,) = [e for e in want.exchanges if e.name == n.due_exchange()]
    assert due.arguments["alternate-exchange"] == n.unroutable_exchange()
    # ... and the due exchange reaches the business queues by the same keys.
    due_keys = {
        (b.destination, b.routing_key) for b in want.bindings if b.source == n.due_exchange()
    }
    assert (n.business_queue("push"), "push.any") in due_keys


def test_a_binding_key_shared_by_two_queues_reaches_both_through_the_due_exchange() -> None:
    topology = topology_from_dict(
        {**BASE, "queues": {"a": {"bindings": ["all"]}, "b": {"bindings": ["all"]}}, "plugin": {}}
    )
    n = topology.names
    due = {
        (b.destination, b.routing_key)
        for b in desired(topology).bindings
        if b.source == n.due_exchange()
    }
    assert {(n.business_queue("a"), "all"), (n.business_queue("b"), "all")} <= due


def test_plugin_adds_no_queue_and_no_cascade() -> None:
    with_plugin = desired(make())
    without = desired(topology_from_dict(BASE))
    assert with_plugin.queues == without.queues
    assert len(with_plugin.exchanges) == len(without.exchanges) + 1


def test_plugin_exchange_is_the_first_object_declared() -> None:
    assert desired(make()).objects[0].name == make().names.plugin_exchange()


class Refusing:
    """A fake driver for a broker without the plugin: declaring the x-delayed-message
    exchange raises what the pika/aio-pika drivers raise on the 503 connection close."""

    def __init__(self, existing: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.existing = existing
        self.ops: list[Operation] = []

    def __call__(self, op: Operation) -> object:
        self.ops.append(op)
        if (
            isinstance(op, Declare)
            and isinstance(op.spec, ExchangeSpec)
            and op.spec.type == PLUGIN_TYPE
        ):
            raise MissingPluginError("unknown exchange type 'x-delayed-message'")
        if isinstance(op, Exists):
            return op.spec.name in self.existing
        return None

    def run(self, observed: Observed | None = None) -> None:
        program = declare_program(desired(make()), observed)
        op = next(program)
        while True:
            op = program.send(self(op))

    @property
    def changes(self) -> list[Operation]:
        """Operations that create or bind something (a Declare of an existing object is a check)."""
        return [
            o
            for o in self.ops
            if isinstance(o, Bind) or (isinstance(o, Declare) and o.spec.name not in self.existing)
        ]


def test_missing_plugin_fails_before_anything_is_created() -> None:
    driver = Refusing()
    with pytest.raises(MissingPluginError):
        driver.run()
    # The only change attempted is the plugin exchange itself, and it failed.
    assert [o.spec.name for o in driver.changes] == [make().names.plugin_exchange()]


def test_missing_plugin_fails_first_when_other_objects_already_exist() -> None:
    n = make().names
    driver = Refusing({n.unroutable_exchange(), n.due_exchange(), n.unroutable_queue()})
    with pytest.raises(MissingPluginError):
        driver.run()
    assert [o.spec.name for o in driver.changes] == [n.plugin_exchange()]


def test_missing_plugin_fails_first_with_the_management_api_view() -> None:
    n = make().names
    observed = Observed(
        exchanges={
            n.due_exchange(): ExistingObject(
                {"alternate-exchange": n.unroutable_exchange()}, True, "direct"
            )
        },
        queues={},
        bindings=frozenset(),
    )
    driver = Refusing({n.due_exchange()})
    with pytest.raises(MissingPluginError):
        driver.run(observed)
    assert [o.spec.name for o in driver.changes] == [n.plugin_exchange()]


# -- routes and validation ----------------------------------------------------------------


def test_route_publishes_to_the_plugin_exchange_with_x_delay() -> None:
    topology = make()
    route = Router(topology).resolve(topology.names.queue_key("push"), delay_ms=1_234)
    assert route.exchange == topology.names.plugin_exchange()
    assert route.routing_key == topology.names.queue_key("push")
    assert route.tier == PLUGIN
    assert route.headers == {h.H_PLUGIN_DELAY: 1_234}
    assert (
        route.mandatory is False
    )  # the plugin cannot honour mandatory: it would return every message


def test_binding_keys_are_allowed_through_the_plugin() -> None:
    topology = make()
    route = PublisherCore(topology).route(routing_key="push.any", delay=2.5)
    assert (route.routing_key, route.delay_ms) == ("push.any", 2_500)


def test_exact_tier_still_wins() -> None:
    topology = make()
    assert Router(topology).resolve(topology.names.queue_key("push"), delay_ms=5_000).tier == "5s"


@pytest.mark.parametrize("delay_ms", [1, 999, MAX_TTL_MS])
def test_delays_inside_the_plugin_bounds_are_accepted(delay_ms: int) -> None:
    topology = make()
    assert Router(topology).resolve(
        topology.names.queue_key("push"), delay_ms=delay_ms
    ).headers == {h.H_PLUGIN_DELAY: delay_ms}


@pytest.mark.parametrize(
    ("delay", "match"),
    [
        (0, "at least 1 ms"),
        (timedelta(0), "at least 1 ms"),
        (-1, "negative"),
        (timedelta(milliseconds=MAX_TTL_MS + 1), "exceeds the plugin maximum"),
        (50 * 86_400, "exceeds the plugin maximum"),
    ],
)
def test_delays_the_plugin_would_deliver_at_once_are_refused(
    delay: timedelta | int, match: str
) -> None:
    # The plugin delivers any x-delay outside 1..2^32-1 ms immediately, silently.
    with pytest.raises(DelayError, match=match):
        PublisherCore(make()).route(queue="push", delay=delay)


def test_sub_millisecond_delays_round_up_to_one_millisecond() -> None:
    route = PublisherCore(make()).route(queue="push", delay=0.0001)
    assert route.headers == {h.H_PLUGIN_DELAY: 1}


def test_past_and_naive_at_are_refused() -> None:
    core = PublisherCore(make())
    with pytest.raises(DelayError, match="in the past"):
        core.route(queue="push", at=datetime.now(UTC) - timedelta(milliseconds=1))
    with pytest.raises(DelayError, match="no timezone"):
        core.route(queue="push", at=datetime(2100, 1, 1))


def test_outgoing_message_carries_x_delay_as_an_integer() -> None:
    core = PublisherCore(make())
    out = core.prepare({"order": 1}, queue="orders.cancel", delay=timedelta(seconds=90))
    assert out.headers[h.H_PLUGIN_DELAY] == 90_000
    assert isinstance(out.headers[h.H_PLUGIN_DELAY], int)
    assert out.headers[h.H_TIER] == PLUGIN
    assert out.headers[h.H_DELAY_MS] == 90_000
    assert out.mandatory is False


def test_due_at_is_publish_time_plus_delay() -> None:
    core = PublisherCore(make())
    route = core.route(queue="push", delay=3)
    out = core.outgoing(route, b"x", "application/octet-stream", now=10_000)
    assert out.headers[h.H_DUE_AT] == 13_000
