"""Fault tests, counted as RabbitMQ's Jepsen suite counts: every CONFIRMED message must
be delivered (lost = 0); unconfirmed ones must be re-sent by the publisher or named in
its error; duplicates are counted (at-least-once), and with a guarded worker every
message has exactly one effect.

Each test runs on a scratch node of the broker-under-test's version (one per module and
xdist worker, `_scratch_node.py`), never on the broker under test:

* kill -9 of the node while `publish_many` runs, then a restart on the same data
  (quorum queues keep what they confirmed);
* a TCP proxy (`_proxy.py`) resetting every connection 10 times while 5,000 messages are
  published and consumed through it by a guarded worker;
* a memory alarm (`set_vm_memory_high_watermark 0.0001`) while publishing, then cleared.

Figures: each test prints its tally and, with RABBIT_DELAY_FAULT_FIGURES=DIR, writes it
to DIR (see `_figures.py`, which renders docs/reliability.md from them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from conftest import server_info, unique_namespace

from rabbit_delay import (
    App,
    BrokerBlocked,
    ConnectionSettings,
    HandlerContext,
    ReconnectBackoff,
    Topology,
    UnconfirmedError,
    topology_from_dict,
)
from rabbit_delay.aio import AsyncPublisher
from rabbit_delay.stores import MemoryStore
from rabbit_delay.sync import Publisher, connect, declare

from ._figures import Tally, record, wait_until
from ._proxy import CutProxy
from ._scratch_node import Collector, ScratchNode, scratch_kind, started_node
from .workers.harness import RunningWorker

# One node for the whole module under `--dist loadgroup` (CI): its tests run on one worker.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.scratch,
    pytest.mark.slow,
    pytest.mark.xdist_group("fault-node"),
]

QUEUE = "orders.cancel"
TRANSPORTS = ("sync", "async")
# Reconnect fast: the faults below last milliseconds (a cut) to seconds (a restart).
FAST = ConnectionSettings(backoff=ReconnectBackoff(initial_s=0.05, max_s=0.5), connect_timeout_s=3)
RECOVERY_S = 45.0  # the publishers' recovery deadline: longer than any restart here
CALL_TIMEOUT_S = 60.0  # an async publisher's work past this fails the test


# -- the node and its topologies ---------------------------------------------------------------


@pytest.fixture(scope="module")
def node(broker_url: str) -> Iterator[ScratchNode]:
    """One scratch node for the module (per xdist worker); tests that kill it restart it."""
    with started_node(scratch_kind(broker_url)) as scratch:
        yield scratch


@pytest.fixture
def broker(node: ScratchNode) -> str:
    """The node's version, for the figures ("RabbitMQ 3.10.8")."""
    return f"RabbitMQ {server_info(node.url).version_text}"


@pytest.fixture
def topology(node: ScratchNode, tmp_path: Path) -> Topology:
    """A 1 s tier into one business queue, declared on the node; SQLite guard in tmp_path.
    Not deleted after the test: the node is deleted, with all it holds, after the module
    (a quorum queue's deletion right after a restart takes seconds)."""
    made = topology_from_dict(
        {
            "namespace": unique_namespace(),
            "tiers": {"1s": "1s"},
            "queues": {QUEUE: {}},
            "idempotency": {"store": "sqlite", "path": str(tmp_path / "guard.sqlite3")},
        }
    )
    conn = connect(node.url, name="rd-test faults declare")
    try:
        declare(conn, made)
    finally:
        conn.close()
    return made


@pytest.fixture
def start_worker() -> Iterator[Callable[[str, App, str], RunningWorker]]:
    """Start a worker of a transport on a thread (reconnecting fast); stopped at the end
    of the test if the test did not stop it."""
    running: list[RunningWorker] = []

    def start(transport: str, app: App, url: str) -> RunningWorker:
        worker = RunningWorker(transport, app, url, reconnect_max_s=0.5, close_app=True)
        running.append(worker)
        return worker.start()

    yield start
    for worker in running:
        if worker.thread.is_alive():
            with contextlib.suppress(Exception):
                worker.stop()


def depth(channel: Any, queue: str) -> int:
    return int(channel.queue_declare(queue, passive=True).method.message_count)


def queues_empty(url: str, topology: Topology) -> bool:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        n = topology.names
        return depth(ch, n.tier_queue("1s")) == 0 and depth(ch, n.business_queue(QUEUE)) == 0
    finally:
        conn.close()


