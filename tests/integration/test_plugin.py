"""The delayed-message plugin backend on real brokers.

Two kinds of tests:
- against the broker under test, which has NO plugin (the usual case here and in CI):
  the missing plugin is a clear error from `declare` (library and CLI), nothing is
  created half-way, and a publisher fails cleanly. What "missing" looks like depends on
  the version: 3.x closes the connection (503), 4.0-4.2 the channel (406), and on 4.3+,
  where the plugin cannot run at all, rabbit-delay refuses before asking the broker;
- against a broker WITH the plugin, named by RABBIT_DELAY_PLUGIN_URL (e.g. the
  docker-compose one): skipped with that reason otherwise. Bounds: never early; late by
  at most LATE_BOUND_MS after `rd-due-at` (the plugin's timer has millisecond
  resolution, so `rd-due-at` is the requested time).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from rabbit_delay import (
    DeclarationConflict,
    IncompatibleBroker,
    MissingObjectError,
    MissingPluginError,
    Topology,
    aio,
    topology_from_dict,
)
from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._io.management import read_observed
from rabbit_delay._plan.desired import ExchangeSpec, QueueSpec, desired
from rabbit_delay._plan.program import Operation, SupportsType
from rabbit_delay._sync.declarer import run_program
from rabbit_delay._urls import ManagementEndpoint
from rabbit_delay.sync import Publisher, connect, declare, plan

from ._scratch_node import Collector

pytestmark = pytest.mark.integration

PLUGIN_URL_ENV = "RABBIT_DELAY_PLUGIN_URL"
LATE_BOUND_MS = 750
ENABLE_HINT = "rabbitmq-plugins enable rabbitmq_delayed_message_exchange"
CASCADE_HINT = "Replace the [plugin] table with [cascade]"


def no_plugin(info: BrokerInfo) -> tuple[type[Exception], str]:
    """The error a [plugin] topology meets on this broker without the plugin, and the
    hint it must carry."""
    if info.supports_plugin:
        return MissingPluginError, ENABLE_HINT
    return IncompatibleBroker, CASCADE_HINT


def plugin_data(namespace: str | None = None) -> dict[str, Any]:
    return {
        "namespace": namespace or "t" + uuid.uuid4().hex[:10],
        "tiers": {"1h": "1h"},
        "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}},
        "plugin": {},
    }


def exists(url: str, spec: ExchangeSpec | QueueSpec) -> bool:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        if isinstance(spec, ExchangeSpec):
            ch.exchange_declare(spec.name, passive=True)
        else:
            ch.queue_declare(spec.name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
        return False
    finally:
        if conn.is_open:
            conn.close()
    return True


# -- a broker without the plugin (this machine's) -----------------------------------------


@pytest.mark.parametrize("view", ["passive declares", "management API"])
@pytest.mark.parametrize("transport", ["sync", "aio"])
def test_declare_without_the_plugin_is_a_clear_error_and_creates_nothing(
    broker_url: str,
    broker_info: BrokerInfo,
    make_topology: Callable[..., Topology],
    management: ManagementEndpoint,
    view: str,
    transport: str,
) -> None:
    topology = make_topology(**plugin_data())
    observed = None
    if view == "management API":
        observed = read_observed(management, topology.names.prefix + ".")
    error, hint = no_plugin(broker_info)
    if transport == "sync":
        conn = connect(broker_url)
        try:
            with pytest.raises(error) as caught:
                declare(conn, topology, observed=observed)
            # 3.x closes the whole connection (503); 4.x only a channel: still usable
            assert conn.is_open == broker_info.at_least(4)
        finally:
            if conn.is_open:
                conn.close()
    else:

        async def run() -> pytest.ExceptionInfo[Exception]:
            conn = await aio.connect(broker_url)
            try:
                with pytest.raises(error) as caught:
                    await aio.declare(conn, topology, observed=observed)
                return caught
            finally:
                await conn.close()

        caught = asyncio.run(run())
    message = str(caught.value)
    assert hint in message
    assert "[cascade]" in message
    if error is MissingPluginError:
        assert "exchange type 'x-delayed-message'" in message
    created = [spec.name for spec in desired(topology).objects if exists(broker_url, spec)]
    assert created == []


def test_switching_an_existing_topology_to_the_plugin_changes_nothing(
    broker_url: str, broker_info: BrokerInfo, make_topology: Callable[..., Topology]
) -> None:
    data = plugin_data()
    tiers_only = make_topology(**{k: v for k, v in data.items() if k != "plugin"})
    conn = connect(broker_url)
    declare(conn, tiers_only)
    conn.close()
    with_plugin = make_topology(**data)
    conn = connect(broker_url)
    try:
        with pytest.raises(no_plugin(broker_info)[0]):
            declare(conn, with_plugin)
    finally:
        if conn.is_open:
            conn.close()
    assert not exists(broker_url, desired(with_plugin).exchanges[0])  # the plugin exchange
    assert all(exists(broker_url, spec) for spec in desired(tiers_only).objects)


def test_cli_declare_without_the_plugin_exits_non_zero(
    broker_url: str, broker_info: BrokerInfo, make_topology: Callable[..., Topology], tmp_path: Path
) -> None:
    cli = Path(sys.executable).parent / "rabbit-delay"
    if not cli.exists():
        pytest.skip(f"{cli} is not installed (pip install -e .)")
    topology = make_topology(**plugin_data())  # for cleanup; the file declares the same names
    file = tmp_path / "plugin.toml"
    file.write_text(
        f'namespace = "{topology.namespace}"\n'
        '[tiers]\n1h = "1h"\n'
        '[queues."orders.cancel"]\n'
        "[plugin]\n"
    )
    for extra in ([], ["--no-management"]):
        done = subprocess.run(
            [str(cli), "declare", str(file), "--url", broker_url, *extra],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert "delayed" in done.stderr
        assert no_plugin(broker_info)[1] in done.stderr
        assert "Traceback" not in done.stderr
    assert not any(exists(broker_url, spec) for spec in desired(topology).objects)


def test_publishing_to_an_undeclared_plugin_exchange_fails_cleanly(
    broker_url: str, make_topology: Callable[..., Topology]
) -> None:
    # The plugin ignores `mandatory`, so an absent exchange is the one thing the broker
    # can still report: 404 on the channel, turned into MissingObjectError.
    topology = make_topology(**plugin_data())
    with (
        Publisher(topology, broker_url) as publisher,
        pytest.raises(MissingObjectError, match="declare"),
    ):
        publisher.publish_delayed(b"x", queue="push", delay=2)


def test_a_reserved_name_probes_for_the_plugin_without_creating_anything(
    broker_url: str, broker_info: BrokerInfo
) -> None:
    """Broker behaviour a side-effect-free `plan` can rely on: an active declare checks
    the exchange TYPE first (unknown: 503 closing the connection on 3.x, 406 closing the
    channel on 4.x) and only then refuses a reserved `amq.` name (403, channel closed).
    So declaring `amq.<anything>` of type x-delayed-message answers "plugin missing" or
    "plugin present" (403), and creates nothing either way."""
    name = f"amq.rabbit-delay.probe-{uuid.uuid4().hex[:6]}"
    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as known:
            conn.channel().exchange_declare(name, "topic", durable=True)
        assert known.value.reply_code == 403
        closed: type[pika.exceptions.AMQPError] = (
            pika.exceptions.ChannelClosedByBroker
            if broker_info.at_least(4)
            else pika.exceptions.ConnectionClosedByBroker
        )
        with pytest.raises(closed) as unknown:  # type: ignore[misc]
            conn.channel().exchange_declare(name, "x-delayed-message", durable=True)
        assert unknown.value.reply_code == (406 if broker_info.at_least(4) else 503)
        assert "unknown exchange type 'x-delayed-message'" in unknown.value.reply_text
        assert conn.is_open == broker_info.at_least(4)
    finally:
        if conn.is_open:
            conn.close()
    assert not exists(broker_url, ExchangeSpec(name, "topic"))


@pytest.mark.parametrize("transport", ["sync", "aio"])
def test_plan_without_the_plugin_is_a_clear_error(
    broker_url: str, broker_info: BrokerInfo, make_topology: Callable[..., Topology], transport: str
) -> None:
    topology = make_topology(**plugin_data())
    error, hint = no_plugin(broker_info)
    if transport == "sync":
        conn = connect(broker_url)
        try:
            with pytest.raises(error, match=re.escape(hint)):
                plan(conn, topology)
        finally:
            if conn.is_open:
                conn.close()
    else:

        async def run() -> None:
            conn = await aio.connect(broker_url)
            try:
                with pytest.raises(error, match=re.escape(hint)):
                    await aio.plan(conn, topology)
            finally:
                await conn.close()

        asyncio.run(run())
    assert not any(exists(broker_url, spec) for spec in desired(topology).objects)


def test_the_type_probe_answers_for_a_known_type(broker_url: str) -> None:
    conn = connect(broker_url)
    try:
        assert run_program(conn, _probe("topic")) is True
        assert conn.is_open  # a known type costs one channel, never the connection
    finally:
        conn.close()


def _probe(exchange_type: str) -> Generator[Operation, object, object]:
    return (yield SupportsType(exchange_type))


def test_cli_plan_without_the_plugin_exits_1_with_the_hint(
    broker_url: str, broker_info: BrokerInfo, make_topology: Callable[..., Topology], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from rabbit_delay._cli.app import app

    topology = make_topology(**plugin_data())
    file = tmp_path / "plugin.toml"
    file.write_text(
        f'namespace = "{topology.namespace}"\n'
        '[tiers]\n1h = "1h"\n[queues."orders.cancel"]\n[plugin]\n'
    )
    result = CliRunner().invoke(app, ["plan", str(file), "--url", broker_url])
    assert result.exit_code == 1, result.output
    assert no_plugin(broker_info)[1] in result.output


# -- a broker with the plugin (RABBIT_DELAY_PLUGIN_URL) -----------------------------------


@pytest.fixture(scope="module")
def plugin_url() -> str:
    url = os.environ.get(PLUGIN_URL_ENV)
    if not url:
        pytest.skip(
            f"{PLUGIN_URL_ENV} is not set: no broker with rabbitmq_delayed_message_exchange"
        )
    return url


@pytest.fixture
def plugin_topology(plugin_url: str) -> Iterator[Topology]:
    """A declared plugin topology in a unique namespace; deleted afterwards."""
    topology = topology_from_dict(plugin_data())
    conn = connect(plugin_url)
    try:
        declare(conn, topology)
    finally:
        if conn.is_open:
            conn.close()
    yield topology
    want = desired(topology)
    conn = pika.BlockingConnection(pika.URLParameters(plugin_url))
    try:
        for q in want.queues:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.channel().queue_delete(q.name)
        for x in want.exchanges:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.channel().exchange_delete(x.name)
    finally:
        if conn.is_open:
            conn.close()


@pytest.mark.plugin
def test_declare_with_the_plugin_is_idempotent(plugin_url: str, plugin_topology: Topology) -> None:
    conn = connect(plugin_url)
    try:
        assert not declare(conn, plugin_topology).changed
    finally:
        conn.close()


@pytest.mark.plugin
@pytest.mark.slow
def test_mixed_delays_arrive_never_early_and_in_due_order(
    plugin_url: str, plugin_topology: Topology
) -> None:
    n = plugin_topology.names
    rng = random.Random()
    with (
        Collector(plugin_url, n.business_queue("orders.cancel")) as orders,
        Collector(plugin_url, n.business_queue("push")) as push,
        Publisher(plugin_topology, plugin_url) as publisher,
    ):
        targets = {"orders.cancel": orders, "push": push}
        sent: dict[str, list[str]] = {"orders.cancel": [], "push": []}
        for seconds in [5.0, *(rng.uniform(0.001, 5) for _ in range(120)), 0.001]:
            queue = rng.choice(["orders.cancel", "push"])
            if queue == "push" and rng.random() < 0.3:  # through a binding key
                sent[queue].append(
                    publisher.publish_delayed({"s": seconds}, routing_key="push.any", delay=seconds)
                )
            else:
                sent[queue].append(
                    publisher.publish_delayed({"s": seconds}, queue=queue, delay=seconds)
                )
        got = {}
        for queue, ids in sent.items():
            got |= targets[queue].wait_for(ids, timeout=20)
    for message_id, r in got.items():
        due = r.header_int(h.H_DUE_AT)
        assert 0 <= r.arrival_ms - due <= LATE_BOUND_MS, f"{message_id}: {r.arrival_ms - due} ms"
        assert r.headers[h.H_TIER] == "plugin"
    by_arrival = sorted(got.values(), key=lambda r: r.arrival_ms)
    for before, after in itertools.pairwise(by_arrival):
        assert before.header_int(h.H_DUE_AT) <= after.header_int(h.H_DUE_AT) + LATE_BOUND_MS


@pytest.mark.plugin
def test_the_plugin_delivers_out_of_range_delays_at_once(
    plugin_url: str, plugin_topology: Topology
) -> None:
    """Why the publisher refuses them: the plugin does not, it delivers at once."""
    n = plugin_topology.names
    with Collector(plugin_url, n.business_queue("push")) as push:
        conn = pika.BlockingConnection(pika.URLParameters(plugin_url))
        try:
            ch = conn.channel()
            ids = []
            for delay in (0, -5_000, 2**32, 2**40):
                ids.append(uuid.uuid4().hex)
                props = pika.BasicProperties(message_id=ids[-1], headers={h.H_PLUGIN_DELAY: delay})
                ch.basic_publish(n.plugin_exchange(), n.queue_key("push"), b"x", props)
            sent_at = time.time() * 1000
        finally:
            conn.close()
        got = push.wait_for(ids, timeout=10)
    assert all(r.arrival_ms - sent_at < 1_000 for r in got.values())


@pytest.mark.plugin
@pytest.mark.slow
def test_a_due_message_matching_no_queue_goes_to_the_catch_all_only_when_due(
    plugin_url: str, plugin_topology: Topology
) -> None:
    n = plugin_topology.names
    with (
        Collector(plugin_url, n.unroutable_queue()) as catch_all,
        Publisher(plugin_topology, plugin_url) as publisher,
    ):
        # A valid message must NOT show up in the catch-all at publish time (it would
        # with an alternate-exchange on the plugin exchange: plugin issue #36).
        publisher.publish_delayed(b"valid", queue="push", delay=1.5)
        stray = publisher.publish_delayed(b"stray", queue="orders.cancel", delay=1)
        sent_at = time.time() * 1000
        conn = pika.BlockingConnection(pika.URLParameters(plugin_url))
        try:  # the business queue's binding goes away while its message waits
            conn.channel().queue_unbind(
                n.business_queue("orders.cancel"), n.due_exchange(), n.queue_key("orders.cancel")
            )
        finally:
            conn.close()
        got = catch_all.wait_for([stray], timeout=10)[stray]
        time.sleep(1)
    assert got.arrival_ms >= sent_at + 1_000
    assert [r.message_id for r in catch_all.received] == [stray]


@pytest.mark.plugin
@pytest.mark.parametrize("view", ["passive declares", "management API"])
def test_a_plugin_exchange_of_another_inner_type_is_a_conflict(plugin_url: str, view: str) -> None:
    """The plugin's equivalence check ignores x-delayed-type: a re-declare accepts a
    `direct` inner type, which would drop every due message. `declare` must report it,
    with or without the management API, and create nothing."""
    topology = topology_from_dict(plugin_data())
    name = topology.names.plugin_exchange()
    conn = pika.BlockingConnection(pika.URLParameters(plugin_url))
    try:
        conn.channel().exchange_declare(
            name, "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"}
        )
    finally:
        conn.close()
    try:
        observed = None
        if view == "management API":
            from conftest import verified_management

            endpoint, note = verified_management(plugin_url)
            if endpoint is None:
                pytest.skip(f"the plugin broker's management API cannot be used: {note}")
            observed = read_observed(endpoint, topology.names.prefix + ".")
        conn = connect(plugin_url)
        try:
            with pytest.raises(DeclarationConflict) as caught:
                declare(conn, topology, observed=observed)
        finally:
            if conn.is_open:
                conn.close()
        assert [(c.name, c.argument) for c in caught.value.conflicts] == [(name, "x-delayed-type")]
        created = [s.name for s in desired(topology).objects if exists(plugin_url, s)]
        assert created == [name]  # only the pre-made exchange: nothing was created
    finally:
        conn = pika.BlockingConnection(pika.URLParameters(plugin_url))
        try:
            conn.channel().exchange_delete(name)
        finally:
            conn.close()
