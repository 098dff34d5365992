"""`rabbit-delay status` and `rabbit-delay replay` on the real broker.

Parked messages are put in place the way the worker does it: published to the parking
exchange with the queue's key and the parking headers. Counts are read with passive
declares (live; the management API's figures are sampled every few seconds).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import MakeTopology, delete_topology, unique_namespace, wait_for
from typer.testing import CliRunner, Result

from rabbit_delay import Topology, topology_from_dict
from rabbit_delay import _headers as h
from rabbit_delay._broker import BrokerInfo
from rabbit_delay._cli.app import app
from rabbit_delay._cli.status import EXIT_ATTENTION
from rabbit_delay._envelope import JSON
from rabbit_delay._io.management import get_json
from rabbit_delay._urls import MANAGEMENT_URL_ENV, URL_ENV, ManagementEndpoint
from rabbit_delay.sync import Publisher, connected, declare

from ._publishers import toml_for
from ._terminal import Terminal

pytestmark = pytest.mark.integration

UNREACHABLE_MGMT = "http://127.0.0.1:1"
SECRET = "s3cret-pw"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (URL_ENV, MANAGEMENT_URL_ENV, "RABBIT_DELAY_TOPOLOGY"):
        monkeypatch.delenv(name, raising=False)


def cli(*args: str) -> Result:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


class Ops:
    """A declared topology, its TOML file, and a connection to look at the queues."""

    def __init__(self, topology: Topology, path: Path, url: str) -> None:
        self.topology = topology
        self.names = topology.names
        self.path = path
        self.url = url
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        declare(self.conn, topology)

    def run(self, *args: str) -> Result:
        return cli(*args, str(self.path), "--url", self.url)

    def count(self, queue: str) -> int:
        frame = self.conn.channel().queue_declare(queue, passive=True)
        return frame.method.message_count or 0

    def park(self, queue: str, n: int, prefix: str = "p") -> list[str]:
        """Put `n` failed messages into `queue`'s parking lot, as the worker would."""
        channel = self.conn.channel()
        channel.confirm_delivery()
        ids = []
        for i in range(n):
            message_id = f"{prefix}{i}"
            headers: dict[str, Any] = {
                h.H_ATTEMPT: 3,
                h.H_TIER: "1s",
                h.H_DUE_AT: 1_700_000_000_000,
                h.H_DELAY_MS: 1000,
                h.H_TARGET: self.names.queue_key(queue),
                h.H_ERROR_TYPE: "ValueError",
                h.H_ERROR_MESSAGE: f"boom {i}",
                h.H_ERROR_TRACEBACK: "Traceback (most recent call last): ...",
                h.H_ORIGINAL_QUEUE: queue,
                h.H_FIRST_FAILURE: 1_700_000_001_000,
                h.H_LAST_FAILURE: 1_700_000_002_000,
                h.H_PARK_REASON: "max_attempts",
                "x-first-death-queue": self.names.business_queue(queue),
                "tenant": "acme",
            }
            props = pika.BasicProperties(
                message_id=message_id, content_type=JSON, delivery_mode=2, headers=headers
            )
            channel.basic_publish(
                self.names.parking_exchange(),
                self.names.queue_key(queue),
                json.dumps({"n": i}).encode(),
                props,
                mandatory=True,
            )
            ids.append(message_id)
        channel.close()
        return ids

    def drain(self, queue: str) -> list[tuple[pika.spec.BasicProperties, bytes]]:
        channel = self.conn.channel()
        got: list[tuple[pika.spec.BasicProperties, bytes]] = []
        while True:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            assert props is not None
            assert isinstance(body, bytes)
            got.append((props, body))
        channel.close()
        return got

    def close(self) -> None:
        if self.conn.is_open:
            self.conn.close()


@contextmanager
def declared(topology: Topology, tmp_path: Path, url: str) -> Iterator[Ops]:
    """`topology` (the conftest default, with its own overrides) declared, as an Ops."""
    path = tmp_path / "topology.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    handle = Ops(topology, path, url)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture
