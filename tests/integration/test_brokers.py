"""What differs between RabbitMQ versions and brokers, on real brokers: the management
API of another broker is never trusted, the plugin exchange's routing probe, and the
broker's version in `status`. Runs against whatever broker is under test
(RABBIT_DELAY_TEST_URL), and starts a second broker of the same version where needed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import message_count
from typer.testing import CliRunner, Result

from rabbit_delay import Topology, aio
from rabbit_delay._aio.declarer import run_program as aio_run_program
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._cli.app import app
from rabbit_delay._io.management import checked
from rabbit_delay._plan.desired import desired
from rabbit_delay._plan.program import Operation, RoutesEveryKey
from rabbit_delay._sync.declarer import run_program
from rabbit_delay._urls import MANAGEMENT_URL_ENV, URL_ENV, ManagementEndpoint, management_endpoints
from rabbit_delay.sync import connect

from ._publishers import broker_state, toml_for
from ._scratch_node import ScratchNode, scratch_kind, started_node

pytestmark = pytest.mark.integration


def cli(*args: str) -> Result:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (URL_ENV, MANAGEMENT_URL_ENV, "RABBIT_DELAY_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)


# -- the management API must serve the broker of the AMQP connection -----------------------


def test_the_management_api_of_the_broker_under_test_is_found_and_proven(
    broker_url: str, broker_info: BrokerInfo
) -> None:
    access = checked(management_endpoints(broker_url), broker_info)
    assert access.endpoint is not None, access.note
    assert f"cluster {broker_info.cluster_name!r}" in access.note


def test_a_management_api_of_another_broker_is_not_used(
    broker_info: BrokerInfo, management: ManagementEndpoint
) -> None:
    other = BrokerInfo(version_text=broker_info.version_text, cluster_name="rabbit@elsewhere")
    access = checked([management], other)
    assert access.endpoint is None
    assert "serves another broker" in access.note
    assert "rabbit@elsewhere" in access.note
    unreachable = ManagementEndpoint("http://127.0.0.1:1", "guest", "guest", "/")
    assert checked([unreachable], broker_info).endpoint is None
    # the first candidate that proves itself wins, whatever comes before it
    assert checked([unreachable, management], broker_info).endpoint == management


@pytest.fixture(scope="module")
def second_broker(broker_url: str) -> Iterator[ScratchNode]:
    """A second broker of the version under test, on other ports, WITHOUT a management
    API: the API a client derives for it (port + 10000, then 15672) is another broker's
    or nothing, as in the issue (AMQP on 5675, API read from the broker on 5672)."""
    with started_node(scratch_kind(broker_url)) as node:
        yield node


def _objects_on(node: ScratchNode, topology: Topology) -> set[str]:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    found = set()
    try:
        for spec in desired(topology).objects:
            ch = conn.channel()
            try:
                if spec.kind.value == "queue":
                    ch.queue_declare(spec.name, passive=True)
                else:
                    ch.exchange_declare(spec.name, passive=True)
                found.add(spec.name)
            except pika.exceptions.ChannelClosedByBroker:
                pass
            finally:
                if ch.is_open:
                    ch.close()
    finally:
        conn.close()
    return found


def _delete_on(node: ScratchNode, topology: Topology) -> None:
    from rabbit_delay._ops.delete.execute import delete_topology

    conn = connect(node.url)
    try:
        delete_topology(conn, topology)
    finally:
        conn.close()


@pytest.mark.parametrize("how", ["derived", "--management-url"])
# One xdist worker runs both, so they share the module's second broker (apart, each
# worker started one).
@pytest.mark.xdist_group("second-broker")
def test_declare_on_a_second_broker_never_reads_another_brokers_management_api(
    second_broker: ScratchNode,
    make_topology: Any,
    broker_url: str,
    management: ManagementEndpoint,
    tmp_path: Path,
    how: str,
) -> None:
    """The topology exists on the broker under test (whose API is the one a client would
    read); the second broker holds only a conflicting queue. `declare` must see the
    second broker as it is: exit 1, create nothing there, say why the API was not used.
    Then, with the conflict gone, declare there and plan says in sync."""
    topology: Topology = make_topology()
    path = tmp_path / "t.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    assert cli("declare", str(path), "--url", broker_url).exit_code == 0  # on the other one
    extra = ["--management-url", management.base] if how == "--management-url" else []
    buffer = topology.names.tier_queue("1s")
    conn = pika.BlockingConnection(pika.URLParameters(second_broker.url))
    try:
        conn.channel().queue_declare(
            buffer, durable=True, arguments={"x-queue-type": "quorum", "x-message-ttl": 5000}
        )
    finally:
        conn.close()
    try:
        result = cli("declare", str(path), "--url", second_broker.url, *extra)
        assert result.exit_code == 1, result.stdout + result.stderr
        assert f"queue '{buffer}'" in result.stderr
        assert "Nothing was changed" in result.stderr
        assert "passive declares" in result.stdout
        assert "management API not used" in result.stdout
        assert _objects_on(second_broker, topology) == {buffer}  # nothing created

        as_json = json.loads(
            cli("plan", str(path), "--url", second_broker.url, "--json", *extra).stdout
        )
        assert as_json["source"].startswith("passive declares")

        _delete_on(second_broker, topology)
        declared = cli("declare", str(path), "--url", second_broker.url, *extra)
        assert declared.exit_code == 0, declared.stderr
        assert "object(s) created" in declared.stdout
        assert _objects_on(second_broker, topology) == {s.name for s in desired(topology).objects}
        in_sync = cli("plan", str(path), "--url", second_broker.url, *extra)
        assert in_sync.exit_code == 0, in_sync.stdout
        assert "in sync" in in_sync.stdout
    finally:
        _delete_on(second_broker, topology)
    # and the broker whose API was offered is untouched: the topology as declared there
    assert len(broker_state(management, topology.names.prefix + ".").queues) == 7


# -- the routing probe behind the plugin exchange's x-delayed-type check -------------------


def _probe(op: RoutesEveryKey) -> Generator[Operation, object, object]:
    return (yield op)


@pytest.fixture
def probe_exchanges(make_topology: Any, broker_url: str) -> Iterator[tuple[Topology, str, str]]:
    """A declared topology plus a fanout and a direct exchange bound into its due
    exchange with key "": what the plugin exchange looks like with x-delayed-type fanout
    (right) and direct (wrong). The probe does not depend on the plugin: without an
    x-delay header the plugin routes at once, as these exchanges do."""
    topology: Topology = make_topology()
    conn = connect(broker_url)
    prefix = topology.names.prefix
    fanout, direct = f"{prefix}.probe-fanout", f"{prefix}.probe-direct"
    try:
        from rabbit_delay.sync import declare

        declare(conn, topology)
        ch = conn.channel()
        for name, kind in ((fanout, "fanout"), (direct, "direct")):
            ch.exchange_declare(name, kind, durable=True)
            ch.exchange_bind(topology.names.due_exchange(), name, routing_key="")
        ch.close()
    finally:
        conn.close()
    yield topology, fanout, direct
    conn = connect(broker_url)
    try:
        for name in (fanout, direct):
            conn.channel().exchange_delete(name)
    finally:
        conn.close()


@pytest.mark.parametrize("transport", ["sync", "aio"])
def test_the_routing_probe_tells_fanout_from_direct_and_leaves_nothing(
    probe_exchanges: tuple[Topology, str, str], broker_url: str, transport: str
) -> None:
    topology, fanout, direct = probe_exchanges
    due = topology.names.due_exchange()
    # (the program probes with due=None only when the due exchange does not exist, so
    # nothing can be bound into it: a fanout bound into it is only probed through it)
    cases = [
        (RoutesEveryKey(fanout, due), True),
        (RoutesEveryKey(direct, due), False),
        (RoutesEveryKey(direct, None), False),
    ]
    for op, routes in cases:
        if transport == "sync":
            conn = connect(broker_url)
            try:
                assert run_program(conn, _probe(op)) is routes, op
            finally:
                conn.close()
        else:

            async def run(op: RoutesEveryKey = op) -> object:
                conn = await aio.connect(broker_url)
                try:
                    return await aio_run_program(conn, _probe(op))
                finally:
                    await conn.close()

            assert asyncio.run(run()) is routes, op
    # the probes reached no catch-all and no business queue
    n = topology.names
    for queue in (
        n.unroutable_queue(),
        n.business_queue("push"),
        n.business_queue("orders.cancel"),
    ):
        assert message_count(broker_url, queue) == 0, queue


# -- status names the broker ---------------------------------------------------------------


def test_status_shows_the_brokers_version(
    make_topology: Any, broker_url: str, broker_info: BrokerInfo, tmp_path: Path
) -> None:
    topology: Topology = make_topology()
    path = tmp_path / "t.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    assert cli("declare", str(path), "--url", broker_url).exit_code == 0
    data = json.loads(cli("status", str(path), "--url", broker_url, "--json").stdout)
    assert data["broker_version"] == broker_info.version_text
    assert data["management_api"] == "ok"
    table = cli("status", str(path), "--url", broker_url)
    assert f"RabbitMQ {broker_info.version_text}" in table.stdout
