"""The transactional outbox against real databases (SQLite files, the PostgreSQL on
5432) and a real RabbitMQ: rolled-back rows are never published, a relay killed with
SIGKILL mid-batch loses nothing (duplicates carry the same message_id, counted), two
relays at once publish no row twice, the due time counts from the row's creation, sent
rows are cleaned up after the retention, and the CLI.

Each test has a table of its own (PostgreSQL: dropped afterwards; SQLite: a file in
tmp_path) and a topology in a namespace of its own. PostgreSQL: $RABBIT_DELAY_TEST_POSTGRES_URL,
else postgresql://postgres@127.0.0.1:5432/test; unreachable, its tests skip locally and
FAIL under CI=1.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
from conftest import message_count, wait_for

from rabbit_delay import ConfigError, DuplicateMessageError, OutboxError, Topology
from rabbit_delay import _headers as h
from rabbit_delay.outbox import Outbox, Relay
from rabbit_delay.sync import connect, declare

pytestmark = [pytest.mark.integration]

PG_URL_ENV = "RABBIT_DELAY_TEST_POSTGRES_URL"
PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
QUEUE = "orders.cancel"
PARK = "park"  # 1 h: relayed messages wait in its buffer, read from there by the tests


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = os.environ.get(PG_URL_ENV, PG_DEFAULT_URL)
    try:
        import psycopg

        psycopg.connect(url, connect_timeout=3).close()
    except Exception as exc:
        reason = f"no PostgreSQL at {url} ({type(exc).__name__}: {exc}); set {PG_URL_ENV}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return url


@dataclass
class Db:
    """One outbox table on one database: `url` for the relay, `connect()` for the app."""

    dialect: str
    url: str
    table: str
    connect: Callable[[], Any]


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    table = "outbox_" + uuid.uuid4().hex[:10]
    if request.param == "sqlite":
        path = tmp_path / "app.db"
        init = sqlite3.connect(path)
        init.execute("PRAGMA journal_mode=WAL")
        init.close()
        yield Db("sqlite", f"sqlite:///{path}", table, lambda: sqlite3.connect(path, timeout=10))
        return
    import psycopg

    url = request.getfixturevalue("pg_url")
    yield Db("postgresql", url, table, lambda: psycopg.connect(url))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def toml_for(topology: Topology) -> str:
    tiers = "\n".join(f'"{name}" = "{ms}ms"' for name, ms in topology.tiers.items())
    text = f'namespace = "{topology.namespace}"\n[tiers]\n{tiers}\n'
    for queue in topology.queues:
        text += f'[queues."{queue}"]\n'
    if topology.cascade is not None:
        text += f"[cascade]\nlevels = {topology.cascade.levels}\n"
        text += f'resolution = "{topology.cascade.resolution}ms"\n'
    return text


@pytest.fixture
def declared(make_topology: Callable[..., Topology], broker_url: str) -> Callable[..., Topology]:
    def make(**overrides: Any) -> Topology:
        overrides.setdefault("tiers", {"1s": "1s", "3s": "3s", PARK: "1h"})
        overrides.setdefault("queues", {QUEUE: {}})
        topology = make_topology(**overrides)
        conn = connect(broker_url, name="rd-test outbox declare")
        try:
            declare(conn, topology)
        finally:
            conn.close()
        return topology

    return make


def add_rows(db: Db, outbox: Outbox, n: int, tier: str = PARK, **kwargs: Any) -> list[str]:
    conn = db.connect()
    try:
        outbox.install(conn)
        conn.commit()
        ids = [outbox.add(conn, {"n": i}, tier, queue=QUEUE, **kwargs) for i in range(n)]
        conn.commit()
        return ids
    finally:
        conn.close()


def drain(url: str, queue: str) -> list[tuple[str, dict[str, Any]]]:
    """Every message in `queue` (message_id, headers), taken off it: consumed with a
    large prefetch (a basic.get per message would cost a round trip each)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        waiting = channel.queue_declare(queue, passive=True).method.message_count
        channel.basic_qos(prefetch_count=1_000)
        got: list[tuple[str, dict[str, Any]]] = []
        deadline = time.monotonic() + 60
        for method, props, _body in channel.consume(queue, inactivity_timeout=0.2):
            if method is not None:
                got.append((props.message_id, dict(props.headers or {})))
                channel.basic_ack(method.delivery_tag)
            elif len(got) >= waiting or time.monotonic() > deadline:
                break
        channel.cancel()
        return got
    finally:
        conn.close()