def ops(make_topology: MakeTopology, tmp_path: Path, broker_url: str) -> Iterator[Ops]:
    with declared(make_topology(), tmp_path, broker_url) as handle:
        yield handle


def rows_by_name(result: Result) -> dict[str, dict[str, Any]]:
    data = json.loads(result.stdout)
    return {row["name"]: row for row in data["queues"]}


# -- status -----------------------------------------------------------------------------


def test_status_counts_and_flags(ops: Ops, broker_url: str) -> None:
    n = ops.names
    clean = ops.run("status", "--check")
    assert clean.exit_code == 0, clean.stderr
    assert "nothing needs attention" in clean.stdout

    ops.park("orders.cancel", 2)
    channel = ops.conn.channel()  # a due message that matches no queue: to the catch-all
    channel.basic_publish(n.due_exchange(), "nowhere", b"{}")
    channel.close()

    def waiting_two() -> None:
        # two messages in the 3 s buffer, published just before each look (on a loaded
        # machine, earlier ones could expire, into push's queue, before the look)
        refresh = ops.conn.channel()
        refresh.queue_purge(n.tier_queue("3s"))
        refresh.queue_purge(n.business_queue("push"))
        refresh.close()
        with Publisher(ops.topology, broker_url) as publisher:
            publisher.publish_many([{"i": 1}, {"i": 2}], "3s", queue="push")

    for extra in ([], ["--management-url", UNREACHABLE_MGMT]):
        waiting_two()
        result = ops.run("status", "--json", *extra)
        assert result.exit_code == 0, result.stderr
        rows = rows_by_name(result)
        assert len(rows) == 7
        buffer = rows[n.tier_queue("3s")]
        assert (buffer["role"], buffer["ttl_ms"], buffer["ready"]) == ("tier buffer", 3000, 2)
        assert buffer["consumers"] == 0
        assert buffer["attention"] is False
        parking = rows[n.parking_queue("orders.cancel")]
        assert (parking["ready"], parking["attention"]) == (2, True)
        assert rows[n.unroutable_queue()]["ready"] == 1
        assert rows[n.unroutable_queue()]["attention"] is True
        assert rows[n.parking_queue("push")]["attention"] is False
        assert rows[n.business_queue("push")]["ready"] == 0
        assert all(row["exists"] for row in rows.values())
        data = json.loads(result.stdout)
        assert data["attention"] is True
        if extra:  # management API down: live counts still there, unacked unknown
            assert data["sources"]["unacked"] is None
            assert all(row["unacked"] is None for row in rows.values())
            assert data["sources"]["placement"] is None
            assert all(
                row["leader"] is row["members"] is row["online"] is None for row in rows.values()
            )
        else:  # one node: it leads every quorum queue and is its only member, online
            assert data["sources"]["placement"] == "management API"
            node = buffer["leader"]
            assert isinstance(node, str)
            assert "@" in node
            for row in rows.values():
                assert (row["leader"], row["members"], row["online"]) == (node, [node], [node])
        checked = ops.run("status", "--check", *extra)
        assert checked.exit_code == EXIT_ATTENTION
        assert "needs attention" in checked.stdout
        assert "leader" not in checked.stdout  # the columns are for clusters only
        assert n.parking_queue("orders.cancel") in checked.stdout


def test_status_check_on_a_topology_never_declared_needs_attention(
    make_topology: MakeTopology, tmp_path: Path, broker_url: str
) -> None:
    """Issue 11, observed: `status FILE --check` on a topology whose queues do not exist
    listed them as missing, printed "nothing needs attention" and exited 0."""
    topology = make_topology()  # never declared
    path = tmp_path / "topology.toml"
    path.write_text(toml_for(topology), encoding="utf-8")
    result = cli("status", str(path), "--url", broker_url, "--check")
    assert result.exit_code == EXIT_ATTENTION, result.stdout + result.stderr
    assert "nothing needs attention" not in result.stdout
    assert "missing" in result.stdout
    assert "rabbit-delay declare" in result.stdout
    shown = cli("status", str(path), "--url", broker_url, "--json")
    assert shown.exit_code == 0, shown.stderr  # without --check: 0, whatever it found
    data = json.loads(shown.stdout)
    assert data["attention"] is True
    assert data["queues"]
    assert all(not row["exists"] and row["attention"] for row in data["queues"])


