"""The delayed-message plugin backend, without a broker: declaration arguments, the
order that makes the missing-plugin failure create nothing, and delay validation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rabbit_delay import (
    DeclarationConflict,
    DelayError,
    IncompatibleBroker,
    MissingPluginError,
    Topology,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._durations import MAX_TTL_MS
from rabbit_delay._envelope import outgoing
from rabbit_delay._plan.desired import ExchangeSpec, Kind, desired
from rabbit_delay._plan.diff import Change, ExistingObject, Observed
from rabbit_delay._plan.program import (
    Bind,
    Declare,
    Exists,
    Operation,
    RoutesEveryKey,
    SupportsType,
    declare_program,
    plan_program,
)
from rabbit_delay._plan.refusals import UNKNOWN_EXCHANGE_TYPE
from rabbit_delay._publishing.core import PublisherCore
from rabbit_delay._topology.delays import PLUGIN, Router

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
    out = outgoing(route, b"x", "application/octet-stream", now=10_000)
    assert out.headers[h.H_DUE_AT] == 13_000


# -- the broker's version and an exchange of the wrong inner type --------------------------

BROKER_4_3 = BrokerInfo.from_server_properties({"version": "4.3.6", "cluster_name": "c"})
BROKER_4_0 = BrokerInfo.from_server_properties({"version": "4.0.5", "cluster_name": "c"})


@pytest.mark.parametrize("program", [declare_program, plan_program])
def test_plugin_topology_is_refused_on_4_3_before_any_operation(program: Any) -> None:
    started = program(desired(make()), None, BROKER_4_3)
    with pytest.raises(IncompatibleBroker) as caught:
        next(started)  # not one operation: nothing is asked of the broker
    assert "[cascade]" in str(caught.value)
    assert "4.3.6" in str(caught.value)
    # the same topology is fine on 4.0 (the plugin can run there)
    assert isinstance(next(program(desired(make()), None, BROKER_4_0)), SupportsType)


class PluginPresent:
    """A fake driver for a broker WITH the plugin, where some objects exist and the plugin
    exchange routes every key (fanout) or not (another x-delayed-type), which its
    re-declare cannot tell: the plugin's equivalence check ignores x-delayed-type."""

    def __init__(self, existing: set[str], routes_every_key: bool) -> None:
        self.existing = existing
        self.routes_every_key = routes_every_key
        self.ops: list[Operation] = []

    def __call__(self, op: Operation) -> object:
        self.ops.append(op)
        if isinstance(op, RoutesEveryKey):
            return self.routes_every_key
        if isinstance(op, SupportsType):
            return True
        if isinstance(op, Exists):
            return op.spec.name in self.existing
        return None  # a re-declare is accepted whatever the inner type

    def drive(self, program: Any) -> Any:
        try:
            op = next(program)
            while True:
                op = program.send(self(op))
        except StopIteration as stop:
            return stop.value

    @property
    def creates(self) -> list[str]:
        return [
            o.spec.name
            for o in self.ops
            if isinstance(o, Declare | Bind) and o.spec.name not in self.existing
        ]


def everything(topology: Topology) -> set[str]:
    want = desired(topology)
    return {s.name for s in want.objects}


def test_a_wrong_inner_type_is_a_conflict_without_the_management_api() -> None:
    topology = make()
    n = topology.names
    driver = PluginPresent(everything(topology), routes_every_key=False)
    with pytest.raises(DeclarationConflict) as caught:
        driver.drive(declare_program(desired(topology), None, BROKER_4_0))
    (conflict,) = caught.value.conflicts
    assert (conflict.name, conflict.argument, conflict.wanted) == (
        n.plugin_exchange(),
        "x-delayed-type",
        "fanout",
    )
    assert "not fanout" in str(conflict.on_broker)
    assert driver.creates == []  # nothing created, nothing bound
    probes = [o for o in driver.ops if isinstance(o, RoutesEveryKey)]
    # probed once all presence is known, through the due exchange (it exists)
    assert probes == [RoutesEveryKey(n.plugin_exchange(), n.due_exchange())]


def test_plan_reports_a_wrong_inner_type_as_a_conflict_never_in_place() -> None:
    topology = make()
    driver = PluginPresent(everything(topology), routes_every_key=False)
    plan = driver.drive(plan_program(desired(topology), None, BROKER_4_0))
    item = next(i for i in plan.items if i.name == topology.names.plugin_exchange())
    assert item.action is Change.CONFLICT
    assert not plan.in_sync


def test_a_fanout_plugin_exchange_is_in_place_after_the_probe() -> None:
    topology = make()
    driver = PluginPresent(everything(topology), routes_every_key=True)
    report = driver.drive(declare_program(desired(topology), None, BROKER_4_0))
    item = next(i for i in report.items if i.name == topology.names.plugin_exchange())
    assert item.action is Change.IN_PLACE
    assert not report.changed


def test_without_the_due_exchange_the_probe_does_not_route_through_it() -> None:
    topology = make()
    n = topology.names
    driver = PluginPresent({n.plugin_exchange()}, routes_every_key=True)
    driver.drive(declare_program(desired(topology), None, BROKER_4_0))
    assert [o for o in driver.ops if isinstance(o, RoutesEveryKey)] == [
        RoutesEveryKey(n.plugin_exchange(), None)
    ]


def test_no_probe_when_the_management_api_shows_the_arguments() -> None:
    topology = make()
    n = topology.names
    observed = Observed(
        exchanges={
            n.plugin_exchange(): ExistingObject({"x-delayed-type": "direct"}, True, PLUGIN_TYPE)
        },
        queues={},
        bindings=frozenset(),
    )
    driver = PluginPresent({n.plugin_exchange()}, routes_every_key=True)
    with pytest.raises(DeclarationConflict) as caught:
        driver.drive(declare_program(desired(topology), observed, BROKER_4_0))
    assert [(c.argument, c.on_broker) for c in caught.value.conflicts] == [
        ("x-delayed-type", "direct")
    ]
    assert not any(isinstance(o, RoutesEveryKey) for o in driver.ops)


@pytest.mark.parametrize(
    "reply",
    [
        "COMMAND_INVALID - unknown exchange type 'x-delayed-message'",  # 3.x, 503
        "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'",  # 4.x, 406
        "PRECONDITION_FAILED - invalid exchange type 'x-delayed-message'",  # plugin disabled
    ],
)
def test_every_missing_plugin_reply_is_recognised(reply: str) -> None:
    assert UNKNOWN_EXCHANGE_TYPE.search(reply)
    assert not UNKNOWN_EXCHANGE_TYPE.search("PRECONDITION_FAILED - inequivalent arg 'type'")
