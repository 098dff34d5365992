"""Publishers recover, on a scratch node this module starts (one node, both transports):

* the broker closes every connection (`close_all_connections`) while `publish_many`
  runs: every call returns all its ids, every id is in the queue, no error;
* the broker stays down past `recovery_timeout`: `UnconfirmedError` naming exactly the
  ids with no confirm; after a restart, every id not named is on the broker;
* a memory alarm: `BrokerBlocked` within `blocked_timeout` naming the ids, a WARNING
  with the broker's reason; once the alarm clears the same publisher publishes again;
* nothing but `rabbit_delay` errors leaves a public call in any of these faults.

Messages go to a 1 h tier: they wait in its buffer queue, which the test reads to see
which ids reached the broker (no need to wait for a delay).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest

from rabbit_delay import (
    BrokerBlocked,
    ConnectionSettings,
    RabbitDelayError,
    ReconnectBackoff,
    Topology,
    UnconfirmedError,
    topology_from_dict,
)
from rabbit_delay.aio import AsyncPublisher
from rabbit_delay.sync import Publisher, connect, declare

from ._scratch_node import ScratchNode, scratch_kind, started_node

# One node per module and xdist worker; under `--dist loadgroup` one for the whole run.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.scratch,
    pytest.mark.xdist_group("publisher-recovery-node"),
]

KINDS = ["sync", "aio"]
TIER = "1h"
QUEUE = "jobs"
# quick reconnects: the node is local
# rabbitmqctl's own timeout (ScratchNode.ctl) and a margin
CLOSE_WAIT_S = 150.0
READ_STALL_S = 10.0
SETTINGS = ConnectionSettings(
    backoff=ReconnectBackoff(initial_s=0.1, max_s=0.5), connect_timeout_s=2
)


@pytest.fixture(scope="module")
def node(broker_url: str) -> Iterator[ScratchNode]:
    with started_node(scratch_kind(broker_url)) as started:
        yield started


def declared(node: ScratchNode) -> Topology:
    topology = topology_from_dict(
        {
            "namespace": "t" + uuid.uuid4().hex[:10],
            "tiers": {TIER: TIER},
            "queues": {QUEUE: {}},
        }
    )
    conn = connect(node.url)
    try:
        declare(conn, topology)
    finally:
        conn.close()
    return topology


def ids_on_broker(node: ScratchNode, topology: Topology, expected: int) -> list[str]:
    """Every message_id in the tier's buffer (duplicates included), taken out of it."""
    queue = topology.names.tier_queue(TIER)
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        channel = conn.channel()
        total = channel.queue_declare(queue, passive=True).method.message_count
        seen: list[str] = []

        def on_message(_ch: Any, _m: Any, props: pika.BasicProperties, _b: bytes) -> None:
            seen.append(str(props.message_id))

        channel.basic_consume(queue, on_message, auto_ack=True)
        # Read until every message counted is in, giving up only once nothing has come for
        # READ_STALL_S (a fixed deadline cut short a read of 244,000 messages under load).
        last, progress = len(seen), time.monotonic()
        while len(seen) < max(total, expected) and time.monotonic() - progress < READ_STALL_S:
            conn.process_data_events(time_limit=0.1)
            if len(seen) != last:
                last, progress = len(seen), time.monotonic()
        return seen
    finally:
        if conn.is_open:
            conn.close()


class Driver:
    """One publisher of either transport, with plain calls."""

    def __init__(self, kind: str, node: ScratchNode, topology: Topology, **options: Any):
        options.setdefault("settings", SETTINGS)
        self.kind = kind
        if kind == "sync":
            self.sync = Publisher.connect(topology, node.url, **options)
        else:
            self.runner = asyncio.Runner()
            self.aio = self.runner.run(AsyncPublisher.connect(topology, node.url, **options))

    def publish_many(self, count: int) -> list[str]:
        """publish_many, with the ids of the call known beforehand (`last_ids`): its
        messages are prepared as publish_many would."""
        bodies = [{"n": n} for n in range(count)]
        publisher = self.sync if self.kind == "sync" else self.aio
        outs = publisher.prepare_many(bodies, TIER, queue=QUEUE)
        self.last_ids = [o.message_id for o in outs]
        if self.kind == "sync":
            return self.sync.publish_outgoing(outs)
        return self.runner.run(self.aio.publish_outgoing(outs))

    def close(self) -> None:
        if self.kind == "sync":
            self.sync.close()
        else:
            try:
                self.runner.run(self.aio.close())
            finally:
                self.runner.close()


@pytest.fixture
def driver_factory() -> Iterator[Callable[..., Driver]]:
    made: list[Driver] = []

    def make(*args: Any, **options: Any) -> Driver:
        made.append(Driver(*args, **options))
        return made[-1]

    yield make
    for driver in made:
        driver.close()