def test_status_flags_a_consumer_on_a_buffer(ops: Ops) -> None:
    buffer = ops.names.tier_queue("1s")
    channel = ops.conn.channel()
    channel.basic_consume(buffer, lambda *_: None)
    try:
        result = ops.run("status", "--json", "--no-management")
        row = rows_by_name(result)[buffer]
        assert row["consumers"] == 1
        assert row["attention"] is True
        assert any("BUG" in note for note in row["notes"])
        assert ops.run("status", "--check", "--no-management").exit_code == EXIT_ATTENTION
    finally:
        channel.close()


def test_status_missing_queue_and_no_password_in_output(ops: Ops, broker_url: str) -> None:
    channel = ops.conn.channel()
    channel.queue_delete(ops.names.parking_queue("push"))
    channel.close()
    mgmt = f"http://guest:{SECRET}@127.0.0.1:1"
    result = cli("status", str(ops.path), "--url", broker_url, "--management-url", mgmt)
    assert result.exit_code == 0
    assert "missing" in result.stdout
    assert SECRET not in result.stdout + result.stderr
    assert "guest:guest@" not in result.stdout
    assert "guest:***@" in result.stdout

    bad = f"amqp://guest:{SECRET}@127.0.0.1:1/"
    down = cli("status", str(ops.path), "--url", bad, "--management-url", UNREACHABLE_MGMT)
    assert down.exit_code == 1
    assert SECRET not in down.stdout + down.stderr
    assert "guest:***@127.0.0.1:1" in down.stderr


def test_status_flags_a_missing_exchange_and_names_the_broker(
    ops: Ops, broker_info: BrokerInfo
) -> None:
    channel = ops.conn.channel()
    channel.exchange_delete(ops.names.due_exchange())
    channel.close()
    checked = ops.run("status", "--check")
    assert checked.exit_code == EXIT_ATTENTION, checked.stdout + checked.stderr
    assert f"needs attention: missing exchange {ops.names.due_exchange()}" in checked.stdout
    assert "run `rabbit-delay declare`" in checked.stdout
    assert f"RabbitMQ {broker_info.version_text}" in checked.stdout  # the table's title
    data = json.loads(ops.run("status", "--json").stdout)
    assert data["missing_exchanges"] == [ops.names.due_exchange()]
    assert data["broker_version"] == broker_info.version_text
    assert data["attention"] is True
    assert all(row["exists"] and not row["attention"] for row in data["queues"])


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_status_ages_the_oldest_buffered_message_and_flags_a_stuck_buffer(
    make_topology: MakeTopology,
    tmp_path: Path,
    broker_url: str,
    broker_info: BrokerInfo,
    queue_type: str,
) -> None:
    """A message whose AMQP timestamp is a minute old sits at the head of the 3s buffer:
    status reads its age by peeking it (a classic queue always, a quorum one on 4.3+),
    calls the buffer stuck, and the peeks change nothing: the messages still expire on
    time and in order, and arrive as if never looked at."""
    with declared(make_topology(queue_type=queue_type), tmp_path, broker_url) as ops:
        _age_and_stuck(ops, broker_info, queue_type)


