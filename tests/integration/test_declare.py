"""Declaring a topology on the real broker, through both transports.

What was declared is checked ON THE BROKER through the management API, against names
and arguments written out here, not against `desired()` (which is what is under test).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pika
import pytest

from rabbit_delay import DeclarationConflict, Topology
from rabbit_delay._broker import BrokerInfo, normalise_queue_arguments
from rabbit_delay._errors import ArgumentConflict
from rabbit_delay._io.management import read_observed
from rabbit_delay._plan.desired import Kind
from rabbit_delay._plan.diff import Change
from rabbit_delay._urls import ManagementEndpoint

from ._publishers import Transport, broker_state, delete_queue, open_transport, queue_info

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sync", "aio"])
def transport(request: pytest.FixtureRequest, broker_url: str) -> Iterator[Transport]:
    with open_transport(request.param, broker_url) as opened:
        yield opened


def observed_or_none(
    use_management: bool, management: ManagementEndpoint, topology: Topology
) -> Any:
    return read_observed(management, topology.names.prefix + ".") if use_management else None


def expected(
    p: str, quorum: bool, broker: BrokerInfo
) -> tuple[dict[str, Any], dict[str, Any], set[tuple[str, str, str, str]]]:
    """(queues name -> arguments, exchanges name -> (type, arguments), bindings) for the
    conftest default topology under prefix `p`, as the broker reports them: 4.x records
    x-queue-type=classic on a classic queue declared without it, 3.x records nothing."""
    if quorum:
        # placement ([scaling], default leader_locator = "balanced"), on every quorum queue
        q: dict[str, Any] = {"x-queue-type": "quorum", "x-queue-leader-locator": "balanced"}
    else:
        q = {"x-queue-type": "classic"} if broker.at_least(4) else {}
    dlx = (
        {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish", **q}
        if quorum
        else q
    )
    limit = {"x-delivery-limit": 10} if quorum else {}
    # parking lots and the catch-all: explicit, huge limit (4.0 drops after 20 requeues)
    human = {**q, "x-delivery-limit": 1_000_000} if quorum else q
    queues = {
        f"{p}.unroutable": human,
        f"{p}.delay.1s": {**dlx, "x-dead-letter-exchange": f"{p}.due", "x-message-ttl": 1000},
        f"{p}.delay.3s": {**dlx, "x-dead-letter-exchange": f"{p}.due", "x-message-ttl": 3000},
        f"{p}.q.orders.cancel": {
            **dlx,
            "x-dead-letter-exchange": f"{p}.parking",
            "x-dead-letter-routing-key": f"{p}.q.orders.cancel",
            **limit,
        },
        f"{p}.q.push": {
            **dlx,
            "x-dead-letter-exchange": f"{p}.parking",
            "x-dead-letter-routing-key": f"{p}.q.push",
            **limit,
        },
        f"{p}.parking.orders.cancel": human,
        f"{p}.parking.push": human,
    }
    exchanges = {
        f"{p}.unroutable": ("fanout", {}),
        f"{p}.due": ("direct", {"alternate-exchange": f"{p}.unroutable"}),
        f"{p}.parking": ("direct", {"alternate-exchange": f"{p}.unroutable"}),
        f"{p}.delay.1s": ("fanout", {}),
        f"{p}.delay.3s": ("fanout", {}),
    }
    bindings = {
        (f"{p}.unroutable", f"{p}.unroutable", "queue", ""),
        (f"{p}.delay.1s", f"{p}.delay.1s", "queue", ""),
        (f"{p}.delay.3s", f"{p}.delay.3s", "queue", ""),
        (f"{p}.due", f"{p}.q.orders.cancel", "queue", f"{p}.q.orders.cancel"),
        (f"{p}.due", f"{p}.q.push", "queue", f"{p}.q.push"),
        (f"{p}.due", f"{p}.q.push", "queue", "push.any"),
        (f"{p}.parking", f"{p}.parking.orders.cancel", "queue", f"{p}.q.orders.cancel"),
        (f"{p}.parking", f"{p}.parking.push", "queue", f"{p}.q.push"),
    }
    return queues, exchanges, bindings


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_declare_creates_exactly_the_topology(
    transport: Transport,
    make_topology: Any,
    management: ManagementEndpoint,
    broker_info: BrokerInfo,
    queue_type: str,
) -> None:
    topology: Topology = make_topology(queue_type=queue_type)
    prefix = topology.names.prefix
    report = transport.declare(topology)

    want_queues, want_exchanges, want_bindings = expected(
        prefix, queue_type == "quorum", broker_info
    )
    state = broker_state(management, prefix + ".")
    assert set(state.queues) == set(want_queues)
    assert set(state.exchanges) == set(want_exchanges)
    assert state.bindings == want_bindings
    for name, arguments in want_queues.items():
        info = queue_info(management, name)  # /api/queues/%2F/<name>
        assert info["arguments"] == arguments, name
        assert info["durable"] is True, name
        assert info["auto_delete"] is False, name
        assert info["exclusive"] is False, name
        assert info["type"] == queue_type, name
    for name, (kind, arguments) in want_exchanges.items():
        assert state.exchanges[name] == {"type": kind, "arguments": arguments, "durable": True}, (
            name
        )

    created = {(i.kind, i.name) for i in report.created}
    assert created == {(Kind.QUEUE, n) for n in want_queues} | {
        (Kind.EXCHANGE, n) for n in want_exchanges
    }
    assert report.changed


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("use_management", [True, False], ids=["management", "passive"])
def test_redeclare_is_a_no_op_and_everything_is_in_place(
    transport: Transport,
    make_topology: Any,
    management: ManagementEndpoint,
    use_management: bool,
    queue_type: str,
) -> None:
    """On every version: 4.x adds x-queue-type=classic to a classic queue by itself, which
    must not read as a conflict."""
    topology: Topology = make_topology(queue_type=queue_type)
    prefix = topology.names.prefix + "."
    transport.declare(topology)
    before = broker_state(management, prefix)

    report = transport.declare(
        topology, observed=observed_or_none(use_management, management, topology)
    )

    assert not report.changed
    assert report.created == ()
    objects = [i for i in report.items if i.kind is not Kind.BINDING]
    bindings = [i for i in report.items if i.kind is Kind.BINDING]
    assert len(objects) == 12
    assert len(bindings) == 8
    assert {i.action for i in objects} == {Change.IN_PLACE}
    assert {i.action for i in bindings} == (
        {Change.IN_PLACE} if use_management else {Change.ENSURE}
    )
    assert broker_state(management, prefix) == before

    plan = transport.plan(topology, observed=observed_or_none(use_management, management, topology))
    assert plan.in_sync
    assert plan.conflicts == ()


@pytest.mark.parametrize("use_management", [True, False], ids=["management", "passive"])
def test_plan_changes_nothing(
    transport: Transport, make_topology: Any, management: ManagementEndpoint, use_management: bool
) -> None:
    topology: Topology = make_topology()
    prefix = topology.names.prefix + "."
    plan = transport.plan(topology, observed=observed_or_none(use_management, management, topology))
    assert not plan.in_sync
    assert {i.action for i in plan.items if i.kind is not Kind.BINDING} == {Change.CREATE}
    assert len(plan.pending) == 12 + (8 if use_management else 0)
    assert broker_state(management, prefix).names == set()


@pytest.mark.parametrize("use_management", [True, False], ids=["management", "passive"])
@pytest.mark.parametrize("missing", [Kind.EXCHANGE, Kind.QUEUE])
def test_one_of_a_tier_exchange_and_its_buffer_missing_is_recreated(
    transport: Transport,
    make_topology: Any,
    management: ManagementEndpoint,
    broker_url: str,
    use_management: bool,
    missing: Kind,
) -> None:
    """The tier exchange and its buffer queue share a name; only one of them is gone."""
    topology: Topology = make_topology()
    prefix = topology.names.prefix + "."
    name = topology.names.tier_queue("1s")
    transport.declare(topology)
    before = broker_state(management, prefix)
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        if missing is Kind.QUEUE:
            connection.channel().queue_delete(name)
        else:
            connection.channel().exchange_delete(name)
    finally:
        connection.close()

    plan = transport.plan(topology, observed=observed_or_none(use_management, management, topology))
    assert [(i.kind, i.name) for i in plan.pending if i.kind is not Kind.BINDING] == [
        (missing, name)
    ]

    report = transport.declare(
        topology, observed=observed_or_none(use_management, management, topology)
    )
    assert [(i.kind, i.name) for i in report.created if i.kind is not Kind.BINDING] == [
        (missing, name)
    ]
    assert broker_state(management, prefix) == before


QUORUM_1S = {
    "x-queue-type": "quorum",
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
}


@pytest.mark.parametrize("use_management", [True, False], ids=["management", "passive"])
@pytest.mark.parametrize("existing", ["other-ttl", "classic"])
def test_conflicting_queue_is_reported_and_nothing_changes(
    transport: Transport,
    make_topology: Any,
    management: ManagementEndpoint,
    broker_url: str,
    use_management: bool,
    existing: str,
) -> None:
    topology: Topology = make_topology()
    prefix = topology.names.prefix
    buffer = f"{prefix}.delay.1s"
    due = f"{prefix}.due"
    if existing == "other-ttl":
        arguments: dict[str, Any] = {
            **QUORUM_1S,
            "x-dead-letter-exchange": due,
            "x-message-ttl": 5000,
        }
        # (argument, on the broker, wanted): the broker's 406 names one; the management API all
        possible = {("x-message-ttl", 5000, 1000)}
        via_management = possible
    else:
        arguments = {"x-dead-letter-exchange": due, "x-message-ttl": 1000}
        possible = {
            ("x-queue-type", None, "quorum"),  # the broker's 406 on 3.x
            ("x-queue-type", "classic", "quorum"),  # 4.x, and the management API
            ("x-dead-letter-strategy", None, "at-least-once"),
            ("x-overflow", None, "reject-publish"),
        }
        via_management = possible - {("x-queue-type", None, "quorum")}
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        connection.channel().queue_declare(buffer, durable=True, arguments=arguments)
    finally:
        connection.close()
    before = broker_state(management, prefix + ".")
    assert set(before.queues) == {buffer}
    assert not before.exchanges

    with pytest.raises(DeclarationConflict) as info:
        transport.declare(topology, observed=observed_or_none(use_management, management, topology))

    conflicts = info.value.conflicts
    assert conflicts, "a conflict must be reported"
    found = {(c.argument, c.on_broker, c.wanted) for c in conflicts}
    assert found <= possible
    if use_management:
        assert found == via_management
    assert all(
        isinstance(c, ArgumentConflict) and (c.kind, c.name) == ("queue", buffer) for c in conflicts
    )
    message = str(info.value)
    for argument, on_broker, wanted in found:
        assert f"queue '{buffer}'" in message
        assert f"argument '{argument}' is {on_broker!r} on the broker" in message
        assert f"the topology wants {wanted!r}" in message
    assert "Nothing was changed" in message

    after = broker_state(management, prefix + ".")
    assert after == before, "no other object of the topology may be created"
    assert normalise_queue_arguments(
        queue_info(management, buffer)["arguments"]
    ) == normalise_queue_arguments(arguments)

    plan = transport.plan(topology, observed=observed_or_none(use_management, management, topology))
    assert not plan.in_sync
    delete_queue(broker_url, buffer)


def test_conflicting_exchange_type(
    transport: Transport, make_topology: Any, management: ManagementEndpoint, broker_url: str
) -> None:
    topology: Topology = make_topology()
    due = topology.names.due_exchange()
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        connection.channel().exchange_declare(due, "topic", durable=True)
    finally:
        connection.close()
    with pytest.raises(DeclarationConflict) as info:
        transport.declare(topology)
    assert ("exchange", due, "type", "topic", "direct") in {
        (c.kind, c.name, c.argument, c.on_broker, c.wanted) for c in info.value.conflicts
    }
    assert broker_state(management, topology.names.prefix + ".").names == {due}


def test_plan_and_declare_leave_no_channel_open(
    transport: Transport, make_topology: Any, broker_url: str
) -> None:
    """Each probe of a missing object costs a channel (the broker closes it with 404): none
    may stay open, nor be reopened behind our back by aio-pika's robust channels."""
    topology: Topology = make_topology()
    transport.plan(topology)
    transport.declare(topology)
    delete_queue(broker_url, topology.names.tier_queue("3s"))
    transport.plan(topology)
    transport.declare(topology)
    assert transport.open_channels() == 0