class Drain(Collector):
    """A Collector that also records each delivery's body index ({"i": n})."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(url, queue)
        self.indexes: dict[str, int] = {}  # message_id -> i

    def _on_message(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        with self._lock:
            self.indexes[props.message_id or ""] = int(json.loads(body)["i"])
        super()._on_message(ch, method, props, body)

    def snapshot(self) -> dict[str, int]:
        """A copy of `indexes` taken under the lock (the consumer thread adds to it)."""
        with self._lock:
            return dict(self.indexes)


# -- publishing through either transport --------------------------------------------------------


def run_publisher(
    transport: str, url: str, topology: Topology, work: Callable[[Any], Any], **options: Any
) -> Any:
    """Open a publisher of `transport` on `url` (its own connection), hand it to `work`
    (a function of the publisher; for "async", a coroutine function), close it."""
    options.setdefault("settings", FAST)
    options.setdefault("recovery_timeout", RECOVERY_S)
    if transport == "sync":
        publisher = Publisher.connect(topology, url, **options)
        try:
            return work(publisher)
        finally:
            publisher.close()

    async def main() -> Any:
        publisher = await AsyncPublisher.connect(topology, url, **options)
        try:  # a hung publisher fails the test instead of stalling the run
            return await asyncio.wait_for(work(publisher), CALL_TIMEOUT_S)
        finally:
            await publisher.close()

    return asyncio.run(main())


# -- a: kill -9 during publish_many -------------------------------------------------------------

KILL_N = 6000
KILL_AT = 300  # messages in the tier buffer when the node is killed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill_9_during_publish_many_loses_no_confirmed_message(
    transport: str, node: ScratchNode, topology: Topology, broker: str
) -> None:
    """SIGKILL the node once a few hundred of KILL_N messages reached it, mid-call;
    restart it on the same data. The call re-sends what was not confirmed once the node
    is back (same message ids) and returns, or names what it could not confirm. Every
    confirmed message is then delivered through the tier."""
    tally = Tally("kill -9 during publish_many", transport)
    run = unique_namespace()
    bodies = [{"i": i, "run": run} for i in range(KILL_N)]
    times: dict[str, float] = {}
    killer_error: list[BaseException] = []
    call_done = threading.Event()

    def note_listening() -> None:
        """When the restarted node first accepts a TCP connection on its AMQP port
        (RabbitMQ opens its listeners last, once booted): the end of the outage."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", node.port), timeout=0.5).close()
            except OSError:
                time.sleep(0.02)
            else:
                times["listening"] = time.monotonic()
                return

    def kill_mid_call() -> None:
        try:
            watch = pika.BlockingConnection(pika.URLParameters(node.url))
            ch = watch.channel()
            buffer = topology.names.tier_queue("1s")
            while depth(ch, buffer) < KILL_AT and not call_done.is_set():
                time.sleep(0.005)
            with contextlib.suppress(pika.exceptions.AMQPError, OSError):
                watch.close()
            if call_done.is_set():
                return  # too late: the test fails below, saying so
            times["kill"] = time.monotonic()
            node.kill()
            times["dead"] = time.monotonic()  # brokers.sh waited for the VM to be gone
            listening = threading.Thread(target=note_listening, daemon=True)
            listening.start()
            node.start()
            times["up"] = time.monotonic()
            listening.join(10)
        except BaseException as exc:
            killer_error.append(exc)

    killer = threading.Thread(target=kill_mid_call, name="killer", daemon=True)
    unconfirmed: tuple[str, ...] = ()
    returned: list[str] = []

    def work(publisher: Any) -> Any:
        killer.start()
        if transport == "sync":
            return publisher.publish_many(bodies, "1s", queue=QUEUE)

        async def many() -> list[str]:
            ids: list[str] = await publisher.publish_many(bodies, "1s", queue=QUEUE)
            return ids

        return many()

    started = time.monotonic()
    try:
        returned = run_publisher(transport, node.url, topology, work)
    except UnconfirmedError as exc:
        unconfirmed = exc.message_ids
    finally:
        times["returned"] = time.monotonic()
        call_done.set()
        killer.join(120)
    assert not killer_error, f"killing/restarting the node failed: {killer_error[0]!r}"
    assert "kill" in times, f"publish_many ended before {KILL_AT} messages reached the node"
    assert times["dead"] < times["returned"], "the call returned before the node was dead"
    assert node.running

    drain = Drain(node.url, topology.names.business_queue(QUEUE))
    with drain:
        # Every message the call did not name as unconfirmed was confirmed: find each by
        # its index (publish_many makes the ids; the body carries the index).
        named = set(unconfirmed)

        def all_confirmed_arrived() -> bool:
            seen = {i for m, i in drain.snapshot().items() if m not in named}
            return len(seen) + len(named) >= KILL_N

        with contextlib.suppress(AssertionError):
            wait_until(all_confirmed_arrived, 45, "every confirmed message")
        wait_until(lambda: queues_empty(node.url, topology), 20, "the queues to drain")
        time.sleep(0.3)  # the last acks
        received = drain.received
        indexes = drain.snapshot()

    by_index: dict[int, set[str]] = {}
    for message_id, i in indexes.items():
        by_index.setdefault(i, set()).add(message_id)
    for r in received:
        tally.delivered(r.message_id)
    resent_under_new_id = {i: ids for i, ids in by_index.items() if len(ids) > 1}
    assert not resent_under_new_id, f"re-sent under another message_id: {resent_under_new_id}"
    # Confirmed = every index whose id was not named. An index never delivered has an id
    # we never saw: it is lost unless one of the named ids is missing too.
    id_of = {i: next(iter(ids)) for i, ids in by_index.items()}
    undelivered = [i for i in range(KILL_N) if i not in id_of]
    named_undelivered = named - set(indexes)
    lost = len(undelivered) - len(named_undelivered)
    tally.published = [id_of.get(i, f"undelivered-{i}") for i in range(KILL_N)]
    tally.confirmed = {id_of[i] for i in id_of if id_of[i] not in named}
    tally.reported = named
    back = times.get("listening", times["up"])
    tally.recovery_s = [times["returned"] - back]
    tally.extra.update(
        outage_s=round(back - times["kill"], 3),
        lost=lost,
        confirmed=KILL_N - len(named),
        call_s=round(times["returned"] - started, 3),
    )
    figures = record(tally, broker)
    assert lost == 0, f"{lost} confirmed message(s) lost (never delivered): indexes {undelivered}"
    if returned:  # the ids the call returned are the ids delivered, index for index
        assert returned == [id_of[i] for i in range(KILL_N)]
    down_s = back - times["kill"]
    if down_s < RECOVERY_S - 10:  # the node came back well within the deadline
        assert not unconfirmed, (
            f"the node was down {down_s:.1f}s (deadline {RECOVERY_S}s) but the publisher "
            f"gave up on {len(unconfirmed)} message(s)"
        )
    assert figures["delivered"] >= KILL_N - len(named)