def in_background(action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def only_our_errors(exc: BaseException) -> None:
    assert isinstance(exc, RabbitDelayError), f"a client exception escaped: {exc!r}"
    assert type(exc).__module__.startswith("rabbit_delay"), type(exc)


@pytest.mark.parametrize("kind", KINDS)
def test_connections_closed_by_the_broker_during_publish_many(
    node: ScratchNode,
    kind: str,
    driver_factory: Callable[..., Driver],
    caplog: pytest.LogCaptureFixture,
) -> None:
    topology = declared(node)
    driver = driver_factory(kind, node, topology)
    closer = in_background(lambda: node.ctl("close_all_connections", "test: cut the publisher"))
    published: list[str] = []
    calls = 0
    # Calls go on until the close is done, so it lands in one of them. Bounded by time,
    # not by calls: on a loaded machine rabbitmqctl alone can take longer than 60 calls
    # (seen in CI on 4.3); its own timeout is 120 s.
    deadline = time.monotonic() + CLOSE_WAIT_S
    with caplog.at_level(logging.WARNING, logger="rabbit_delay.publisher"):
        while closer.is_alive() or calls < 2:
            try:
                ids = driver.publish_many(2000)
            except Exception as exc:
                only_our_errors(exc)
                pytest.fail(f"publish_many raised after a connection close: {exc!r}")
            assert len(ids) == 2000
            assert len(set(ids)) == 2000
            published += ids
            calls += 1
            assert time.monotonic() < deadline, (
                f"the connections were never closed ({calls} calls in {CLOSE_WAIT_S:.0f} s)"
            )
    recovered = [r.getMessage() for r in caplog.records if "reconnected" in r.getMessage()]
    assert recovered, "the close did not hit a publish call (no reconnect logged)"
    on_broker = ids_on_broker(node, topology, len(published))
    missing = set(published) - set(on_broker)
    assert not missing, f"{len(missing)} of {len(published)} confirmed ids are not on the broker"


@pytest.mark.parametrize("kind", KINDS)
def test_a_broker_down_past_the_deadline_names_exactly_the_unconfirmed_ids(
    node: ScratchNode, kind: str, driver_factory: Callable[..., Driver]
) -> None:
    topology = declared(node)
    driver = driver_factory(kind, node, topology, recovery_timeout=1.5)
    stopper = in_background(lambda: node.ctl("stop_app"))
    confirmed: list[str] = []
    failure: UnconfirmedError | None = None
    try:
        started = time.monotonic()
        while failure is None:
            assert time.monotonic() - started < 60, "the broker never went down"
            try:
                confirmed += driver.publish_many(2000)
            except UnconfirmedError as exc:
                failure = exc
            except Exception as exc:
                only_our_errors(exc)
                raise
        stopper.join(60)
    finally:
        node.ctl("start_app")
    assert failure is not None
    call = driver.last_ids  # the ids of the call that failed
    named = list(failure.message_ids)
    assert named, "UnconfirmedError names no id"
    assert len(set(named)) == len(named)
    assert set(named) <= set(call)
    assert "1.5s" in str(failure)
    # Every id not named was confirmed: on the broker after the restart, like every id
    # of the calls that returned. The named ones may or may not be there.
    said_confirmed = set(confirmed) | (set(call) - set(named))
    on_broker = set(ids_on_broker(node, topology, len(said_confirmed)))
    lost = said_confirmed - on_broker
    assert not lost, f"{len(lost)} of {len(said_confirmed)} confirmed ids are not on the broker"
    # named ids: unsent or sent without a confirm, in call order after the confirmed ones
    # of the call (one queue confirms in order)
    assert call[-len(named) :] == named


@pytest.mark.parametrize("kind", KINDS)
def test_a_memory_alarm_raises_broker_blocked_then_publishing_resumes(
    node: ScratchNode,
    kind: str,
    driver_factory: Callable[..., Driver],
    caplog: pytest.LogCaptureFixture,
) -> None:
    topology = declared(node)
    driver = driver_factory(kind, node, topology, blocked_timeout=2)
    assert len(driver.publish_many(10)) == 10  # connected before the alarm
    node.ctl("set_vm_memory_high_watermark", "0.0001")
    try:
        with caplog.at_level(logging.WARNING, logger="rabbit_delay.publisher"):
            started = time.monotonic()
            with pytest.raises(BrokerBlocked) as raised:
                driver.publish_many(50)
            waited = time.monotonic() - started
    finally:
        node.ctl("set_vm_memory_high_watermark", "0.4")
    error = raised.value
    assert 1.5 <= waited <= 5.0, f"BrokerBlocked after {waited:.1f}s (blocked_timeout 2s)"
    assert len(error.message_ids) == 50
    assert "memory" in error.reason
    assert "memory" in str(error)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("blocked publishing" in w and "memory" in w for w in warnings), warnings
    # Once the alarm cleared the same publisher works again by itself.
    deadline = time.monotonic() + 30
    while True:
        try:
            ids = driver.publish_many(20)
            break
        except BrokerBlocked:
            assert time.monotonic() < deadline, "still blocked 30 s after the alarm cleared"
            time.sleep(0.2)
    assert len(ids) == 20
    assert set(ids) <= set(ids_on_broker(node, topology, 30 + len(ids)))