def _age_and_stuck(ops: Ops, broker_info: BrokerInfo, queue_type: str) -> None:
    n = ops.names
    buffer = n.tier_queue("3s")
    now_s = int(time.time())
    channel = ops.conn.channel()
    channel.confirm_delivery()
    for message_id, timestamp in (("old", now_s - 60), ("new", now_s)):
        props = pika.BasicProperties(
            message_id=message_id, delivery_mode=2, timestamp=timestamp, headers={}
        )
        channel.basic_publish(n.tier_exchange("3s"), n.queue_key("push"), b"{}", props)
    channel.close()
    published = time.monotonic()
    # One read for the figures and the exit code: a second `status --check` could come
    # after the 3 s TTL on a loaded machine, when the buffer is empty again.
    checked = ops.run("status", "--json", "--check")
    data = json.loads(checked.stdout)
    row = {r["name"]: r for r in data["queues"]}[buffer]
    assert row["ready"] == 2
    if queue_type == "classic" or broker_info.peeks_quorum_buffers_freely:
        assert row["age_source"] == "peek"
        assert 59_000 <= row["oldest_age_ms"] <= 70_000
        assert row["stuck"] is True
        assert row["attention"] is True
        assert any(note.startswith("stuck: oldest message 1m") for note in row["notes"])
        assert data["sources"]["oldest_age"].startswith("peek")
        assert checked.exit_code == EXIT_ATTENTION
    else:  # 3.x, 4.0-4.2: a peek could make it late or early; the age is unknown, said so
        assert row["oldest_age_ms"] is None
        assert not row["stuck"]
        assert any("buffer ages unknown" in note for note in data["notes"])
    for _ in range(3):  # more peeks of the head
        assert ops.run("status", "--json").exit_code == 0
    business = n.business_queue("push")
    wait_for(lambda: ops.count(business) == 2, timeout=10, interval=0.02)
    assert time.monotonic() - published >= 2.9  # never early: TTL 3 s
    got = []
    reader = ops.conn.channel()
    while True:
        method, props, _body = reader.basic_get(business, auto_ack=True)
        if method is None:
            break
        assert props is not None
        got.append(
            (
                props.message_id,
                method.redelivered,
                (props.headers or {}).get(h.DELIVERY_COUNT_HEADER, 0),
            )
        )
    reader.close()
    # In order, and as if never looked at: not redelivered, no delivery counted.
    assert got == [("old", False, 0), ("new", False, 0)]


def test_status_flags_dead_letters_that_stall_in_a_buffer_and_overdue_scheduled_messages(
    make_topology: MakeTopology, tmp_path: Path, broker_url: str, management: ManagementEndpoint
) -> None:
    """A stall made on purpose: the 1s buffer's dead-letter exchange is deleted, so its
    at-least-once dead letters cannot be forwarded and stay in the buffer, in neither
    ready nor unacked (`messages_dlx`): what RabbitMQ 3.10 does after a partition
    (docs/reliability.md#network-partitions). `status --check` flags the buffer stalled
    (the management API read twice, a sample apart: as many the second time) and, with
    [schedule], the business queue's messages as overdue past the grace; nothing arrives."""
    store = tmp_path / "guard.sqlite"
    topology = make_topology(
        schedule={"grace": "1s"}, idempotency={"store": "sqlite", "path": str(store)}
    )
    with declared(topology, tmp_path, broker_url) as ops:
        ops.path.write_text(
            toml_for(topology)
            + f'[idempotency]\nstore = "sqlite"\npath = "{store}"\n[schedule]\ngrace = "1s"\n',
            encoding="utf-8",
        )
        n = ops.names
        buffer, business = n.tier_queue("1s"), n.business_queue("push")
        channel = ops.conn.channel()
        channel.exchange_delete(n.due_exchange())
        channel.close()
        with Publisher.connect(topology, broker_url) as publisher:
            for i in range(3):
                publisher.publish_delayed({"i": i}, queue="push", tier="1s", message_id=f"s{i}")

        def pending() -> int:
            rows = get_json(management, "queues/%2F?columns=name,messages_dlx")
            return next((int(r.get("messages_dlx") or 0) for r in rows if r["name"] == buffer), 0)

        wait_for(lambda: pending() >= 3, timeout=40, what="3 dead letters pending", interval=1)
        checked = ops.run("status", "--json", "--check")
        assert checked.exit_code == EXIT_ATTENTION, checked.stderr
        data = json.loads(checked.stdout)
        rows = {r["name"]: r for r in data["queues"]}
        stalled = rows[buffer]
        assert (stalled["dead_lettering"], stalled["dead_lettering_again"]) == (3, 3)
        assert stalled["dead_letters_stalled"] is True
        assert stalled["attention"] is True
        assert stalled["ready"] == 0  # nothing shows in the queue's depth
        assert any(note.startswith("stalled: 3 dead-lettered") for note in stalled["notes"])
        assert rows[business]["overdue"] == 3, data["notes"]
        assert rows[business]["attention"] is True
        subjects = {item["subject"] for item in data["attention_items"]}
        assert {buffer, business} <= subjects
        assert ops.count(business) == 0  # nothing arrived
        # the other buffer, with nothing pending, is not flagged
        other = rows[n.tier_queue("3s")]
        assert not other["dead_letters_stalled"]
        assert other["dead_lettering_again"] is None