# -- b: the network cut 10 times while publishing and consuming --------------------------------

CUT_N = 5000
CUT_BATCH = 50
CUTS = 10
CUT_RATE = 1000.0  # msg/s: publishing lasts ~5 s, so every cut lands mid-stream


def _guarded_app(
    store: str, topology: Topology, effect: Callable[[str], None], transport: str
) -> App:
    """An app whose handler's only effect is `effect(message_id)`, guarded by the SQLite
    store in the test's tmp_path or by a MemoryStore."""
    app = App(topology, store=MemoryStore()) if store == "memory" else App(topology)

    if transport == "sync":

        def handle(_message: Any, ctx: HandlerContext) -> None:
            effect(ctx.message_id or "")

        app.add_consumer(QUEUE, handle)
    else:

        async def handle_async(_message: Any, ctx: HandlerContext) -> None:
            effect(ctx.message_id or "")

        app.add_consumer(QUEUE, handle_async)
    return app


@pytest.mark.parametrize(("transport", "store"), [("sync", "sqlite"), ("async", "memory")])
def test_ten_network_cuts_while_publishing_and_consuming(
    transport: str,
    store: str,
    node: ScratchNode,
    topology: Topology,
    broker: str,
    caplog: pytest.LogCaptureFixture,
    start_worker: Callable[[str, App, str], RunningWorker],
) -> None:
    """A publisher and a guarded worker, both through the proxy; the proxy resets every
    connection after each 500 confirmed messages. The publisher finishes every call by
    itself, the worker resumes after each cut and never acks a stale delivery tag, every
    confirmed message has exactly one effect."""
    caplog.set_level(logging.INFO)
    tally = Tally(f"{CUTS} network cuts, {CUT_N:,} messages", f"{transport} ({store} guard)")
    handled_at: list[tuple[float, int]] = []  # (time of each effect, worker reconnects then)
    running: list[RunningWorker] = []

    def timed_effect(message_id: str) -> None:
        tally.effect(message_id)
        handled_at.append((time.monotonic(), running[0].stats.reconnects if running else 0))

    app = _guarded_app(store, topology, timed_effect, transport)
    confirmed_at: list[tuple[float, int]] = []  # (time a call returned, confirmed so far)
    cutter_error: list[BaseException] = []
    publishing_done = threading.Event()

    with CutProxy("127.0.0.1", node.port) as proxy:
        url = proxy.url_for(node.url)
        worker = start_worker(transport, app, url)
        running.append(worker)
        reconnects_at_cut: list[int] = []

        def confirmed_or_done(threshold: int) -> Callable[[], bool]:
            return lambda: len(tally.confirmed) >= threshold or publishing_done.is_set()

        def cutter() -> None:
            try:
                for k in range(1, CUTS + 1):
                    threshold = 500 * k - 250
                    wait_until(confirmed_or_done(threshold), 30, f"{threshold} confirms (cut {k})")
                    if publishing_done.is_set():
                        return
                    reconnects_at_cut.append(worker.stats.reconnects)
                    proxy.cut_all()
            except BaseException as exc:
                cutter_error.append(exc)

        cuts = threading.Thread(target=cutter, name="cutter", daemon=True)

        def one_call(ids: list[str]) -> None:
            tally.sent(ids)
            confirmed_at.append((time.monotonic(), len(tally.confirmed)))

        def pace(start: float, sent: int) -> float:
            return max(0.0, start + sent / CUT_RATE - time.monotonic())

        def work(publisher: Any) -> Any:
            cuts.start()
            start = time.monotonic()
            if transport == "sync":
                for b in range(0, CUT_N, CUT_BATCH):
                    bodies = [{"i": i} for i in range(b, b + CUT_BATCH)]
                    one_call(publisher.publish_many(bodies, "1s", queue=QUEUE))
                    time.sleep(pace(start, b + CUT_BATCH))
                return None

            async def loop() -> None:
                for b in range(0, CUT_N, CUT_BATCH):
                    bodies = [{"i": i} for i in range(b, b + CUT_BATCH)]
                    one_call(await publisher.publish_many(bodies, "1s", queue=QUEUE))
                    await asyncio.sleep(pace(start, b + CUT_BATCH))

            return loop()

        try:
            run_publisher(transport, url, topology, work)  # any exception fails the test
        finally:
            publishing_done.set()
            if cuts.ident is not None:
                cuts.join(30)
        assert not cutter_error, repr(cutter_error[0])
        assert proxy.cuts == CUTS, f"{proxy.cuts} cuts, not {CUTS}"

        with contextlib.suppress(AssertionError):  # counted below
            wait_until(lambda: not tally.unhandled(tally.confirmed), 20, "every message handled")
        wait_until(lambda: queues_empty(node.url, topology), 20, "the queues to drain")
        time.sleep(0.5)  # redeliveries in flight reach the guard
        alive = worker.thread.is_alive() and worker.error is None
        stats = worker.stats.as_dict()
        worker.stop()

    # Recovery after each cut: to the next confirmed call; to the next message handled
    # on a new connection (one the worker opened after the cut), if it was consuming.
    publisher_recovery, worker_recovery, unresumed = [], [], []
    for k, (cut, before) in enumerate(zip(proxy.cut_times, reconnects_at_cut, strict=True), 1):
        after = [t for t, _ in confirmed_at if t > cut]
        if after:
            publisher_recovery.append(after[0] - cut)
        if any(t < cut for t, _ in handled_at):
            resumed = [t for t, r in handled_at if t > cut and r > before]
            if resumed:
                worker_recovery.append(resumed[0] - cut)
            else:
                unresumed.append(k)
    for message_id in list(tally.effects):
        tally.delivered(message_id)
    tally.recovery_s = publisher_recovery
    tally.extra.update(
        worker_recovery_s=[round(r, 3) for r in sorted(worker_recovery)],
        duplicates=max(0, stats["received"] - len(tally.effects)),
        worker=stats,
        proxy={"accepted": proxy.accepted, "cut_connections": proxy.cut_connections},
    )
    record(tally, broker)

    lost = tally.lost
    assert not lost, f"{len(lost)} confirmed message(s) never handled, e.g. {lost[:5]}"
    twice = {m: n for m, n in tally.effects.items() if n != 1}
    assert not twice, f"{len(twice)} message(s) with more than one effect: {list(twice)[:5]}"
    assert len(tally.confirmed) == CUT_N
    assert alive, f"the worker died: {worker.error!r}"
    assert not unresumed, f"the worker handled nothing after cut(s) {unresumed}"
    assert stats["reconnects"] >= 1, stats
    stale_acks = [
        r.getMessage()
        for r in caplog.records
        if "unknown delivery tag" in r.getMessage() or "PRECONDITION_FAILED" in r.getMessage()
    ]
    assert not stale_acks, f"a stale delivery tag was acked: {stale_acks[:3]}"
    assert len(publisher_recovery) == CUTS, "a cut after which no call returned"


