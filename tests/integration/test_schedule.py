"""The schedule on the real broker: what is lost in transit is recovered without user code
(a purged buffer, a publisher killed between the record and the publish), a cancel
holds however far the message is (from another process and directory too), and a
cancel without the schedule still outlives its message.

Each case runs both workers where the worker matters (KINDS)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import MakeTopology, wait_for

from rabbit_delay import App, HandlerContext, ScheduleState, Topology
from rabbit_delay.sync import Publisher, Schedule, connected, declare

from .workers.harness import KINDS, RunningWorker

pytestmark = pytest.mark.integration

QUEUE = "orders.cancel"
REPO = Path(__file__).resolve().parents[2]


class Seen:
    """Every handler call by message body, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bodies: Counter[bytes] = Counter()
        self.headers: list[dict[str, Any]] = []

    def handle(self, msg: bytes, ctx: HandlerContext) -> None:
        with self._lock:
            self.bodies[msg] += 1
            self.headers.append(dict(ctx.headers))

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.bodies.values())


def schedule_data(tmp_path: Path, **schedule: Any) -> dict[str, Any]:
    return {
        "tiers": {"1s": "1s", "10s": "10s"},
        # a binding both queues share: a keyed publish must name one queue
        "queues": {QUEUE: {"bindings": ["fan.out"]}, "push": {"bindings": ["fan.out"]}},
        "schedule": schedule,
        "idempotency": {"store": "sqlite", "path": str(tmp_path / "schedule.sqlite3")},
    }


def schedule_topology(make_topology: MakeTopology, tmp_path: Path, **schedule: Any) -> Topology:
    return make_topology(**schedule_data(tmp_path, **schedule))


def topology_file(topology: Topology, tmp_path: Path, **schedule: Any) -> Path:
    """The topology as a JSON file another process loads (`topology_from_dict`)."""
    path = tmp_path / "topology.json"
    path.write_text(
        json.dumps({"namespace": topology.namespace, **schedule_data(tmp_path, **schedule)})
    )
    return path


def declared(topology: Topology, url: str) -> None:
    with connected(url) as connection:
        declare(connection, topology)