def test_status_without_amqp_reads_the_management_api(
    ops: Ops, management: ManagementEndpoint, broker_info: BrokerInfo
) -> None:
    """No AMQP connection: the counts, which exchanges exist and the broker's version
    come from the management API (unverified: nothing to compare it with)."""
    channel = ops.conn.channel()
    channel.exchange_delete(ops.names.parking_exchange())
    channel.close()
    down = "amqp://guest:guest@127.0.0.1:1/%2F"
    result = cli("status", str(ops.path), "--url", down, "--management-url", management.base)
    assert result.exit_code == 0, result.stderr
    assert f"RabbitMQ {broker_info.version_text}, from the management API" in result.stdout
    assert "counts from the management API" in result.stdout
    data = json.loads(
        cli(
            "status", str(ops.path), "--url", down, "--management-url", management.base, "--json"
        ).stdout
    )
    assert data["broker_version"] == broker_info.version_text
    assert data["sources"]["ready_and_consumers"] == "management API"
    assert data["sources"]["exchanges"] == "management API"
    assert data["missing_exchanges"] == [ops.names.parking_exchange()]
    assert all(row["exists"] for row in data["queues"])


PLUGIN_URL_ENV = "RABBIT_DELAY_PLUGIN_URL"


def test_status_shows_the_plugin_store(tmp_path: Path) -> None:
    """How many messages the delayed-message plugin holds (`messages_delayed` of its
    exchange in the management API; the parsing is unit-tested in test_ops_status)."""
    url = os.environ.get(PLUGIN_URL_ENV)
    if not url:
        pytest.skip(
            f"{PLUGIN_URL_ENV} is not set: no broker with rabbitmq_delayed_message_exchange"
        )
    topology = topology_from_dict(
        {
            "namespace": unique_namespace(),
            "tiers": {"1h": "1h"},
            "queues": {"orders.cancel": {}},
            "plugin": {},
        }
    )
    path = tmp_path / "plugin.toml"
    path.write_text(
        f'namespace = "{topology.namespace}"\n[tiers]\n1h = "1h"\n[queues."orders.cancel"]\n'
        "[plugin]\n",
        encoding="utf-8",
    )
    with connected(url, name="rd-test plugin status") as connection:
        declare(connection, topology)
    try:
        with Publisher(topology, url) as publisher:
            publisher.publish_delayed({"k": 1}, queue="orders.cancel", delay=timedelta(minutes=9))

        def store() -> dict[str, Any] | None:
            data = json.loads(cli("status", str(path), "--url", url, "--json").stdout)
            plugin: dict[str, Any] | None = data["plugin_store"]
            return plugin if plugin and plugin["delayed"] else None

        shown = wait_for(store, timeout=15, what="the plugin store's count")
        assert shown == {"exchange": topology.names.plugin_exchange(), "delayed": 1}
    finally:
        delete_topology(url, topology)