# -- c: memory alarm ---------------------------------------------------------------------------

BLOCKED_TIMEOUT_S = 2.0
MARGIN_S = 1.5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_memory_alarm_raises_broker_blocked_in_time_then_publishing_resumes(
    transport: str,
    node: ScratchNode,
    topology: Topology,
    broker: str,
    caplog: pytest.LogCaptureFixture,
    start_worker: Callable[[str, App, str], RunningWorker],
) -> None:
    """With the node's memory watermark at 0.0001 (an alarm), a publish waits
    `blocked_timeout` and raises BrokerBlocked naming every id of the call; once the
    watermark is back at 0.4 the same publisher publishes them again (same ids). A worker
    on the node meanwhile keeps running; every id ends with exactly one effect."""
    caplog.set_level(logging.INFO)
    tally = Tally("memory alarm", transport)
    app = _guarded_app("memory", topology, tally.effect, transport)
    times: dict[str, float] = {}
    worker = start_worker(transport, app, node.url)
    alarm = False

    def work(publisher: Any) -> Any:
        nonlocal alarm

        def before() -> Any:
            return publisher.publish_many([{"i": i} for i in range(20)], "1s", queue=QUEUE)

        def blocked() -> Any:
            return publisher.publish_many([{"i": i} for i in range(20, 30)], "1s", queue=QUEUE)

        def again(ids: tuple[str, ...]) -> Any:
            return [
                publisher.publish_delayed({"again": m}, "1s", queue=QUEUE, message_id=m)
                for m in ids
            ]

        if transport == "async":

            async def run_async() -> tuple[list[str], BrokerBlocked, list[str]]:
                ids = await before()
                nonlocal alarm
                # rabbitmqctl on a thread: the loop keeps reading the broker's frames
                await asyncio.to_thread(node.ctl, "set_vm_memory_high_watermark", "0.0001")
                alarm = True
                times["blocked"] = time.monotonic()
                with pytest.raises(BrokerBlocked) as raised:
                    await blocked()
                times["raised"] = time.monotonic()
                await asyncio.to_thread(node.ctl, "set_vm_memory_high_watermark", "0.4")
                alarm = False
                times["cleared"] = time.monotonic()
                resent = [await c for c in again(raised.value.message_ids)]
                times["resumed"] = time.monotonic()
                return ids, raised.value, resent

            return run_async()

        ids = before()
        node.ctl("set_vm_memory_high_watermark", "0.0001")
        alarm = True
        times["blocked"] = time.monotonic()
        with pytest.raises(BrokerBlocked) as raised:
            blocked()
        times["raised"] = time.monotonic()
        node.ctl("set_vm_memory_high_watermark", "0.4")
        alarm = False
        times["cleared"] = time.monotonic()
        resent = again(raised.value.message_ids)
        times["resumed"] = time.monotonic()
        return ids, raised.value, resent

    try:
        ids, error, resent = run_publisher(
            transport, node.url, topology, work, blocked_timeout=BLOCKED_TIMEOUT_S
        )
        tally.sent(ids)
        tally.sent(error.message_ids, unconfirmed=error.message_ids)
        tally.sent(resent)
        wait_until(lambda: not tally.unhandled(tally.confirmed), 20, "every confirmed id handled")
        wait_until(lambda: queues_empty(node.url, topology), 20, "the queues to drain")
        time.sleep(0.3)
        alive = worker.thread.is_alive() and worker.error is None
        stats = worker.stats.as_dict()
    finally:
        if alarm:
            node.ctl("set_vm_memory_high_watermark", "0.4")
        worker.stop()

    for message_id in list(tally.effects):
        tally.delivered(message_id)
    waited = times["raised"] - times["blocked"]
    tally.recovery_s = [times["resumed"] - times["cleared"]]
    tally.extra.update(
        blocked_raised_after_s=round(waited, 3),
        duplicates=max(0, stats["received"] - len(tally.effects)),
        worker=stats,
    )
    record(tally, broker)

    assert len(set(error.message_ids)) == 10, error.message_ids  # every id of the call
    assert "memory" in (error.reason + str(error)).lower(), f"the alarm is not named: {error}"
    assert waited <= BLOCKED_TIMEOUT_S + MARGIN_S, f"BrokerBlocked after {waited:.2f}s"
    assert waited >= BLOCKED_TIMEOUT_S * 0.8, f"BrokerBlocked after only {waited:.2f}s"
    assert resent == list(error.message_ids)
    assert not tally.lost, tally.lost
    assert all(n == 1 for n in tally.effects.values()), tally.effects
    assert alive, f"the worker died during the alarm: {worker.error!r}"
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("rabbit_delay")
    ]
    assert any("block" in w.lower() for w in warnings), f"no warning about the block: {warnings}"
