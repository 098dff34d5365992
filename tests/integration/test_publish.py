"""Publishing delayed messages on the real broker: the same suite for sync and async.

The timing scenarios of several tests share one run per transport (`timed`): every
message is published at once and the tests then read what arrived, so the suite waits
for the 3 s tier once per transport instead of once per test.

Timing bounds, on this machine's clock (the broker runs here too): a message never
arrives before its `rd-due-at` header (publish time + tier), and at most LATE_MS after.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pika
import pytest
from conftest import message_count, wait_for
from pydantic import BaseModel

from rabbit_delay import (
    DelayError,
    EncodeError,
    MissingObjectError,
    Topology,
    UnknownTargetError,
    UnroutableError,
    topology_from_dict,
)

from ._publishers import (
    Arrival,
    Collector,
    Transport,
    delete_queue,
    open_transport,
)

pytestmark = pytest.mark.integration
# The tests of the module's `timed` run: on one xdist worker, so it publishes and waits once
# per kind (apart, each worker that got one of them ran it again).
TIMED = pytest.mark.xdist_group("publish-timed")

LATE_MS = 500
KINDS = ["sync", "aio"]


class CancelOrder(BaseModel):
    order_id: int
    reason: str


@pytest.fixture(params=KINDS)
def transport(request: pytest.FixtureRequest, broker_url: str) -> Iterator[Transport]:
    with open_transport(request.param, broker_url) as opened:
        yield opened


# -- one timed run per transport ---------------------------------------------------------


@dataclass
class TimedRun:
    topology: Topology
    ids: dict[str, str]  # scenario label -> message id
    calling_ms: dict[str, int]  # label -> time the publish call was made
    published_ms: dict[str, int]  # label -> time the publish call returned (confirmed)
    collector: Collector

    def arrivals(self, label: str) -> list[Arrival]:
        return self.collector.of(self.ids[label])

    def only(self, label: str) -> Arrival:
        found = self.arrivals(label)
        assert len(found) == 1, f"{label}: expected exactly one delivery, got {found}"
        return found[0]

    def queue(self, logical: str) -> str:
        return self.topology.names.business_queue(logical)


@pytest.fixture(scope="module", params=KINDS)
def timed(request: pytest.FixtureRequest, broker_url: str) -> Iterator[TimedRun]:
    """Publish every timing scenario at once, then wait until all of it has arrived.

    Queues `orders.cancel` and `push` share the 1 s and 3 s buffers; `gone` is deleted
    after declaring, so what is published for it must end in the catch-all queue.
    """
    from conftest import delete_topology, unique_namespace

    topology = topology_from_dict(
        {
            "namespace": unique_namespace(),
            "tiers": {"1s": "1s", "3s": "3s"},
            "queues": {"orders.cancel": {}, "push": {"bindings": ["push.any"]}, "gone": {}},
        }
    )
    n = topology.names
    try:
        with open_transport(request.param, broker_url) as transport:
            transport.declare(topology)
            delete_queue(broker_url, n.business_queue("gone"))
            queues = [
                n.business_queue("orders.cancel"),
                n.business_queue("push"),
                n.unroutable_queue(),
            ]
            with Collector(broker_url, queues) as collector:
                publisher = transport.publisher(topology)
                ids: dict[str, str] = {}
                calling: dict[str, int] = {}
                published: dict[str, int] = {}

                def send(label: str, *args: Any, **kwargs: Any) -> None:
                    calling[label] = int(time.time() * 1000)
                    ids[label] = publisher.publish_delayed(*args, **kwargs)
                    published[label] = int(time.time() * 1000)

                # The 3 s message goes in first: it must not hold back the 1 s one.
                send(
                    "orders-3s",
                    {"n": "orders-3s"},
                    "3s",
                    queue="orders.cancel",
                    message_id="given-id-3s",
                )
                send("gone-1s", {"n": "gone-1s"}, "1s", queue="gone")
                send(
                    "orders-1s",
                    CancelOrder(order_id=7, reason="unpaid"),
                    "1s",
                    queue="orders.cancel",
                )
                send("push-1s-key", {"n": "push-1s-key"}, delay=1, routing_key="push.any")
                send("push-3s", {"n": "push-3s"}, delay=timedelta(seconds=3), queue="push")
                send("gone-3s", {"n": "gone-3s"}, "3s", queue="gone")
                # behind an orphan in the same buffer: must still be on time
                send("push-1s", b"\x00raw", "1s", queue="push", headers={"trace": "abc"})
                collector.wait_for(ids.values(), timeout=3 + 5)
                time.sleep(0.3)  # let any duplicate or stray delivery show up
                yield TimedRun(topology, ids, calling, published, collector)
    finally:
        delete_topology(broker_url, topology)


@TIMED
def test_each_message_arrives_in_its_own_queue_only(timed: TimedRun) -> None:
    where = {
        "orders-3s": "orders.cancel",
        "orders-1s": "orders.cancel",
        "push-1s-key": "push",
        "push-3s": "push",
        "push-1s": "push",
    }
    for label, logical in where.items():
        assert timed.only(label).queue == timed.queue(logical), label
    assert len(timed.collector.arrivals) == len(timed.ids), (
        "a message arrived twice or in two queues"
    )


@TIMED
def test_never_early_and_at_most_500ms_late(timed: TimedRun) -> None:
    for label in timed.ids:
        arrival = timed.only(label)
        tier_ms = int(arrival.headers["rd-delay-ms"])
        assert tier_ms == (1000 if "-1s" in label else 3000), label
        # rd-due-at is the publish time plus the tier
        due = int(arrival.headers["rd-due-at"])
        assert timed.calling_ms[label] <= due - tier_ms <= timed.published_ms[label], label
        assert 0 <= arrival.lateness_ms <= LATE_MS, f"{label}: {arrival.lateness_ms} ms late"


@TIMED
def test_a_longer_tier_published_first_does_not_hold_back_a_shorter_one(timed: TimedRun) -> None:
    first, second = timed.only("orders-3s"), timed.only("orders-1s")
    assert timed.published_ms["orders-3s"] <= timed.published_ms["orders-1s"]
    assert second.arrived_ms < first.arrived_ms
    assert second.lateness_ms <= LATE_MS


@TIMED
def test_delivered_headers_and_properties(timed: TimedRun) -> None:
    given = timed.only("orders-3s")
    assert given.message_id == "given-id-3s"
    generated = timed.only("orders-1s")
    assert re.fullmatch(r"[0-9a-f]{32}", generated.message_id)
    assert generated.message_id == timed.ids["orders-1s"]
    assert json.loads(generated.body) == {"order_id": 7, "reason": "unpaid"}
    for label, tier in (
        ("orders-3s", "3s"),
        ("orders-1s", "1s"),
        ("push-1s-key", "1s"),
        ("push-3s", "3s"),
    ):
        arrival = timed.only(label)
        props = arrival.properties
        assert props.delivery_mode == 2, label
        assert props.content_type == "application/json", label
        headers = arrival.headers
        assert headers["rd-tier"] == tier, label
        assert headers["rd-attempt"] == 1, label
        assert headers["rd-delay-ms"] == int(tier[0]) * 1000, label
        assert isinstance(headers["rd-due-at"], int), label
        assert abs(props.timestamp * 1000 - (headers["rd-due-at"] - int(tier[0]) * 1000)) < 2000, (
            label
        )
    assert timed.only("push-1s-key").headers["rd-target"] == "push.any"
    assert timed.only("push-3s").headers["rd-target"] == timed.queue("push")
    raw = timed.only("push-1s")
    assert raw.body == b"\x00raw"
    assert raw.properties.content_type == "application/octet-stream"
    assert raw.headers["trace"] == "abc"


@TIMED
def test_orphan_lands_in_the_catch_all_and_does_not_block_the_buffer(timed: TimedRun) -> None:
    catch_all = timed.topology.names.unroutable_queue()
    assert catch_all == f"{timed.topology.names.prefix}.unroutable"
    for label in ("gone-1s", "gone-3s"):
        arrival = timed.only(label)
        assert arrival.queue == catch_all, label
        assert arrival.headers["rd-target"] == timed.queue("gone")
    behind = timed.only("push-1s")
    assert timed.published_ms["gone-1s"] < timed.published_ms["push-1s"]
    assert behind.queue == timed.queue("push")
    assert 0 <= behind.lateness_ms <= LATE_MS


# -- one topology per test ------------------------------------------------------------------


@pytest.fixture
def declared(transport: Transport, make_topology: Any) -> Topology:
    topology: Topology = make_topology()
    transport.declare(topology)
    return topology


def buffers_empty(url: str, topology: Topology) -> bool:
    return all(message_count(url, topology.names.tier_queue(t)) == 0 for t in topology.tiers)


def test_unroutable_publish_raises(
    transport: Transport, declared: Topology, broker_url: str
) -> None:
    delete_queue(broker_url, declared.names.tier_queue("1s"))
    publisher = transport.publisher(declared)
    with pytest.raises(UnroutableError, match="returned by the broker") as info:
        publisher.publish_delayed({"a": 1}, "1s", queue="push", message_id="lost-1")
    assert info.value.message_ids == ("lost-1",)

    with pytest.raises(UnroutableError) as many:
        publisher.publish_many([{"i": i} for i in range(5)], "1s", queue="push")
    assert len(many.value.message_ids) == 5

    # the publisher is still usable, and the 3 s buffer still works
    assert publisher.publish_delayed({"a": 2}, "3s", queue="push")
    assert message_count(broker_url, declared.names.tier_queue("3s")) == 1


BAD_INPUT: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unknown tier", {"tier": "2s", "queue": "push"}, DelayError, "unknown tier '2s'"),
    ("unknown queue", {"tier": "1s", "queue": "nope"}, UnknownTargetError, "unknown queue 'nope'"),
    (
        "unknown key",
        {"tier": "1s", "routing_key": "nope"},
        UnknownTargetError,
        "routing key 'nope'",
    ),
    ("negative delay", {"delay": -1, "queue": "push"}, DelayError, "negative"),
    (
        "negative timedelta",
        {"delay": timedelta(seconds=-3), "queue": "push"},
        DelayError,
        "negative",
    ),
    (
        "too long delay",
        {"delay": timedelta(days=60), "queue": "push"},
        DelayError,
        "no tier has a delay of 60d",
    ),
    ("no matching tier", {"delay": 2, "queue": "push"}, DelayError, r"tiers: 1s=1s, 3s=3s"),
    (
        "past at",
        {"at": datetime.now(UTC) - timedelta(seconds=5), "queue": "push"},
        DelayError,
        "in the past",
    ),
    ("naive at", {"at": datetime(2999, 1, 1), "queue": "push"}, DelayError, "no timezone"),
    (
        "malformed message",
        {"msg": {"when": datetime.now(UTC)}, "tier": "1s", "queue": "push"},
        EncodeError,
        "not JSON-serialisable",
    ),
    (
        "not a message",
        {"msg": "plain text", "tier": "1s", "queue": "push"},
        EncodeError,
        "cannot publish a str",
    ),
    (
        "message id too long",
        {"tier": "1s", "queue": "push", "message_id": "x" * 256},
        EncodeError,
        "message_id",
    ),
]


@pytest.mark.parametrize(
    ("label", "kwargs", "error", "match"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT]
)
def test_bad_input_is_refused_before_anything_is_sent(
    transport: Transport,
    declared: Topology,
    broker_url: str,
    label: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    publisher = transport.publisher(declared)
    kwargs = dict(kwargs)
    msg = kwargs.pop("msg", {"ok": True})
    with pytest.raises(error, match=match):
        publisher.publish_delayed(msg, **kwargs)
    assert publisher.sends == 0, label
    batch_kwargs = {k: v for k, v in kwargs.items() if k != "message_id"}
    if "message_id" not in kwargs:
        # a batch with one bad message, or a bad target, sends none of them
        with pytest.raises(error, match=match):
            publisher.publish_many([{"ok": 1}, msg, {"ok": 2}], **batch_kwargs)
        assert publisher.sends == 0, label
    assert buffers_empty(broker_url, declared)


def test_publish_many_2000_confirmed_and_all_arrive(
    transport: Transport, declared: Topology, broker_url: str
) -> None:
    publisher = transport.publisher(declared)
    started = time.monotonic()
    ids = publisher.publish_many(({"i": i} for i in range(2000)), "1s", queue="orders.cancel")
    elapsed = time.monotonic() - started
    assert len(ids) == 2000 == len(set(ids))
    assert publisher.sends == 2000
    # confirmed: every message is in the buffer or already past it
    queue = declared.names.business_queue("orders.cancel")
    wait_for(
        lambda: message_count(broker_url, queue) == 2000,
        1 + elapsed + 10,
        "2000 messages in the queue",
    )
    assert message_count(broker_url, declared.names.unroutable_queue()) == 0


def test_undeclared_topology_is_a_missing_object_then_the_publisher_recovers(
    transport: Transport, make_topology: Any, broker_url: str
) -> None:
    topology: Topology = make_topology()
    publisher = transport.publisher(topology)
    for _ in range(3):
        with pytest.raises(
            MissingObjectError, match=r"no exchange .*delay\.1s.*rabbit-delay declare"
        ):
            publisher.publish_delayed({"a": 1}, "1s", queue="push")
    with pytest.raises(MissingObjectError):
        publisher.publish_many([{"a": 1}, {"a": 2}], "1s", queue="push")
    transport.declare(topology)
    assert publisher.publish_delayed({"a": 2}, "3s", queue="push")
    assert publisher.publish_many([{"a": 3}, {"a": 4}], "3s", queue="push")
    assert message_count(broker_url, topology.names.tier_queue("3s")) == 3
    assert publisher.open_channels() == 1  # the failed channels were not left open


@pytest.fixture
def far_east(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run with a local timezone nine hours from UTC."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("far_east")
def test_amqp_timestamp_is_utc_whatever_the_local_timezone(
    transport: Transport, declared: Topology, broker_url: str
) -> None:
    publisher = transport.publisher(declared)
    before = int(time.time())
    publisher.publish_delayed({"a": 1}, "3s", queue="push")
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        _method, properties, _body = connection.channel().basic_get(
            declared.names.tier_queue("3s"), auto_ack=True
        )
    finally:
        connection.close()
    assert properties is not None
    assert before - 1 <= properties.timestamp <= int(time.time()) + 1