def sent_rows(db: Db) -> int:
    conn = db.connect()
    try:
        cur = conn.cursor()
        cur.execute(f"SELECT count(*) FROM {db.table} WHERE sent_at IS NOT NULL")
        return int(cur.fetchone()[0])
    finally:
        conn.close()


def relay_command(db: Db, topology_file: Path, url: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "from rabbit_delay._cli.app import main; main()",
        "relay",
        str(topology_file),
        "--db",
        db.url,
        "--table",
        db.table,
        "--url",
        url,
        *args,
    ]


# -- a rolled-back row is never published ------------------------------------------------


def test_rolled_back_row_is_never_published(
    db: Db, declared: Callable[..., Topology], broker_url: str
) -> None:
    topology = declared()
    outbox = Outbox(topology, table=db.table)
    conn = db.connect()
    try:
        outbox.install(conn)
        conn.commit()
        kept = outbox.add(conn, {"order": 1}, PARK, queue=QUEUE, message_id="kept")
        conn.commit()
        outbox.add(conn, {"order": 2}, PARK, queue=QUEUE, message_id="rolled-back")
        conn.rollback()
        # the same id may be used again: the rolled-back row never existed
        again = outbox.add(conn, {"order": 3}, PARK, queue=QUEUE, message_id="rolled-back-2")
        conn.rollback()
    finally:
        conn.close()
    with Relay(topology, db.url, table=db.table, url=broker_url) as relay:
        stats = relay.run_once()
        assert relay.pending() == 0
    assert stats.relayed == 1
    got = drain(broker_url, topology.names.tier_queue(PARK))
    assert [m for m, _ in got] == [kept]
    assert again not in {m for m, _ in got}