def purge(url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_purge(queue).method.message_count)
    finally:
        conn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_purged_buffer_is_recovered_by_the_sweeper_each_message_once(
    kind: str, broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    topology = schedule_topology(make_topology, tmp_path, grace="2s", sweep_every="1s")
    declared(topology, broker_url)
    messages = 1_000
    with Publisher(topology, broker_url) as publisher:
        bodies = [{"order": n} for n in range(messages)]
        ids = publisher.publish_many(bodies, "10s", queue=QUEUE)
    assert len(set(ids)) == messages
    # every message is lost in its buffer: what a purge, a lost classic queue or a broker
    # restored from an old backup does
    buffer = topology.tier_queues("10s")[0]
    assert purge(broker_url, buffer) == messages

    app = App(topology)
    seen = Seen()
    app.add_consumer(QUEUE, seen.handle)
    worker = RunningWorker(kind, app, broker_url, close_app=True).start()
    try:
        wait_for(lambda: seen.total >= messages, 60, f"{messages} messages handled")
        # a second sweep (every 1s) republishes nothing: every record is handled
        wait_for(lambda: worker.worker.stats.acked >= messages, 10, "the handled messages acked")
    finally:
        worker.stop()
    assert seen.total == messages  # lost 0, duplicates 0
    assert all(n == 1 for n in seen.bodies.values())
    with Schedule(topology) as schedule:
        page = schedule.list(state="scheduled", limit=10)
        assert page == []  # nothing still waits
        record = schedule.lookup(ids[0])
        assert record is not None
        assert (record.state, record.republished) == (ScheduleState.HANDLED, 1)


def test_a_publisher_killed_between_the_record_and_the_publish_loses_nothing(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    topology = schedule_topology(make_topology, tmp_path, grace="1s", sweep_every="1s")
    declared(topology, broker_url)
    path = topology_file(topology, tmp_path, grace="1s", sweep_every="1s")
    script = textwrap.dedent(
        f"""
        import os, signal
        from rabbit_delay import topology_from_dict
        from rabbit_delay.sync import Publisher
        import json, pathlib

        topology = topology_from_dict(json.loads(pathlib.Path({str(path)!r}).read_text()))
        publisher = Publisher(topology, {broker_url!r})

        def die(*_args, **_kwargs):  # the record is written; the process dies before the send
            os.kill(os.getpid(), signal.SIGKILL)

        publisher._tracked = die
        publisher.publish_delayed({{"order": 42}}, "1s", queue={QUEUE!r}, key="order-42")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()
    with Schedule(topology) as schedule:
        record = schedule.lookup("order-42")
    assert record is not None
    assert record.state is ScheduleState.SCHEDULED  # recorded, never sent

    app = App(topology)
    seen = Seen()
    app.add_consumer(QUEUE, seen.handle)
    worker = RunningWorker("sync", app, broker_url, close_app=True).start()
    try:
        wait_for(lambda: seen.total >= 1, 30, "the message the sweeper republished")
        wait_for(
            lambda: Schedule(topology).lookup("order-42").state is ScheduleState.HANDLED,
            10,
            "the record handled",
        )
    finally:
        worker.stop()
    assert seen.bodies == Counter({b'{"order":42}': 1})


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancel_from_another_process_and_directory_drops_the_message(
    kind: str, broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    topology = schedule_topology(make_topology, tmp_path)
    declared(topology, broker_url)
    path = topology_file(topology, tmp_path)
    app = App(topology)
    seen = Seen()
    app.add_consumer(QUEUE, seen.handle)
    worker = RunningWorker(kind, app, broker_url, close_app=True).start()
    try:
        with Publisher(topology, broker_url) as publisher:
            publisher.publish_delayed({"order": 1}, "10s", queue=QUEUE, key="order-1")
            publisher.publish_delayed({"order": 2}, "10s", queue=QUEUE, key="order-2")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        script = textwrap.dedent(
            f"""
            import json, pathlib
            from rabbit_delay import topology_from_dict
            from rabbit_delay.sync import Schedule

            data = json.loads(pathlib.Path({str(path)!r}).read_text())
            with Schedule(topology_from_dict(data)) as schedule:
                print(schedule.cancel("order-1"))
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, cwd=elsewhere, timeout=60
        )
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode().strip() == "scheduled"
        wait_for(lambda: worker.worker.stats.cancelled >= 1, 20, "the cancelled copy dropped")
        wait_for(lambda: seen.total >= 1, 10, "the other message handled")
    finally:
        worker.stop()
    assert seen.bodies == Counter({b'{"order":2}': 1})


def test_without_the_schedule_a_cancel_outlives_the_retention(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    """The 10-second equivalent of "cancelled, it ran on day 30": a tombstone that lived
    for the app's retention (2 s here) was gone when the message came due (10 s)."""
    topology = make_topology(
        tiers={"1s": "1s", "10s": "10s"},
        idempotency={
            "store": "sqlite",
            "path": str(tmp_path / "idempotency.sqlite3"),
            "retention": "2s",
        },
    )
    declared(topology, broker_url)
    app = App(topology)
    assert app.tombstone_ms() >= 10_000 + app.lease_ms
    seen = Seen()
    app.add_consumer(QUEUE, seen.handle)
    with Publisher(topology, broker_url) as publisher:
        cancelled = publisher.publish_delayed({"order": 1}, "10s", queue=QUEUE)
        publisher.publish_delayed({"order": 2}, "10s", queue=QUEUE)
    assert app.cancel(cancelled) is None  # nothing is known without the schedule
    worker = RunningWorker("sync", app, broker_url, close_app=True).start()
    try:
        wait_for(lambda: worker.worker.stats.cancelled >= 1, 30, "the cancelled copy dropped")
        wait_for(lambda: seen.total >= 1, 10, "the other message handled")
    finally:
        worker.stop()
    assert seen.bodies == Counter({b'{"order":2}': 1})


def test_no_key_runs_twice_when_the_publish_is_refused_before_the_record(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    """Bad input is refused before anything is written: no record, no message."""
    topology = schedule_topology(make_topology, tmp_path)
    declared(topology, broker_url)
    with Publisher(topology, broker_url) as publisher:
        with pytest.raises(Exception, match="JSON values"):
            publisher.publish_delayed(
                {"order": 1}, "1s", queue=QUEUE, key="k", headers={"raw": b"\x00"}
            )
        with pytest.raises(Exception, match="non-empty string"):
            publisher.publish_delayed({"order": 1}, "1s", queue=QUEUE, key="")
        with pytest.raises(Exception, match="one queue"):
            publisher.publish_delayed({"order": 1}, "1s", routing_key="fan.out", key="k2")
    with Schedule(topology) as schedule:
        assert schedule.lookup("k") is None
        assert schedule.lookup("k2") is None
    assert os.path.exists(topology.idempotency.path)


def test_the_outbox_relay_and_a_transfer_record_what_they_publish(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    import sqlite3

    from rabbit_delay import topology_from_dict
    from rabbit_delay._ops.transfer.execute import transfer
    from rabbit_delay._ops.transfer.rules import Transfer
    from rabbit_delay.outbox import Outbox, Relay
    from rabbit_delay.sync import connect

    topology = schedule_topology(make_topology, tmp_path)
    declared(topology, broker_url)
    # the outbox: a row of the application's transaction, recorded by the relay under its
    # message_id as it publishes it
    db = tmp_path / "shop.db"
    conn = sqlite3.connect(db)
    outbox = Outbox(topology)
    outbox.install(conn)
    conn.commit()
    with conn:
        outbox.add(conn, {"order": 7}, "10s", queue=QUEUE, message_id="order-7")
    conn.close()
    with Relay(topology, f"sqlite:///{db}", url=broker_url) as relay:
        relay.run_once()
    with Schedule(topology) as schedule:
        relayed = schedule.lookup("order-7")
    assert relayed is not None
    assert (relayed.state, relayed.queue, relayed.generation) == (ScheduleState.SCHEDULED, QUEUE, 1)

    # a transfer into a topology version with [schedule]: each moved message recorded
    # under the key it carries (rd-key), its due time kept
    target = topology_from_dict(
        {"namespace": topology.namespace, "version": 2, **schedule_data(tmp_path / "v2")}
    )
    (tmp_path / "v2").mkdir()
    declared(target, broker_url)
    try:
        source = connect(broker_url)
        try:
            with Publisher(target, broker_url) as target_publisher:
                report = transfer(source, target_publisher, Transfer(topology, target))
        finally:
            source.close()
        assert report.error is None, report.error
        assert report.moved == 1
        with Schedule(target) as schedule:
            moved = schedule.lookup("order-7")
        assert moved is not None
        assert moved.state is ScheduleState.SCHEDULED
        assert abs(moved.due_ms - relayed.due_ms) <= 1_000  # rounded to the target's tiers
    finally:
        from conftest import delete_topology

        delete_topology(broker_url, target)


async def test_the_async_publisher_and_schedule(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    from rabbit_delay.aio import AsyncPublisher, AsyncSchedule

    topology = schedule_topology(make_topology, tmp_path)
    declared(topology, broker_url)
    async with AsyncPublisher(topology, broker_url) as publisher:
        first = await publisher.publish_delayed({"n": 1}, "10s", queue=QUEUE, key="a-1")
        assert (first.generation, first.placement.value) == (1, "created")
        ids = await publisher.publish_many(
            [{"n": 2}, {"n": 3}], "10s", queue=QUEUE, keys=["a-2", "a-3"]
        )
        assert [i.key for i in ids] == ["a-2", "a-3"]  # type: ignore[attr-defined]
        schedule = publisher.schedule
        assert (await schedule.lookup("a-2")).state is ScheduleState.SCHEDULED
        assert await schedule.reschedule("a-2", "1s") is ScheduleState.SCHEDULED
        assert (await schedule.lookup("a-2")).generation == 2
        assert await schedule.cancel("a-3") is ScheduleState.SCHEDULED
        page = await schedule.list(state="scheduled")
        assert [r.key for r in page] == ["a-2", "a-1"]  # in due order
        timeline = await schedule.timeline(span="1m", bucket="5s")
        assert sum(n for _, n in timeline) == 2
    # without a publisher, it reads, lists and cancels; reschedule needs one
    async with AsyncSchedule(topology) as alone:
        assert (await alone.lookup("a-1")).generation == 1
        with pytest.raises(Exception, match="publishes"):
            await alone.reschedule("a-1", "1s")


def test_workers_in_two_processes_sharing_postgresql_run_no_key_twice(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    import signal
    import time
    import uuid

    psycopg = pytest.importorskip("psycopg")
    pg_url = os.environ.get(
        "RABBIT_DELAY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
    )
    try:
        psycopg.connect(pg_url, connect_timeout=3).close()
    except Exception as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no PostgreSQL at {pg_url}: {exc}")
        pytest.skip(f"no PostgreSQL at {pg_url}: {exc}")
    schema = "rd_test_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in pg_url else "?"
    store_url = f"{pg_url}{sep}options=-csearch_path%3D{schema}"
    workers: list[subprocess.Popen[bytes]] = []
    logs = contextlib.ExitStack()
    try:
        data = {
            **schedule_data(tmp_path),
            "idempotency": {"store": "postgres", "url": store_url},
        }
        topology = make_topology(**data)
        declared(topology, broker_url)
        path = tmp_path / "topology.json"
        path.write_text(json.dumps({"namespace": topology.namespace, **data}))
        effects = tmp_path / "effects"
        effects.mkdir()
        (tmp_path / "shared_app.py").write_text(
            textwrap.dedent(
                f"""
                import json, os, pathlib
                from rabbit_delay import App, topology_from_dict

                data = json.loads(pathlib.Path({str(path)!r}).read_text())
                app = App(topology_from_dict(data))
                out = pathlib.Path({str(effects)!r}) / f"{{os.getpid()}}.txt"

                @app.consumer({QUEUE!r})
                def handle(msg: bytes, ctx) -> None:
                    with out.open("a") as f:
                        f.write(ctx.headers["rd-key"] + "\\n")
                """
            )
        )
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "RABBIT_DELAY_URL": broker_url}
        for transport in ("sync", "async"):
            # each worker's log to a file (a pipe nobody reads would fill up and block it)
            log = logs.enter_context((tmp_path / f"worker-{transport}.log").open("wb"))
            workers.append(
                subprocess.Popen(
                    [
                        str(Path(sys.executable).with_name("rabbit-delay")),
                        "worker",
                        "shared_app:app",
                        "--transport",
                        transport,
                    ],
                    env=env,
                    cwd=tmp_path,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )

        # Both consuming before the first publish: on a loaded machine one process once
        # took every message while the other was still starting.
        def consumers() -> int:
            conn = pika.BlockingConnection(pika.URLParameters(broker_url))
            try:
                queue = topology.names.business_queue(QUEUE)
                declared_ok = conn.channel().queue_declare(queue, passive=True)
                return int(declared_ok.method.consumer_count)
            finally:
                conn.close()

        wait_for(lambda: consumers() >= 2, 60, "both workers consuming")
        keys = [f"order-{n}" for n in range(200)]
        with Publisher(topology, broker_url) as publisher:
            bodies = [{"n": n} for n in range(200)]
            publisher.publish_many(bodies, "1s", queue=QUEUE, keys=keys)
            # every key published again (replace): 400 messages, 200 of them stale
            publisher.publish_many(bodies, "1s", queue=QUEUE, keys=keys)

        def handled() -> list[str]:
            return [line for f in effects.glob("*.txt") for line in f.read_text().split()]

        wait_for(lambda: len(handled()) >= 200, 60, "200 keys handled")
        with Schedule(topology) as schedule:
            wait_for(
                lambda: schedule.list(state="scheduled", limit=1) == [],
                30,
                "every record handled",
            )
            dropped = sum(schedule.lookup(k).dropped for k in keys)
        time.sleep(1.0)  # a copy run twice would show now
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(timeout=30)
        logs.close()
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    runs = Counter(handled())
    assert sorted(runs) == sorted(keys)
    assert set(runs.values()) == {1}  # no key ran twice
    assert dropped == 200  # every stale copy dropped
    assert len(list(effects.glob("*.txt"))) == 2, "both workers took part"


def test_the_async_workers_sweeper_uses_an_async_only_store(
    broker_url: str, make_topology: MakeTopology, tmp_path: Path
) -> None:
    """Found by bench_schedule.py: with App(store=AsyncRedisStore(...)), the sweeper (a
    `def` reconciler on a thread) asked the app for its sync store and failed every run."""
    import uuid

    redis = pytest.importorskip("redis")
    from rabbit_delay.stores import AsyncRedisStore, RedisStore

    url = os.environ.get("RABBIT_DELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no Redis at {url}: {exc}")
        pytest.skip(f"no Redis at {url}: {exc}")
    prefix = f"rd-test:{uuid.uuid4().hex}:"
    topology = schedule_topology(make_topology, tmp_path, grace="1s", sweep_every="1s")
    declared(topology, broker_url)
    try:
        publisher_store = RedisStore(url, prefix=prefix)
        with Publisher(topology, broker_url, store=publisher_store) as publisher:
            publisher.publish_delayed({"order": 5}, "1s", queue=QUEUE, key="order-5")
        publisher_store.close()
        assert purge(broker_url, topology.tier_queues("1s")[0]) == 1
        app = App(topology, store=AsyncRedisStore(url, prefix=prefix))
        seen = Seen()
        app.add_consumer(QUEUE, seen.handle)
        worker = RunningWorker("async", app, broker_url, close_app=True).start()
        try:
            wait_for(lambda: seen.total >= 1, 30, "the message the sweeper republished")
        finally:
            worker.stop()
        assert seen.bodies == Counter({b'{"order":5}': 1})
    finally:
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