def test_status_watch_refreshes_until_ctrl_c(ops: Ops) -> None:
    term = Terminal("status", str(ops.path), "--url", ops.url, "--watch", "--interval", "200ms")
    try:
        term.read_until(lambda out: out.count("refreshed 20") >= 3, 30, "three refreshes")
        assert f"status of {ops.names.prefix}" in term.output
        term.interrupt()
        assert term.wait() == 0, term.output
    finally:
        term.kill()
    refused = ops.run("status", "--watch", "--json")
    assert refused.exit_code == 1
    assert "--watch" in refused.stderr
    assert ops.run("status", "--interval", "1s").exit_code == 1


# -- replay -----------------------------------------------------------------------------


def test_replay_moves_parked_messages_back_as_first_attempts(ops: Ops) -> None:
    n = ops.names
    ids = ops.park("orders.cancel", 3)
    result = ops.run("replay", "orders.cancel", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["moved"] == 3
    assert ops.count(n.parking_queue("orders.cancel")) == 0

    wait_for(lambda: ops.count(n.business_queue("orders.cancel")) == 3, timeout=5)
    got = ops.drain(n.business_queue("orders.cancel"))
    assert [p.message_id for p, _ in got] == ids
    assert [json.loads(body) for _, body in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    for props, _ in got:
        headers = props.headers or {}
        assert props.content_type == JSON
        assert headers[h.H_ATTEMPT] == 1
        assert headers["tenant"] == "acme"
        assert headers[h.H_TIER] == "now"
        assert headers[h.H_TARGET] == n.queue_key("orders.cancel")
        for gone in (
            h.H_ERROR_TYPE,
            h.H_ERROR_MESSAGE,
            h.H_ERROR_TRACEBACK,
            h.H_ORIGINAL_QUEUE,
            h.H_FIRST_FAILURE,
            h.H_LAST_FAILURE,
            h.H_PARK_REASON,
            "x-death",
            "x-first-death-queue",
        ):
            assert gone not in headers
    # Nothing went astray.
    assert ops.count(n.unroutable_queue()) == 0
    assert ops.count(n.business_queue("push")) == 0


def test_replay_limit(ops: Ops) -> None:
    n = ops.names
    ops.park("push", 3)
    result = ops.run("replay", "push", "--limit", "2")
    assert result.exit_code == 0, result.stderr
    assert "moved 2 message(s)" in result.stdout
    assert ops.count(n.parking_queue("push")) == 1
    wait_for(lambda: ops.count(n.business_queue("push")) == 2, timeout=5)
    assert [p.message_id for p, _ in ops.drain(n.business_queue("push"))] == ["p0", "p1"]


def test_replay_one_message_by_id(ops: Ops) -> None:
    n = ops.names
    ops.park("push", 40)  # past 32: the others go back in order, 32 at a time
    result = ops.run("replay", "push", "--message-id", "p7", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["message_ids"] == ["p7"]
    wait_for(lambda: ops.count(n.business_queue("push")) == 1, timeout=5)
    left = [p.message_id for p, _ in ops.drain(n.parking_queue("push"))]
    assert left == [f"p{i}" for i in range(40) if i != 7]
    missing = ops.run("replay", "push", "--message-id", "p7")
    assert missing.exit_code == 1
    assert "no message with id 'p7'" in missing.stderr
    both = ops.run("replay", "push", "--message-id", "p1", "--dry-run")
    assert both.exit_code == 1
    assert "not with --unroutable, --dry-run or --limit" in both.stderr


def test_dry_run_changes_nothing(ops: Ops) -> None:
    n = ops.names
    ops.park("orders.cancel", 2)
    lot, business = n.parking_queue("orders.cancel"), n.business_queue("orders.cancel")
    before = (ops.count(lot), ops.count(business))
    assert before == (2, 0)
    for extra, via in (([], "basic.get"), (["--no-management"], "basic.get")):
        result = ops.run("replay", "orders.cancel", "--dry-run", "--json", *extra)
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["via"].startswith(via)
        assert data["would_move"] == 2
        listed = data["messages"]
        assert [m["message_id"] for m in listed] == ["p0", "p1"]
        assert [m["error_message"] for m in listed] == ["boom 0", "boom 1"]
        assert {(m["error_type"], m["attempts"], m["park_reason"]) for m in listed} == {
            ("ValueError", 3, "max_attempts")
        }
        assert listed[0]["parked_at"] == "2023-11-14T22:13:22.000Z"
        wait_for(lambda: (ops.count(lot), ops.count(business)) == before, timeout=5)
    table = ops.run("replay", "orders.cancel", "--dry-run")
    assert "would move 2 message(s); nothing was changed" in table.stdout
    wait_for(lambda: (ops.count(lot), ops.count(business)) == before, timeout=5)
    # Still in order after being looked at.
    assert ops.run("replay", "orders.cancel").exit_code == 0
    got = ops.drain(business)
    assert [p.message_id for p, _ in got] == ["p0", "p1"]


def test_replay_through_a_tier_arrives_a_tier_later(ops: Ops) -> None:
    n = ops.names
    ops.park("orders.cancel", 1)
    business = n.business_queue("orders.cancel")
    started = time.monotonic()
    result = ops.run("replay", "orders.cancel", "--tier", "1s")
    replayed = time.monotonic()
    assert result.exit_code == 0, result.stderr
    assert ops.count(business) == 0  # waiting in the buffer
    assert ops.count(n.tier_queue("1s")) == 1
    wait_for(lambda: ops.count(business) == 1, timeout=12, interval=0.02)
    arrived = time.monotonic()
    # a second after it was sent (during the command); the upper bound is loose: a CI
    # machine runs two brokers and six test workers on two cores
    assert arrived - started >= 0.9
    assert arrived - replayed < 10.0
    ((props, _),) = ops.drain(business)
    headers = props.headers or {}
    assert (headers[h.H_TIER], headers[h.H_DELAY_MS], headers[h.H_ATTEMPT]) == ("1s", 1000, 1)


def test_replay_refuses_a_tier_the_queue_does_not_have(ops: Ops) -> None:
    ops.park("push", 1)
    result = ops.run("replay", "push", "--tier", "9s")
    assert result.exit_code == 1
    assert "unknown tier '9s'" in result.stderr
    assert ops.count(ops.names.parking_queue("push")) == 1


def test_replay_without_the_business_queue_fails_and_keeps_the_message(ops: Ops) -> None:
    n = ops.names
    ops.park("push", 1)
    channel = ops.conn.channel()
    channel.queue_delete(n.business_queue("push"))
    channel.close()
    for extra in ([], ["--dry-run"]):
        result = ops.run("replay", "push", *extra)
        assert result.exit_code == 1
        assert f"business queue '{n.business_queue('push')}' does not exist" in result.stderr
        assert "rabbit-delay declare" in result.stderr
        assert ops.count(n.parking_queue("push")) == 1
        assert ops.count(n.unroutable_queue()) == 0


def test_replay_unroutable_reroutes_known_targets_and_leaves_the_rest(ops: Ops) -> None:
    n = ops.names
    channel = ops.conn.channel()
    channel.confirm_delivery()
    for message_id, target in (("u1", n.queue_key("orders.cancel")), ("u2", "gone.key")):
        props = pika.BasicProperties(
            message_id=message_id, headers={h.H_TARGET: target, h.H_ATTEMPT: 2}
        )
        channel.basic_publish(n.due_exchange(), target + ".unbound", b"{}", props)
    channel.close()
    assert ops.count(n.unroutable_queue()) == 2

    preview = json.loads(ops.run("replay", "--unroutable", "--dry-run", "--json").stdout)
    actions = {m["message_id"]: m["action"] for m in preview["messages"]}
    assert actions["u1"] == f"{n.due_exchange()} [{n.queue_key('orders.cancel')}]"
    assert actions["u2"].startswith("left: target 'gone.key' is not in the topology")

    result = ops.run("replay", "--unroutable")
    assert result.exit_code == 0, result.stderr
    assert "moved 1 message(s)" in result.stdout
    assert "u2: target 'gone.key'" in result.stderr
    # The message left behind was nacked back: the broker requeues it asynchronously.
    wait_for(lambda: ops.count(n.unroutable_queue()) == 1, timeout=5)
    wait_for(lambda: ops.count(n.business_queue("orders.cancel")) == 1, timeout=5)
    ((props, _),) = ops.drain(n.business_queue("orders.cancel"))
    assert props.message_id == "u1"
    assert (props.headers or {})[h.H_ATTEMPT] == 2  # never handled: attempt kept


def test_replay_needs_a_queue_or_unroutable(ops: Ops) -> None:
    result = ops.run("replay")
    assert result.exit_code == 1
    assert "--unroutable" in result.stderr
    both = ops.run("replay", "push", "--tier", "1s", "--now")
    assert both.exit_code == 1


def test_messages_dead_lettered_by_the_broker(ops: Ops, broker_url: str) -> None:
    """Rejected by a worker without a rd-error header: parked by the broker (x-death)."""
    n = ops.names
    with Publisher(ops.topology, broker_url) as publisher:
        direct = publisher.publish_delayed({"k": 1}, "1s", queue="push", message_id="d1")
        shared = publisher.publish_delayed({"k": 2}, "1s", routing_key="push.any", message_id="d2")
    business = n.business_queue("push")
    wait_for(lambda: ops.count(business) == 2, timeout=5)
    channel = ops.conn.channel()
    for _ in range(2):
        method, _props, _body = channel.basic_get(business)
        assert method is not None
        assert method.delivery_tag is not None
        channel.basic_reject(method.delivery_tag, requeue=False)
    channel.close()
    # Both into THIS queue's parking lot: the business queue dead-letters with its own
    # key (x-dead-letter-routing-key), whatever key the message arrived with.
    wait_for(lambda: ops.count(n.parking_queue("push")) == 2, timeout=5)
    assert ops.count(n.unroutable_queue()) == 0

    preview = json.loads(ops.run("replay", "push", "--dry-run", "--json").stdout)
    listed = preview["messages"]
    assert sorted(m["message_id"] for m in listed) == sorted([direct, shared])
    assert {m["park_reason"] for m in listed} == {"rejected"}
    assert all(m["parked_at"] is not None for m in listed)
    assert ops.count(business) == 0

    assert ops.run("replay", "push").exit_code == 0
    wait_for(lambda: ops.count(business) == 2, timeout=5)
    got = ops.drain(business)
    assert sorted(p.message_id or "" for p, _ in got) == sorted([direct, shared])
    for props, _ in got:
        headers = props.headers or {}
        assert "x-death" not in headers
        assert headers[h.H_ATTEMPT] == 1
        assert headers[h.H_TARGET] == n.queue_key("push")


def test_a_failed_publish_puts_the_message_back_and_stops(ops: Ops) -> None:
    n = ops.names
    ops.park("orders.cancel", 2)
    channel = ops.conn.channel()
    channel.exchange_delete(n.tier_exchange("1s"))
    channel.close()
    result = ops.run("replay", "orders.cancel", "--tier", "1s", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert (report["ok"], report["moved"]) == (False, 0)
    assert "could not be re-published" in report["error"]
    assert n.tier_exchange("1s") in report["error"]
    text = ops.run("replay", "orders.cancel", "--tier", "1s")
    assert text.exit_code == 1
    assert "It is back in" in text.stderr
    wait_for(lambda: ops.count(n.parking_queue("orders.cancel")) == 2, timeout=5)
    assert ops.count(n.tier_queue("1s")) == 0
    # The order is kept: the failed message went back to the head.
    assert ops.run("replay", "orders.cancel").exit_code == 0
    wait_for(lambda: ops.count(n.business_queue("orders.cancel")) == 2, timeout=5)
    assert [p.message_id for p, _ in ops.drain(n.business_queue("orders.cancel"))] == ["p0", "p1"]