# -- kill -9 mid-batch: every committed row at least once, duplicates counted -------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_relay_killed_mid_batch_loses_nothing(
    db: Db, declared: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> None:
    n, batch = 2_000, 1_000
    topology = declared()
    topology_file = tmp_path / "topology.toml"
    topology_file.write_text(toml_for(topology), encoding="utf-8")
    outbox = Outbox(topology, table=db.table)
    ids = add_rows(db, outbox, n)
    buffer = topology.names.tier_queue(PARK)

    watch = pika.BlockingConnection(pika.URLParameters(broker_url))
    watch_channel = watch.channel()
    watch_db = db.connect()

    def published() -> int:
        return int(watch_channel.queue_declare(buffer, passive=True).method.message_count)

    def marked() -> int:
        cur = watch_db.cursor()
        cur.execute(f"SELECT count(*) FROM {db.table} WHERE sent_at IS NOT NULL")
        found = int(cur.fetchone()[0])
        watch_db.rollback()  # PostgreSQL: a fresh snapshot for the next look
        return found

    output = tmp_path / "relay.log"
    with output.open("wb") as sink:
        proc = subprocess.Popen(
            relay_command(db, topology_file, broker_url, "--batch", str(batch), "--lease", "1s"),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        # Kill it mid-batch: once the broker holds messages of rows not marked sent yet.
        def mid_batch() -> bool:
            return published() > marked() or proc.poll() is not None

        wait_for(mid_batch, 60, "published rows not marked yet", interval=0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        watch.close()
        watch_db.close()
    sent_at_kill = sent_rows(db)
    published_at_kill = message_count(broker_url, buffer)
    assert sent_at_kill < n, f"the relay finished before it was killed:\n{output.read_text()}"

    # A new relay (SQLite: once the dead relay's 1 s lease ran out) publishes the rest.
    with Relay(topology, db.url, table=db.table, url=broker_url, lease="1s") as relay:
        wait_for(lambda: relay.run_once() is not None and relay.pending() == 0, 60, "all sent")
    got = drain(broker_url, buffer)
    counts = Counter(m for m, _ in got)
    lost = set(ids) - set(counts)
    duplicates = len(got) - len(counts)
    print(
        f"\n{db.dialect}: {n} rows; killed with {sent_at_kill} marked sent and "
        f"{published_at_kill} published; delivered {len(got)}, distinct {len(counts)}, "
        f"lost {len(lost)}, duplicates {duplicates}"
    )
    assert lost == set(), f"{len(lost)} committed row(s) never published"
    assert set(counts) == set(ids), "a message the outbox never held"
    # Killed mid-batch: the copies are exactly the rows published but not marked when
    # the relay died, each under its row's message_id (counted by id above).
    assert duplicates > 0
    assert duplicates == published_at_kill - sent_at_kill
    assert all(c <= 2 for c in counts.values())
    assert all(headers[h.H_TIER] == PARK for _, headers in got)


# -- several relays at once -----------------------------------------------------------------


@pytest.mark.slow
def test_two_relays_at_once_publish_no_row_twice(
    db: Db, declared: Callable[..., Topology], broker_url: str
) -> None:
    """PostgreSQL: SKIP LOCKED hands each relay other rows. SQLite: the relays take
    turns for their short claim and mark transactions (one writer at a time) and
    publish in parallel; leases keep them off each other's rows."""
    n = 1_000
    topology = declared()
    outbox = Outbox(topology, table=db.table)
    ids = add_rows(db, outbox, n)
    relays = [
        Relay(topology, db.url, table=db.table, url=broker_url, batch=25).open() for _ in range(2)
    ]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(relay: Relay) -> None:
        try:
            start.wait(10)
            deadline = time.monotonic() + 60
            while relay.pending() and time.monotonic() < deadline:
                relay.run_once()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in relays]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        for r in relays:
            r.close()
    assert errors == []
    got = drain(broker_url, topology.names.tier_queue(PARK))
    counts = Counter(m for m, _ in got)
    shares = [r.stats.relayed for r in relays]
    print(f"\n{db.dialect}: two relays relayed {shares}, {len(got)} delivered")
    assert set(counts) == set(ids)
    assert len(got) == n, f"{len(got) - n} row(s) published twice"
    assert sum(shares) == n
    assert all(share > 0 for share in shares), f"one relay did all the work: {shares}"


# -- the due time counts from the row's creation ------------------------------------------


def arrivals(url: str, queues: list[str], expected: int, timeout: float) -> dict[str, Any]:
    """message_id -> (arrival time in ms, headers) for `expected` messages of `queues`,
    consumed at once (a message waiting in one queue would look late)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    got: dict[str, tuple[int, Any]] = {}
    try:
        channel = conn.channel()

        def on_message(ch: Any, method: Any, props: Any, _body: bytes) -> None:
            got[props.message_id] = (int(time.time() * 1000), dict(props.headers))
            ch.basic_ack(method.delivery_tag)

        for queue in queues:
            channel.basic_consume(queue, on_message)
        deadline = time.monotonic() + timeout
        while len(got) < expected and time.monotonic() < deadline:
            conn.process_data_events(0.02)
    finally:
        conn.close()
    return got


@pytest.mark.slow
def test_due_time_counts_from_creation(
    declared: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> None:
    """Created, relayed 2 s later: a cascade delivers at creation + delay, not creation +
    lag + delay; tiers take the shortest accepted tier not shorter than what remains
    (3s asked, 2 s lag: the 1s tier, on time; 1 s lag: 3s again, late by the lag). The
    lags are read from the clock around the relay (a loaded machine stretches them)."""
    tiers = declared(tiers={"1s": "1s", "3s": "3s"})
    cascade = declared(tiers={"1s": "1s"}, cascade={"levels": 8, "resolution": "100ms"})
    db = Db("sqlite", "", "outbox", lambda: sqlite3.connect(tmp_path / "due.db"))
    conn = db.connect()
    on_tiers, on_cascade = Outbox(tiers, table="outbox"), Outbox(cascade, table="outbox_c")
    on_tiers.install(conn)
    on_cascade.install(conn)
    # Each row's creation as the clock read just before and just after its add (a loaded
    # machine can spend milliseconds in between): rd-due-at tells exactly when.
    window: dict[str, tuple[float, float]] = {}
    before = time.time() * 1000
    on_tiers.add(conn, {"n": "a"}, "3s", queue=QUEUE, message_id="a")
    window["a"] = (before, time.time() * 1000)
    before = time.time() * 1000
    on_cascade.add(conn, {"n": "c"}, delay=3, queue=QUEUE, message_id="c")
    window["c"] = (before, time.time() * 1000)
    conn.commit()
    time.sleep(1.0)
    before = time.time() * 1000
    on_tiers.add(conn, {"n": "b"}, "3s", queue=QUEUE, message_id="b")
    window["b"] = (before, time.time() * 1000)
    conn.commit()
    conn.close()
    time.sleep(1.0)  # the relay's lag: 2 s for a and c, 1 s for b
    relayed = []  # when the tiers' relay started and ended
    for topology, table in ((tiers, "outbox"), (cascade, "outbox_c")):
        with Relay(topology, f"sqlite:///{tmp_path / 'due.db'}", table=table, url=broker_url) as r:
            relayed.append(time.time() * 1000)
            assert r.run_once().relayed == (2 if table == "outbox" else 1)
            relayed.append(time.time() * 1000)
    queues = [tiers.names.business_queue(QUEUE), cascade.names.business_queue(QUEUE)]
    on_time = arrivals(broker_url, queues, 3, 10)
    assert set(on_time) == {"a", "b", "c"}
    created: dict[str, float] = {}
    for m, (_, headers) in on_time.items():
        created[m] = headers[h.H_DUE_AT] - 3_000
        lo, hi = window[m]  # whole milliseconds: 1 ms of rounding either side
        assert lo - 1 <= created[m] <= hi + 1, f"rd-due-at of {m} is not its creation + 3 s"
        assert headers[h.H_DELAY_MS] == 3_000
    lag_b = (relayed[0] - created["b"], relayed[1] - created["b"])  # b's lag, at least / most
    late = {m: arrival - created[m] - 3_000 for m, (arrival, _) in on_time.items()}
    print(f"\nlate after creation + 3 s (ms): {late}")
    assert on_time["a"][1][h.H_TIER] == "1s"
    assert on_time["c"][1][h.H_TIER] == "cascade"
    assert all(v >= -5 for v in late.values()), f"early: {late}"
    # without the rule a and c would be 2 s late (creation + lag + delay)
    assert late["a"] < 1_000
    assert late["c"] < 1_000
    print(f"b relayed {lag_b[0]:.0f}-{lag_b[1]:.0f} ms after its creation")
    if lag_b[1] < 2_000:  # over 1 s remained: the 3s tier, late by its lag
        assert on_time["b"][1][h.H_TIER] == "3s"
        assert lag_b[0] - 5 <= late["b"] < lag_b[1] + 1_000
    elif lag_b[0] > 2_000:  # under 1 s remained: the 1s tier
        assert on_time["b"][1][h.H_TIER] == "1s"
    else:  # at the edge while the relay ran: either, never early (above)
        assert on_time["b"][1][h.H_TIER] in ("1s", "3s")


# -- retention --------------------------------------------------------------------------


def test_sent_rows_are_cleaned_up_after_the_retention(
    db: Db, declared: Callable[..., Topology], broker_url: str
) -> None:
    topology = declared()
    outbox = Outbox(topology, table=db.table)
    add_rows(db, outbox, 30)
    with Relay(topology, db.url, table=db.table, url=broker_url, retention="1h") as relay:
        assert relay.run_once().relayed == 30
        add_rows(db, outbox, 5)  # pending: never cleaned up
        assert relay.cleanup() == 0, "sent just now, within the retention"
        assert relay.cleanup(now=int(time.time() * 1000) + 3_600_000) == 30
        assert relay.pending() == 5
    drain(broker_url, topology.names.tier_queue(PARK))


# -- PostgreSQL specifics: the caller's transaction stays usable ----------------------------


def test_postgres_add_in_the_callers_transaction(
    pg_url: str, declared: Callable[..., Topology]
) -> None:
    import psycopg

    topology = declared()
    table = "outbox_" + uuid.uuid4().hex[:10]
    outbox = Outbox(topology, table=table)
    try:
        with psycopg.connect(pg_url) as conn:
            with pytest.raises(OutboxError, match="does not exist"):
                outbox.add(conn, {"n": 1}, PARK, queue=QUEUE)
            conn.rollback()  # PostgreSQL aborted the transaction: the error says so
            outbox.install(conn)
            conn.commit()
            outbox.add(conn, {"n": 1}, PARK, queue=QUEUE, message_id="one")
            with pytest.raises(DuplicateMessageError):
                outbox.add(conn, {"n": 2}, PARK, queue=QUEUE, message_id="one")
            outbox.add(conn, {"n": 3}, PARK, queue=QUEUE, message_id="two")  # still usable
            conn.commit()
            assert outbox.pending(conn) == 2
        with psycopg.connect(pg_url, autocommit=True) as auto:
            with pytest.raises(ConfigError, match="autocommit"):
                outbox.add(auto, {"n": 4}, PARK, queue=QUEUE)
            with auto.transaction():
                outbox.add(auto, {"n": 5}, PARK, queue=QUEUE)
            assert outbox.pending(auto) == 3
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


# -- the command line ---------------------------------------------------------------------


@pytest.mark.slow
def test_cli_once_json_install_refused_rows_and_redaction(
    pg_url: str, declared: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> None:
    import psycopg

    topology = declared()
    topology_file = tmp_path / "topology.toml"
    topology_file.write_text(toml_for(topology), encoding="utf-8")
    table = "outbox_" + uuid.uuid4().hex[:10]
    # trust authentication ignores the password: it must still never be printed
    secret_url = pg_url.replace("postgresql://postgres@", "postgresql://postgres:hunter2@")
    assert "hunter2" in secret_url
    db = Db("postgresql", secret_url, table, lambda: psycopg.connect(pg_url))
    try:
        once = relay_command(db, topology_file, broker_url, "--once", "--json", "--install")
        first = subprocess.run(once, capture_output=True, text=True, timeout=60, check=False)
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["relayed"] == 0  # --install made the table
        outbox = Outbox(topology, table=table)
        add_rows(db, outbox, 3)
        conn = db.connect()
        try:  # a row for a queue the relay's topology does not have
            cur = conn.cursor()
            cur.execute(
                f"UPDATE {table} SET queue = 'gone' WHERE id = (SELECT min(id) FROM {table})"
            )
            conn.commit()
        finally:
            conn.close()
        second = subprocess.run(once, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 1, second.stdout + second.stderr
        result = json.loads(second.stdout)
        assert (result["relayed"], result["refused"], result["pending"]) == (2, 1, 1)
        assert "unknown queue 'gone'" in second.stderr
        assert "kept, tried again later" in second.stderr
        for run in (first, second):
            assert "hunter2" not in run.stdout + run.stderr
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    assert len(drain(broker_url, topology.names.tier_queue(PARK))) == 2


@pytest.mark.slow
def test_cli_relay_stops_cleanly_on_sigterm(
    declared: Callable[..., Topology], broker_url: str, tmp_path: Path
) -> None:
    topology = declared()
    topology_file = tmp_path / "topology.toml"
    topology_file.write_text(toml_for(topology), encoding="utf-8")
    path = tmp_path / "app.db"
    db = Db("sqlite", f"sqlite:///{path}", "rabbit_delay_outbox", lambda: sqlite3.connect(path))
    outbox = Outbox(topology)
    add_rows(db, outbox, 10)
    output = tmp_path / "relay.log"
    with output.open("wb") as sink:
        proc = subprocess.Popen(
            relay_command(db, topology_file, broker_url, "--poll", "50ms"),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: sent_rows(db) == 10, 30, "the first rows relayed")
        add_rows(db, outbox, 5)  # relayed by the running relay, after a poll
        wait_for(lambda: sent_rows(db) == 15, 30, "rows added later relayed")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, output.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = output.read_text()
    assert "stopping after the batch in progress" in log
    assert "relayed 15 row(s)" in log
    assert len(drain(broker_url, topology.names.tier_queue(PARK))) == 15


# -- a row the broker returns is kept, the rest of its batch is marked ------------------------


def test_returned_row_is_kept_and_sent_once_the_topology_is_fixed(
    db: Db,
    declared: Callable[..., Topology],
    broker_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rabbit_delay.metrics import Metrics
    from rabbit_delay.outbox import _core

    # a refused row waits 1 s before it is tried again; 3 s here, so that the steps
    # between the refusal and the look (a declare) fit in it on a loaded machine
    monkeypatch.setattr(_core, "REFUSED_FIRST_MS", 3_000)

    topology = declared()
    outbox = Outbox(topology, table=db.table)
    kept = add_rows(db, outbox, 3)
    returned = add_rows(db, outbox, 1, tier="1s")[0]
    conn = connect(broker_url, name="rd-test outbox break")
    try:  # the 1s tier's buffer gone: its fanout exchange routes nowhere
        conn.channel().queue_delete(topology.names.tier_queue("1s"))
    finally:
        conn.close()
    metrics = Metrics()
    with Relay(topology, db.url, table=db.table, url=broker_url, metrics=metrics) as relay:
        first = relay.run_once()
        assert (first.relayed, first.refused, relay.pending()) == (3, 1, 1)
        assert returned in first.errors[0]
        assert "returned by the broker" in first.errors[0]
        assert [m for m, _ in drain(broker_url, topology.names.tier_queue(PARK))] == kept
        key = topology.names.queue_key(QUEUE)
        assert metrics.outbox_relayed_total.labels(queue=key, tier=PARK)._value.get() == 3
        refused = metrics.outbox_refused_total.labels(queue=key, reason="unroutable")
        assert refused._value.get() == 1
        conn = connect(broker_url, name="rd-test outbox fix")
        try:
            declare(conn, topology)
        finally:
            conn.close()
        assert relay.run_once().relayed == 0, "held back for 3 s after its refusal"
        time.sleep(3.1)
        assert relay.run_once().relayed == 1
        assert relay.pending() == 0
    # due by now (created over 1 s ago): straight to its queue, rd-due-at unchanged
    [(message_id, headers)] = drain(broker_url, topology.names.business_queue(QUEUE))
    assert (message_id, headers[h.H_TIER], headers[h.H_DELAY_MS]) == (returned, "now", 1_000)


def test_running_relay_outlives_a_database_failure(
    declared: Callable[..., Topology],
    broker_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`run()` logs a failing database and tries again (1 s, 2 s ...): here the table is
    missing when it starts, and created later with rows in it."""
    topology = declared()
    path = tmp_path / "late.db"
    sqlite3.connect(path).close()
    db = Db("sqlite", f"sqlite:///{path}", "rabbit_delay_outbox", lambda: sqlite3.connect(path))
    relay = Relay(topology, db.url, url=broker_url, poll="20ms")
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_for(lambda: "does not exist" in caplog.text, 10, "the failure logged")
        add_rows(db, Outbox(topology), 5)
        wait_for(lambda: relay.stats.relayed == 5, 15, "rows relayed after the fix")
    finally:
        relay.stop()
        thread.join(10)
        relay.close()
    assert not thread.is_alive()
    assert "trying again in" in caplog.text
    assert len(drain(broker_url, topology.names.tier_queue(PARK))) == 5
